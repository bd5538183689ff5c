/* peer.c: connecting to a peer (versioned handshake on every connection)
 * and the peer's region table.
 *
 * Connecting runs in the caller's thread with blocking sockets and
 * deadlines; once every connection is up the engine adopts them through
 * the command queue.
 */
#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

/* Remote address index for local address i: the one on the same /24
 * (rail-aligned NICs), else by index. */
static size_t pair_remote(const char *local, const char *const *hosts, size_t n, size_t i)
{
    struct in_addr la, ra;
    if (inet_pton(AF_INET, local, &la) == 1 && (ntohl(la.s_addr) >> 24) != 127) {
        for (size_t j = 0; j < n; j++)
            if (inet_pton(AF_INET, hosts[j], &ra) == 1 &&
                (ntohl(la.s_addr) >> 8) == (ntohl(ra.s_addr) >> 8))
                return j;
    }
    return i % n;
}

/* Connect + handshake; *instance: the one expected (0: any), then the one met.
 * via: the relay of a relayed data path, else NULL. */
static kvl_err open_conn(kvl_agent *a, kvl_peer *p, const char *local, const char *host,
                         uint16_t port, int kind, uint16_t path, const kvl_route *via,
                         uint64_t *instance, kvl_ep **ep)
{
    char where[160];
    if (via)
        snprintf(where, sizeof where, "%s:%u via relay '%s' (%s:%u)", host, port, via->via_name,
                 via->via, via->via_port);
    else
        snprintf(where, sizeof where, "%s:%u", host, port);
    uint64_t deadline = kvl_now_ns() + (uint64_t)a->cfg.connect_timeout_ms * 1000000ull;
    *ep = NULL;
    kvl_err e = via ? kvl_relay()->connect(a, local, via->via, via->via_port, host, port, p->e2e,
                                           p->e2e_len, a->cfg.connect_timeout_ms, ep)
                    : a->stream->connect(a, local, host, port, a->cfg.connect_timeout_ms, ep);
    if (e)
        return kvl_fail(e, "peer '%s': %s", p->name, kvl_last_error());
    e = kvl_handshake_initiate(a, p, *ep, kind, path, local, where, deadline, instance);
    if (e) {
        a->stream->discard(*ep);
        *ep = NULL;
    }
    return e;
}

kvl_err kvl_peer_open_conn(kvl_agent *a, kvl_peer *p, const char *local, const char *host,
                           uint16_t port, int kind, uint16_t path, kvl_ep **ep, uint64_t *met)
{
    uint64_t instance = p->instance; /* fixed once the peer is adopted */
    kvl_route via = {0};
    const kvl_path *pa = kind == KVL_CONN_DATA && path < p->n_paths ? &p->paths[path] : NULL;
    if (pa && pa->via[0]) {
        snprintf(via.via, sizeof via.via, "%s", pa->via);
        via.via_port = pa->via_port;
        snprintf(via.via_name, sizeof via.via_name, "%s", pa->via_name);
    }
    kvl_err e = open_conn(a, p, local, host, port, kind, path, via.via[0] ? &via : NULL,
                          &instance, ep);
    *met = instance != p->instance ? instance : 0;
    return e;
}

/* One connection being opened by its own thread: add_peer connects every
 * path (and the control connection) at once. */
typedef struct conn_job {
    kvl_agent *a;
    kvl_peer *p;
    const char *local, *host;
    uint16_t port, path;
    int kind;
    const kvl_route *via;      /* a relayed data path's relay, else NULL */
    uint64_t instance;
    kvl_ep *ep;
    kvl_err err;
    /* the whole of a refusal's reason: two 63-byte agent names, an address and the advice
     * take ~300 bytes (256 cut "... or something else answers th") */
    char msg[512];
    pthread_t thread;
    int started;
} conn_job;

static void *conn_job_main(void *arg)
{
    conn_job *j = arg;
    j->err = open_conn(j->a, j->p, j->local, j->host, j->port, j->kind, j->path, j->via,
                       &j->instance, &j->ep);
    if (j->err)
        snprintf(j->msg, sizeof j->msg, "%s", kvl_last_error());
    return NULL;
}

static void run_jobs(conn_job *jobs, size_t n)
{
    for (size_t i = 0; i < n; i++)
        jobs[i].started = pthread_create(&jobs[i].thread, NULL, conn_job_main, &jobs[i]) == 0;
    for (size_t i = 0; i < n; i++) {
        if (jobs[i].started)
            pthread_join(jobs[i].thread, NULL);
        else
            conn_job_main(&jobs[i]); /* no thread to spare: connect in line */
    }
}

void kvl_peer_free(kvl_peer *p)
{
    kvl_notify_free_all(p);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    free(p->regions);
    if (p->keys)
        explicit_bzero(p->keys, p->cap_keys * sizeof *p->keys);
    free(p->keys);
    free(p);
}

/* Takes p out of the callers' list (under a->mu) and has the engine retire it. */
static void unlink_and_retire(kvl_agent *a, kvl_peer *p, kvl_cmd *cmd, const char *why)
{
    for (kvl_peer **pp = &a->peers; *pp; pp = &(*pp)->next)
        if (*pp == p) {
            *pp = p->next;
            break;
        }
    p->replaced = 1;
    cmd->type = KVL_CMD_REMOVE_PEER;
    cmd->peer = p;
    snprintf(cmd->error, sizeof cmd->error, "%s", why);
}

kvl_err kvl_peer_remove(kvl_agent *a, const char *name)
{
    kvl_clear_error();
    if (!a || !name)
        return kvl_fail(KVL_ERR_INVALID_ARG, "remove_peer: NULL argument");
    if (atomic_load(&a->closed))
        return kvl_fail(KVL_ERR_CLOSED, "the agent is closed");
    kvl_cmd *cmd = calloc(1, sizeof *cmd);
    if (!cmd)
        return kvl_fail(KVL_ERR_NOMEM, "remove_peer: out of memory");
    pthread_mutex_lock(&a->mu);
    kvl_peer *p = a->peers;
    while (p && strcmp(p->name, name) != 0)
        p = p->next;
    if (p)
        unlink_and_retire(a, p, cmd, "removed by remove_peer()");
    pthread_mutex_unlock(&a->mu);
    if (!p) {
        free(cmd);
        return kvl_fail(KVL_ERR_UNKNOWN_PEER,
                        "remove_peer: no peer named '%s' (never added, or removed already)", name);
    }
    kvl_engine_post(a, cmd);
    return KVL_OK;
}

static int any_path_up(kvl_peer *p)
{
    /* the engine's hints: caller threads read no path state */
    return atomic_load(&p->may_work) && !atomic_load(&p->gone);
}

/* Whether the agent behind old may still run, asked of the kernel rather
 * than the engine: a killed agent's sockets close at once, but the engine
 * marks its paths down only after it read the close and a reconnect failed.
 * Some listen address of old still accepting a connection (and not now the
 * new metadata's) counts as alive.  The data path addresses are copied under
 * a->mu: they are set before the peer is published and never change. */
typedef struct old_addr {
    char local[48], rhost[48];
    uint16_t rport;
} old_addr;

typedef struct old_addrs {
    uint32_t n;
    old_addr at[KVL_MAX_PATHS];
} old_addrs;

static int old_agent_listens(kvl_agent *a, const old_addrs *old, const char *const *hosts,
                             const uint16_t *ports, size_t n)
{
    for (uint32_t i = 0; i < old->n; i++) {
        const old_addr *pa = &old->at[i];
        int taken = 0; /* the new agent listens there now */
        for (size_t j = 0; j < n; j++)
            taken |= ports[j] == pa->rport && strcmp(hosts[j], pa->rhost) == 0;
        kvl_ep *ep = NULL;
        if (taken || !pa->rhost[0] ||
            a->stream->connect(a, pa->local, pa->rhost, pa->rport, a->cfg.connect_timeout_ms, &ep))
            continue;
        a->stream->discard(ep);
        return 1;
    }
    return 0;
}

kvl_err kvl_peer_connect(kvl_agent *a, const char *name, uint64_t instance,
                         const char *const *hosts, const uint16_t *ports, size_t n,
                         uint32_t flags, kvl_peer **out)
{
    kvl_clear_error();
    if (!a || !name || !hosts || !ports || !out)
        return kvl_fail(KVL_ERR_INVALID_ARG, "add_peer: NULL argument");
    if (n == 0 || n > KVL_MAX_PATHS)
        return kvl_fail(KVL_ERR_INVALID_ARG, "peer '%s' metadata lists %zu addresses (1..%d)",
                        name, n, KVL_MAX_PATHS);
    kvl_route routes[KVL_MAX_PATHS];
    memset(routes, 0, sizeof routes);
    for (size_t k = 0; k < a->n_addrs; k++) {
        routes[k].local = (uint32_t)k;
        routes[k].remote = (uint32_t)pair_remote(a->addrs[k], hosts, n, k);
    }
    return kvl_peer_connect_routes(a, name, instance, hosts, ports, n, flags, routes, a->n_addrs,
                                   NULL, 0, out);
}

/* Checks a caller's routes against this agent's addresses and the peer's. */
static kvl_err check_routes(const kvl_agent *a, const char *name, size_t n,
                            const kvl_route *routes, size_t n_routes, size_t e2e_len)
{
    if (!routes || n_routes == 0 || n_routes > KVL_MAX_PATHS)
        return kvl_fail(KVL_ERR_INVALID_ARG, "add_peer('%s'): %zu paths (1..%d)", name, n_routes,
                        KVL_MAX_PATHS);
    for (size_t i = 0; i < n_routes; i++) {
        const kvl_route *r = &routes[i];
        if (r->local >= a->n_addrs || r->remote >= n)
            return kvl_fail(KVL_ERR_INVALID_ARG,
                            "add_peer('%s'): path %zu names local address %u (of %zu) and "
                            "remote %u (of %zu)",
                            name, i, r->local, a->n_addrs, r->remote, n);
        if (memchr(r->via, 0, sizeof r->via) == NULL ||
            memchr(r->via_name, 0, sizeof r->via_name) == NULL)
            return kvl_fail(KVL_ERR_INVALID_ARG, "add_peer('%s'): path %zu: relay unterminated",
                            name, i);
        if (r->via[0] && e2e_len != 32)
            return kvl_fail(KVL_ERR_INVALID_ARG,
                            "add_peer('%s'): path %zu goes through relay '%s' but the peer's "
                            "metadata has no end-to-end key (\"e2e\"): an older kvlink cannot "
                            "be reached through a relay",
                            name, i, r->via_name);
    }
    return KVL_OK;
}

kvl_err kvl_peer_connect_routes(kvl_agent *a, const char *name, uint64_t instance,
                                const char *const *hosts, const uint16_t *ports, size_t n,
                                uint32_t flags, const kvl_route *routes, size_t n_routes,
                                const uint8_t *e2e_key, size_t e2e_len, kvl_peer **out)
{
    kvl_clear_error();
    if (!a || !name || !hosts || !ports || !out || (e2e_len && !e2e_key))
        return kvl_fail(KVL_ERR_INVALID_ARG, "add_peer: NULL argument");
    if (atomic_load(&a->closed))
        return kvl_fail(KVL_ERR_CLOSED, "add_peer: the agent is closed");
    if (!name[0] || strlen(name) >= KVL_NAME_MAX)
        return kvl_fail(KVL_ERR_INVALID_ARG, "peer name must be 1..%d bytes", KVL_NAME_MAX - 1);
    if (strcmp(name, a->name) == 0)
        return kvl_fail(KVL_ERR_DUPLICATE_NAME,
                        "peer name '%s' is this agent's own name: every agent needs a unique "
                        "name",
                        name);
    if (n == 0 || n > KVL_MAX_PATHS)
        return kvl_fail(KVL_ERR_INVALID_ARG, "peer '%s' metadata lists %zu addresses (1..%d)",
                        name, n, KVL_MAX_PATHS);
    kvl_err ce = check_routes(a, name, n, routes, n_routes, e2e_len);
    if (ce)
        return ce;

    pthread_mutex_lock(&a->mu);
    kvl_peer *old = NULL;
    for (kvl_peer *q = a->peers; q; q = q->next)
        if (!q->replaced && strcmp(q->name, name) == 0)
            old = q;
    if (old && any_path_up(old) && (instance == 0 || instance == old->instance)) {
        pthread_mutex_unlock(&a->mu);
        *out = old;
        return KVL_OK;
    }
    int conflict = old && any_path_up(old);
    old_addrs was = {.n = conflict ? old->n_paths : 0};
    for (uint32_t i = 0; i < was.n; i++) {
        snprintf(was.at[i].local, sizeof was.at[i].local, "%s", old->paths[i].local);
        snprintf(was.at[i].rhost, sizeof was.at[i].rhost, "%s", old->paths[i].rhost);
        was.at[i].rport = old->paths[i].rport;
    }
    uint64_t old_instance = old ? old->instance : 0;
    pthread_mutex_unlock(&a->mu);
    if (conflict && old_agent_listens(a, &was, hosts, ports, n))
        return kvl_fail(KVL_ERR_PEER_EXISTS,
                        "peer '%s' is already connected as instance %016llx and this metadata "
                        "names instance %016llx: two live agents share the name (if the old "
                        "one is gone, remove_peer('%s') first)",
                        name, (unsigned long long)old_instance, (unsigned long long)instance,
                        name);

    kvl_peer *p = calloc(1, sizeof *p);
    if (!p)
        return kvl_fail(KVL_ERR_NOMEM, "add_peer: out of memory");
    p->agent = a;
    strcpy(p->name, name);
    p->instance = instance;
    p->flags = flags & KVL_PEER_SAME_HOST;
    /* the session token: the same on every connection to this name, also
     * after remove_peer + add_peer, and unguessable without this agent's seed */
    kvl_hmac tm;
    uint8_t mac[KVL_MAC_BYTES];
    kvl_hmac_init(&tm, a->token_seed, sizeof a->token_seed);
    kvl_hmac_update(&tm, name, strlen(name));
    kvl_hmac_final(&tm, mac);
    memcpy(p->token, mac, sizeof p->token);
    pthread_mutex_init(&p->mu, NULL);
    kvl_cond_init(&p->cv);

    if (e2e_len == sizeof p->e2e) {
        memcpy(p->e2e, e2e_key, sizeof p->e2e);
        p->e2e_len = e2e_len;
    }

    /* every data path and the control connection (from address 0) at once */
    p->n_paths = (uint32_t)n_routes;
    conn_job jobs[KVL_MAX_PATHS + 1];
    memset(jobs, 0, sizeof jobs);
    size_t ctrl_remote = pair_remote(a->addrs[0], hosts, n, 0);
    jobs[0] = (conn_job){.a = a, .p = p, .local = a->addrs[0], .host = hosts[ctrl_remote],
                         .port = ports[ctrl_remote], .path = 0, .instance = instance,
                         .kind = KVL_CONN_CONTROL};
    for (uint32_t k = 0; k < p->n_paths; k++) {
        const kvl_route *rt = &routes[k];
        /* the route first: the handshake reads whether the path is relayed */
        kvl_path_init(&p->paths[k], k, rt->local, a->addrs[rt->local], hosts[rt->remote],
                      ports[rt->remote], rt, NULL);
        jobs[k + 1] = (conn_job){.a = a, .p = p, .local = a->addrs[rt->local],
                                 .host = hosts[rt->remote], .port = ports[rt->remote],
                                 .path = (uint16_t)k, .instance = instance,
                                 .kind = KVL_CONN_DATA, .via = rt->via[0] ? rt : NULL};
    }
    run_jobs(jobs, p->n_paths + 1);
    kvl_err e = KVL_OK;
    int up = 0;
    for (uint32_t i = 0; i <= p->n_paths; i++) {
        conn_job *jb = &jobs[i];
        if (!jb->via && (jb->err == KVL_ERR_DUPLICATE_NAME || jb->err == KVL_ERR_HANDSHAKE ||
                         jb->err == KVL_ERR_AUTH)) {
            e = kvl_fail(jb->err, "%s", jb->msg); /* the peer refuses us */
            break;
        }
        if (!jb->err && instance == 0)
            instance = jb->instance;
        if (!jb->err && jb->instance != instance) {
            e = kvl_fail(KVL_ERR_HANDSHAKE,
                         "peer '%s' answers as instance %016llx on one address and %016llx on "
                         "another: two agents share the name",
                         name, (unsigned long long)instance, (unsigned long long)jb->instance);
            break;
        }
        if (i && !jb->err)
            up++;
    }
    /* the control connection goes over any direct path that works: if
     * address 0 failed, try the pairs whose data path connected */
    for (uint32_t k = 0; !e && jobs[0].err && up && k < p->n_paths; k++) {
        if (jobs[k + 1].err || jobs[k + 1].via)
            continue;
        conn_job *c = &jobs[0];
        char first[sizeof c->msg];
        snprintf(first, sizeof first, "%s", c->msg);
        c->local = jobs[k + 1].local;
        c->host = jobs[k + 1].host;
        c->port = jobs[k + 1].port;
        c->instance = instance;
        conn_job_main(c);
        if (c->err)
            snprintf(c->msg, sizeof c->msg, "%s", first);
    }
    if (!e && (jobs[0].err || !up)) {
        conn_job *bad = jobs[0].err ? &jobs[0] : &jobs[1];
        e = kvl_fail(KVL_ERR_UNREACHABLE, "peer '%s': %s; %s", name,
                     jobs[0].err ? "no control connection" : "no data path connected",
                     bad->msg);
    }
    p->instance = instance;
    kvl_path_route(&p->ctrl_path, jobs[0].local, jobs[0].host, jobs[0].port);
    for (uint32_t i = 0; i < p->n_paths; i++) {
        kvl_path *pa = &p->paths[i];
        const kvl_route *rt = &routes[i];
        kvl_path_init(pa, i, rt->local, a->addrs[rt->local], hosts[rt->remote], ports[rt->remote],
                      rt, jobs[i + 1].ep);
        if (jobs[i + 1].err)
            kvl_path_never_connected(p, pa, jobs[i + 1].msg);
    }
    kvl_peer_update_hint(p);
    if (e) {
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", kvl_last_error());
        for (uint32_t i = 0; i <= p->n_paths; i++)
            if (jobs[i].ep)
                a->stream->discard(jobs[i].ep);
        kvl_peer_free(p);
        return kvl_fail(e, "%s", msg);
    }

    kvl_cmd *cmd = calloc(1, sizeof *cmd);
    if (!cmd) {
        a->stream->discard(jobs[0].ep);
        for (uint32_t i = 0; i < p->n_paths; i++)
            if (p->paths[i].ep)
                a->stream->discard(p->paths[i].ep);
        kvl_peer_free(p);
        return kvl_fail(KVL_ERR_NOMEM, "add_peer: out of memory");
    }
    /* the engine adopts the sockets when it takes the command */
    p->ctrl_ep = jobs[0].ep;
    cmd->type = KVL_CMD_ADOPT_PEER;
    cmd->peer = p;
    /* DEFER_RETIRE: kvl_peer_retire_replaced retires it later */
    kvl_cmd *retire = old && !(flags & KVL_PEER_DEFER_RETIRE) ? calloc(1, sizeof *retire) : NULL;
    pthread_mutex_lock(&a->mu);
    int old_listed = 0;
    for (kvl_peer *q = a->peers; old && q; q = q->next)
        old_listed |= q == old;
    if (old_listed && retire)
        unlink_and_retire(a, old, retire, "replaced by a newer connection of the same name");
    else if (old_listed) /* deferred, or out of memory to retire it: hidden until retired */
        old->replaced = 1;
    p->next = a->peers;
    a->peers = p;
    pthread_mutex_unlock(&a->mu);
    kvl_engine_post(a, cmd);
    if (old_listed && retire)
        kvl_engine_post(a, retire);
    else
        free(retire);
    /* return once the engine owns the connections, so paths() shows them;
     * the engine takes commands within one loop iteration */
    struct timespec ts = kvl_deadline_ts(5000);
    pthread_mutex_lock(&p->mu);
    int wrc = 0;
    while (!p->adopted && !atomic_load(&a->stopping) && wrc == 0)
        wrc = pthread_cond_timedwait(&p->cv, &p->mu, &ts);
    pthread_mutex_unlock(&p->mu);
    *out = p;
    return KVL_OK;
}

kvl_err kvl_peer_retire_replaced(kvl_agent *a)
{
    kvl_clear_error();
    if (!a)
        return kvl_fail(KVL_ERR_INVALID_ARG, "retire_replaced: NULL agent");
    for (;;) {
        kvl_cmd *retire = calloc(1, sizeof *retire);
        if (!retire)
            return kvl_fail(KVL_ERR_NOMEM, "retire_replaced: out of memory");
        pthread_mutex_lock(&a->mu);
        kvl_peer *old = a->peers;
        while (old && !old->replaced)
            old = old->next;
        if (old)
            unlink_and_retire(a, old, retire, "replaced by a newer connection of the same name");
        pthread_mutex_unlock(&a->mu);
        if (!old) {
            free(retire);
            return KVL_OK;
        }
        kvl_engine_post(a, retire);
    }
}

kvl_err kvl_peer_send_prepare(kvl_peer *p, const void *tag, size_t len)
{
    kvl_clear_error();
    kvl_agent *a = p->agent;
    if (atomic_load(&a->closed))
        return kvl_fail(KVL_ERR_CLOSED, "the agent is closed");
    if (len > KVL_MAX_TAG || (len && !tag))
        return kvl_fail(KVL_ERR_INVALID_ARG, "prepare: the tag must be at most %d bytes",
                        KVL_MAX_TAG);
    kvl_cmd *cmd = calloc(1, sizeof *cmd);
    uint8_t *copy = malloc(len ? len : 1);
    if (!cmd || !copy) {
        free(cmd);
        free(copy);
        return kvl_fail(KVL_ERR_NOMEM, "prepare: out of memory");
    }
    memcpy(copy, tag, len);
    cmd->type = KVL_CMD_PREPARE;
    cmd->peer = p;
    cmd->tag = copy;
    cmd->tag_len = (uint32_t)len;
    kvl_engine_post(a, cmd);
    return KVL_OK;
}

kvl_err kvl_peer_find(kvl_agent *a, const char *name, kvl_peer **out)
{
    kvl_clear_error();
    if (atomic_load(&a->closed))
        return kvl_fail(KVL_ERR_CLOSED, "the agent is closed");
    pthread_mutex_lock(&a->mu);
    kvl_peer *p = a->peers;
    while (p && (p->replaced || strcmp(p->name, name) != 0))
        p = p->next;
    pthread_mutex_unlock(&a->mu);
    if (!p)
        return kvl_fail(KVL_ERR_UNKNOWN_PEER,
                        "no peer named '%s': call add_peer() with its metadata first", name);
    *out = p;
    return KVL_OK;
}

kvl_err kvl_peer_set_key(kvl_peer *p, uint64_t id, const uint8_t key[16])
{
    kvl_clear_error();
    if (!p || !key)
        return kvl_fail(KVL_ERR_INVALID_ARG, "set_key: NULL argument");
    kvl_err e = KVL_OK;
    pthread_mutex_lock(&p->mu);
    size_t lo = 0, hi = p->n_keys;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (p->keys[mid].id < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo < p->n_keys && p->keys[lo].id == id) {
        memcpy(p->keys[lo].key, key, KVL_KEY_BYTES);
    } else if (p->n_keys >= KVL_MAX_REGIONS) {
        e = kvl_fail(KVL_ERR_INVALID_ARG, "peer '%s': more than %d region keys", p->name,
                     KVL_MAX_REGIONS);
    } else {
        if (p->n_keys == p->cap_keys) {
            size_t ncap = p->cap_keys ? p->cap_keys * 2 : 8;
            kvl_rkey_entry *nk = calloc(ncap, sizeof *nk);
            if (!nk) {
                pthread_mutex_unlock(&p->mu);
                return kvl_fail(KVL_ERR_NOMEM, "set_key: out of memory");
            }
            if (p->keys) {
                memcpy(nk, p->keys, p->n_keys * sizeof *nk);
                explicit_bzero(p->keys, p->cap_keys * sizeof *p->keys);
                free(p->keys);
            }
            p->keys = nk;
            p->cap_keys = ncap;
        }
        memmove(&p->keys[lo + 1], &p->keys[lo], (p->n_keys - lo) * sizeof *p->keys);
        p->keys[lo].id = id;
        memcpy(p->keys[lo].key, key, KVL_KEY_BYTES);
        p->n_keys++;
    }
    pthread_mutex_unlock(&p->mu);
    return e;
}

kvl_err kvl_peer_regions(kvl_peer *p, kvl_region_info *out, size_t cap, size_t *n)
{
    kvl_clear_error();
    pthread_mutex_lock(&p->mu);
    for (size_t i = 0; i < p->n_regions && i < cap; i++)
        out[i] = p->regions[i];
    *n = p->n_regions;
    pthread_mutex_unlock(&p->mu);
    return KVL_OK;
}

kvl_err kvl_peer_refresh(kvl_peer *p, uint32_t timeout_ms)
{
    kvl_clear_error();
    kvl_agent *a = p->agent;
    if (atomic_load(&a->closed))
        return kvl_fail(KVL_ERR_CLOSED, "the agent is closed");
    kvl_cmd *cmd = calloc(1, sizeof *cmd);
    if (!cmd)
        return kvl_fail(KVL_ERR_NOMEM, "refresh: out of memory");
    pthread_mutex_lock(&p->mu);
    uint64_t gen = p->regions_gen;
    p->refresh_pending = 1;
    pthread_mutex_unlock(&p->mu);
    cmd->type = KVL_CMD_REFRESH;
    cmd->peer = p;
    kvl_engine_post(a, cmd);

    struct timespec ts = kvl_deadline_ts(timeout_ms);
    pthread_mutex_lock(&p->mu);
    int rcw = 0;
    while (p->regions_gen == gen && p->refresh_pending && rcw == 0)
        rcw = pthread_cond_timedwait(&p->cv, &p->mu, &ts);
    int ok = p->regions_gen != gen;
    pthread_mutex_unlock(&p->mu);
    if (!ok)
        return kvl_fail(KVL_ERR_UNREACHABLE,
                        "peer '%s' did not send its region table within %u ms", p->name,
                        timeout_ms);
    return KVL_OK;
}
