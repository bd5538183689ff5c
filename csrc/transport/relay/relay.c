/* relay.c: the two ends of a relayed connection (docs/architecture.md,
 * "Relayed paths"; the bytes: relay.h).
 *
 * Initiator (add_peer's helper threads, the prober): connects to the relay,
 * asks it to forward to the peer's sealed listener, runs the key exchange
 * with the peer through it and hands the stream the plaintext end of a
 * tunnel (tunnel.c): the stream, the handshake and everything after it run
 * unchanged inside the seal, so the relay sees neither the region keys in
 * chunk frames nor the payloads, and any byte it changes ends the
 * connection (the chunks go again on other paths).
 *
 * Listener: a thread per agent accepts on the sealed port of each address,
 * a short-lived thread per connection runs the key exchange (at most
 * KVL_SEALED_PENDING at once, each within connect_timeout), and the
 * plaintext end goes to the engine as an accepted connection.  A connection
 * that finds every place taken evicts the oldest exchange still waiting (as
 * the data port does): one that holds the key answers within a round trip,
 * so silent strangers cannot keep it out.  (No bound per source address: a
 * relay brings every member's connections from its own.)
 *
 * The key: 32 random bytes per agent instance, handed out only in its
 * metadata (like region keys: whoever holds the metadata may connect). */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include "../../log.h"
#include "../../sha256.h"
#include "relay.h"
#include "tunnel.h"

#define KVL_SEALED_PENDING 32  /* key exchanges in progress at once */
#define KVL_SEALED_SLOTS (2 * KVL_SEALED_PENDING) /* and evicted ones, gone within ms */

typedef struct sealed_slot {
    int fd;
    uint32_t src;              /* the initiator's IPv4 (network order) */
    uint64_t t_ns;             /* accepted then */
    uint8_t used, evicted;     /* evicted: shut down for a newer one; its thread leaves */
} sealed_slot;
#define PLAIN_BUF (4 << 20)    /* the socketpair's buffers: a few records in flight */

typedef struct relay_state {
    uint8_t e2e[KVL_E2E_KEY];
    int fds[KVL_MAX_PATHS];
    uint16_t ports[KVL_MAX_PATHS];
    size_t n;
    pthread_t th;
    int started;
    atomic_int stop;
    atomic_int pending;        /* key-exchange threads alive */
    pthread_mutex_t slots_mu;  /* slots */
    sealed_slot slots[KVL_SEALED_SLOTS];
    atomic_ullong evicted;     /* exchanges cut for a newer connection */
    atomic_ullong log_t;       /* the last refusal logged (at most one a second) */
    kvl_forwarder *fwd;
    uint16_t relay_ports[KVL_MAX_PATHS];
} relay_state;

static relay_state *state_of(kvl_agent *a) { return a->relay_state; }

/* ---- the key exchange ---- */

typedef struct e2e_keys {
    uint8_t a2b[KVL_AEAD_KEY], b2a[KVL_AEAD_KEY];
    uint8_t a2b_salt[KVL_AEAD_SALT], b2a_salt[KVL_AEAD_SALT];
} e2e_keys;

static void mac(const uint8_t *key, size_t key_len, const char *label, const uint8_t *na,
                const uint8_t *nb, uint8_t out[KVL_SHA256_BYTES])
{
    kvl_hmac m;
    kvl_hmac_init(&m, key, key_len);
    kvl_hmac_update(&m, label, strlen(label));
    kvl_hmac_update(&m, na, KVL_RELAY_NONCE);
    kvl_hmac_update(&m, nb, KVL_RELAY_NONCE);
    kvl_hmac_final(&m, out);
}

static void derive(const uint8_t *key, size_t key_len, const uint8_t *na, const uint8_t *nb,
                   e2e_keys *k)
{
    uint8_t d[KVL_SHA256_BYTES];
    mac(key, key_len, "kvlink e2e key a2b", na, nb, k->a2b);
    mac(key, key_len, "kvlink e2e key b2a", na, nb, k->b2a);
    mac(key, key_len, "kvlink e2e salt a2b", na, nb, d);
    memcpy(k->a2b_salt, d, KVL_AEAD_SALT);
    mac(key, key_len, "kvlink e2e salt b2a", na, nb, d);
    memcpy(k->b2a_salt, d, KVL_AEAD_SALT);
    memset(d, 0, sizeof d);
}

/* Puts fd behind a tunnel; the stream's end of the pair in *plain_out. */
static kvl_err seal(kvl_agent *a, int fd, const e2e_keys *k, int initiator, const char *what,
                    int *plain_out, kvl_tunnel **t)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0) {
        close(fd);
        return kvl_fail_errno("relayed connection: socketpair");
    }
    int buf = PLAIN_BUF;
    for (int i = 0; i < 2; i++) {
        setsockopt(sv[i], SOL_SOCKET, SO_SNDBUF, &buf, sizeof buf);
        setsockopt(sv[i], SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0)
        fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
    kvl_aead *out = kvl_aead_new(initiator ? k->a2b : k->b2a, initiator ? k->a2b_salt : k->b2a_salt);
    kvl_aead *in = kvl_aead_new(initiator ? k->b2a : k->a2b, initiator ? k->b2a_salt : k->a2b_salt);
    if (!out || !in) {
        kvl_aead_free(out);
        kvl_aead_free(in);
        close(fd);
        close(sv[0]);
        close(sv[1]);
        kvl_err e = kvl_aead_load();
        return e ? e : kvl_fail(KVL_ERR_NOMEM, "relayed connection: out of memory");
    }
    kvl_err e = kvl_tunnel_start(a, sv[1], fd, out, in, what, t);
    if (e) {
        close(sv[0]);
        return e;
    }
    *plain_out = sv[0];
    return KVL_OK;
}

static void wrap_of(kvl_tunnel *t, kvl_tp_wrap *w, const char *note)
{
    memset(w, 0, sizeof *w);
    int fd = kvl_tunnel_outer_fd(t);
    socklen_t ll = sizeof w->local, pl = sizeof w->peer;
    getsockname(fd, (struct sockaddr *)&w->local, &ll);
    getpeername(fd, (struct sockaddr *)&w->peer, &pl);
    w->sample_fd = fd;
    w->release = kvl_tunnel_close;
    w->arg = t;
    snprintf(w->note, sizeof w->note, "%s", note);
}

/* ---- initiator ---- */

static kvl_err relay_connect(kvl_agent *a, const char *local, const char *via,
                             uint16_t via_port, const char *host, uint16_t port,
                             const uint8_t *key, size_t key_len, uint32_t timeout_ms,
                             kvl_ep **out)
{
    uint64_t deadline = kvl_now_ns() + (uint64_t)timeout_ms * 1000000ull;
    struct sockaddr_in ra = {.sin_family = AF_INET, .sin_port = htons(via_port)};
    struct in_addr target;
    if (inet_pton(AF_INET, via, &ra.sin_addr) != 1 || inet_pton(AF_INET, host, &target) != 1)
        return kvl_fail(KVL_ERR_INVALID_ARG, "relay %s / target %s: not IPv4 addresses", via,
                        host);
    if (key_len != KVL_E2E_KEY)
        return kvl_fail(KVL_ERR_INVALID_ARG,
                        "no end-to-end key for %s:%u: its metadata lacks \"e2e\" (an older "
                        "kvlink?), so no path to it can be relayed",
                        host, port);
    char why[200];
    int fd = kvl_relay_dial(local, &ra, timeout_ms, why, sizeof why);
    if (fd < 0)
        return kvl_fail(KVL_ERR_UNREACHABLE, "relay %s:%u: %s", via, via_port, why);
    /* the relay hop */
    uint8_t hello[4 + KVL_RELAY_NONCE], req[KVL_RELAY_REQ_MAX];
    size_t nreq = 0;
    const char *stage = "its greeting";
    if (kvl_relay_recv(fd, hello, sizeof hello, deadline, NULL) != 0)
        goto io_fail;
    if (memcmp(hello, KVL_RELAY_MAGIC, 4) != 0) {
        close(fd);
        return kvl_fail(KVL_ERR_HANDSHAKE, "%s:%u is not a kvlink relay (wrong greeting)", via,
                        via_port);
    }
    memcpy(req, KVL_RELAY_REQ, 4);
    memcpy(req + 4, &target.s_addr, 4);
    req[8] = (uint8_t)(port >> 8);
    req[9] = (uint8_t)port;
    size_t nl = strlen(a->name);
    req[10] = (uint8_t)nl;
    memcpy(req + 11, a->name, nl);
    nreq = 11 + nl;
    uint8_t m[KVL_SHA256_BYTES] = {0};
    if (a->secret_len) {
        kvl_hmac h;
        kvl_hmac_init(&h, a->secret, a->secret_len);
        kvl_hmac_update(&h, "kvlink relay request", 20);
        kvl_hmac_update(&h, hello + 4, KVL_RELAY_NONCE);
        kvl_hmac_update(&h, req, nreq);
        kvl_hmac_final(&h, m);
    }
    memcpy(req + nreq, m, sizeof m);
    nreq += sizeof m;
    stage = "the request";
    if (kvl_relay_send(fd, req, nreq, deadline) != 0)
        goto io_fail;
    uint8_t st[2];
    char msg[256] = "";
    stage = "its answer";
    if (kvl_relay_recv(fd, st, 2, deadline, NULL) != 0 ||
        (st[1] && kvl_relay_recv(fd, msg, st[1], deadline, NULL) != 0))
        goto io_fail;
    msg[st[1]] = 0;
    if (st[0] != KVL_RELAY_OK) {
        close(fd);
        return kvl_fail(st[0] == KVL_RELAY_AUTH ? KVL_ERR_AUTH : KVL_ERR_UNREACHABLE,
                        "relay %s:%u refused to forward to %s:%u: %s", via, via_port, host,
                        port, msg[0] ? msg : "no reason given");
    }
    /* end to end, through the relay: the peer's sealed port greets first (its
     * magic and nonce), then ours, its proof, ours (relay.h) */
    uint8_t na[4 + KVL_RELAY_NONCE], ans[4 + KVL_RELAY_NONCE + KVL_SHA256_BYTES];
    stage = "the peer's greeting";
    if (kvl_relay_recv(fd, ans, 4 + KVL_RELAY_NONCE, deadline, NULL) != 0)
        goto io_fail;
    if (memcmp(ans, KVL_E2E_MAGIC, 4) != 0) {
        close(fd);
        return kvl_fail(KVL_ERR_HANDSHAKE,
                        "%s:%u through relay %s:%u did not greet as a kvlink agent's sealed "
                        "port (an older kvlink, or not kvlink)",
                        host, port, via, via_port);
    }
    memcpy(na, KVL_E2E_MAGIC, 4);
    if (getrandom(na + 4, KVL_RELAY_NONCE, 0) != KVL_RELAY_NONCE) {
        close(fd);
        return kvl_fail_errno("getrandom");
    }
    stage = "the peer's key proof";
    if (kvl_relay_send(fd, na, sizeof na, deadline) != 0 ||
        kvl_relay_recv(fd, ans + 4 + KVL_RELAY_NONCE, KVL_SHA256_BYTES, deadline, NULL) != 0)
        goto io_fail;
    uint8_t want[KVL_SHA256_BYTES];
    mac(key, key_len, "kvlink e2e server", na + 4, ans + 4, want);
    if (!kvl_ct_equal(want, ans + 4 + KVL_RELAY_NONCE, sizeof want)) {
        close(fd);
        return kvl_fail(KVL_ERR_AUTH,
                        "%s:%u through relay %s:%u did not prove it holds the end-to-end key "
                        "of its metadata: stale metadata (the agent restarted: add it again), "
                        "or the relay forwarded elsewhere",
                        host, port, via, via_port);
    }
    mac(key, key_len, "kvlink e2e client", na + 4, ans + 4, want);
    stage = "our key proof";
    if (kvl_relay_send(fd, want, sizeof want, deadline) != 0)
        goto io_fail;
    e2e_keys k;
    derive(key, key_len, na + 4, ans + 4, &k);
    char what[128], note[96];
    snprintf(what, sizeof what, "relayed connection to %s:%u via %s:%u", host, port, via,
             via_port);
    snprintf(note, sizeof note, "relayed via %s:%u, sealed (AES-256-GCM)", via, via_port);
    int plain = -1;
    kvl_tunnel *t = NULL;
    kvl_err e = seal(a, fd, &k, 1, what, &plain, &t);
    memset(&k, 0, sizeof k);
    if (e)
        return e;
    kvl_tp_wrap w;
    wrap_of(t, &w, note);
    /* the stream reports the target as the far end, not the relay */
    struct sockaddr_in *pe = (struct sockaddr_in *)(void *)&w.peer;
    pe->sin_family = AF_INET;
    pe->sin_addr = target;
    pe->sin_port = htons(port);
    e = a->stream->adopt(a, plain, &w, out);
    return e;

io_fail:;
    int er = errno;
    close(fd);
    return kvl_fail(KVL_ERR_UNREACHABLE, "relay %s:%u (to %s:%u): %s failed: %s", via, via_port,
                    host, port, stage, er == ETIMEDOUT ? "timed out" : strerror(er));
}

/* ---- listener ---- */

typedef struct sealed_job {
    kvl_agent *a;
    int fd;
    int slot;
} sealed_job;

/* A place for a new exchange from src (under slots_mu), evicting the oldest
 * live exchange when KVL_SEALED_PENDING are (it is shut down: its thread sees
 * its socket end and leaves).  -1: every slot is still held by evicted ones. */
static int slot_take(relay_state *s, int fd, uint32_t src, uint64_t now)
{
    int live = 0, free_at = -1, oldest = -1;
    for (int i = 0; i < KVL_SEALED_SLOTS; i++) {
        sealed_slot *sl = &s->slots[i];
        if (!sl->used) {
            if (free_at < 0)
                free_at = i;
            continue;
        }
        if (sl->evicted)
            continue;
        live++;
        if (oldest < 0 || sl->t_ns < s->slots[oldest].t_ns)
            oldest = i;
    }
    if (free_at < 0)
        return -1;
    if (live >= KVL_SEALED_PENDING) {
        s->slots[oldest].evicted = 1;
        shutdown(s->slots[oldest].fd, SHUT_RDWR);
        atomic_fetch_add(&s->evicted, 1);
    }
    s->slots[free_at] = (sealed_slot){.fd = fd, .src = src, .t_ns = now, .used = 1};
    return free_at;
}

/* The exchange in slot i is over (under slots_mu).  Returns whether it had
 * been evicted meanwhile (then its connection is not to be used). */
static int slot_give(relay_state *s, int i)
{
    int evicted = s->slots[i].evicted;
    s->slots[i] = (sealed_slot){0};
    return evicted;
}

static void *sealed_main(void *arg)
{
    sealed_job *j = arg;
    kvl_agent *a = j->a;
    relay_state *s = state_of(a);
    int fd = j->fd, slot = j->slot;
    free(j);
    uint64_t deadline = kvl_now_ns() + (uint64_t)a->cfg.connect_timeout_ms * 1000000ull;
    uint8_t na[4 + KVL_RELAY_NONCE], ans[4 + KVL_RELAY_NONCE + KVL_SHA256_BYTES];
    uint8_t proof[KVL_SHA256_BYTES], want[KVL_SHA256_BYTES];
    char src[64] = "?", ip[INET_ADDRSTRLEN];
    struct sockaddr_in pa;
    socklen_t pl = sizeof pa;
    if (getpeername(fd, (struct sockaddr *)&pa, &pl) == 0 &&
        inet_ntop(AF_INET, &pa.sin_addr, ip, sizeof ip))
        snprintf(src, sizeof src, "%s:%u", ip, ntohs(pa.sin_port));
    kvl_relay_tune(fd); /* keep-alives and a user timeout: a vanished relay ends it */
    /* we greet first: a relay passes the client's bytes on only after it saw
     * our magic (relay.h), so the client's hello follows our greeting */
    memcpy(ans, KVL_E2E_MAGIC, 4);
    if (getrandom(ans + 4, KVL_RELAY_NONCE, 0) != KVL_RELAY_NONCE)
        goto drop;
    if (kvl_relay_send(fd, ans, 4 + KVL_RELAY_NONCE, deadline) != 0 ||
        kvl_relay_recv(fd, na, sizeof na, deadline, &s->stop) != 0 ||
        memcmp(na, KVL_E2E_MAGIC, 4) != 0)
        goto drop;
    mac(s->e2e, sizeof s->e2e, "kvlink e2e server", na + 4, ans + 4,
        ans + 4 + KVL_RELAY_NONCE);
    if (kvl_relay_send(fd, ans + 4 + KVL_RELAY_NONCE, KVL_SHA256_BYTES, deadline) != 0 ||
        kvl_relay_recv(fd, proof, sizeof proof, deadline, &s->stop) != 0)
        goto drop;
    mac(s->e2e, sizeof s->e2e, "kvlink e2e client", na + 4, ans + 4, want);
    if (!kvl_ct_equal(want, proof, sizeof want)) {
        if (kvl_relay_log_ok(&s->log_t))
            kvl_log(a, KVL_LOG_WARNING, NULL, -1,
                "refused a relayed connection from %s: it does not hold this agent's "
                "end-to-end key (its metadata of this agent is stale, or it never had it)",
                src);
        goto drop;
    }
    pthread_mutex_lock(&s->slots_mu);
    int evicted = slot_give(s, slot);
    slot = -1; /* proven: no newer connection can evict it any more */
    pthread_mutex_unlock(&s->slots_mu);
    if (evicted)
        goto drop;
    e2e_keys k;
    derive(s->e2e, sizeof s->e2e, na + 4, ans + 4, &k);
    char what[128];
    snprintf(what, sizeof what, "relayed connection from %s", src);
    int plain = -1;
    kvl_tunnel *t = NULL;
    kvl_err e = seal(a, fd, &k, 0, what, &plain, &t);
    memset(&k, 0, sizeof k);
    if (e == KVL_OK) {
        kvl_tp_wrap w;
        char note[96];
        snprintf(note, sizeof note, "relayed from %s, sealed (AES-256-GCM)", src);
        wrap_of(t, &w, note);
        kvl_engine_accept(a, plain, &w); /* closes and releases when it cannot */
    } else {
        kvl_log(a, KVL_LOG_WARNING, NULL, -1, "relayed connection from %s: %s", src,
                kvl_last_error());
    }
    atomic_fetch_sub(&s->pending, 1);
    return NULL;
drop:
    if (slot >= 0) {
        pthread_mutex_lock(&s->slots_mu);
        slot_give(s, slot);
        pthread_mutex_unlock(&s->slots_mu);
    }
    close(fd);
    atomic_fetch_sub(&s->pending, 1);
    return NULL;
}

static void *accept_main(void *arg)
{
    kvl_agent *a = arg;
    relay_state *s = state_of(a);
    struct pollfd p[KVL_MAX_PATHS];
    for (size_t i = 0; i < s->n; i++)
        p[i] = (struct pollfd){.fd = s->fds[i], .events = POLLIN};
    while (!atomic_load(&s->stop)) {
        int n = poll(p, (nfds_t)s->n, 100);
        for (size_t i = 0; n > 0 && i < s->n; i++) {
            if (!(p[i].revents & POLLIN))
                continue;
            struct sockaddr_in from = {0};
            socklen_t fl = sizeof from;
            int fd = accept4(s->fds[i], (struct sockaddr *)&from, &fl,
                             SOCK_CLOEXEC | SOCK_NONBLOCK);
            if (fd < 0) {
                if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED)
                    usleep(100000); /* out of descriptors or memory: no busy loop */
                continue;
            }
            pthread_mutex_lock(&s->slots_mu);
            int slot = slot_take(s, fd, from.sin_addr.s_addr, kvl_now_ns());
            pthread_mutex_unlock(&s->slots_mu);
            if (slot < 0) {
                close(fd); /* evicted ones not gone yet: the initiator retries later */
                continue;
            }
            atomic_fetch_add(&s->pending, 1);
            sealed_job *j = malloc(sizeof *j);
            pthread_t th;
            pthread_attr_t at;
            pthread_attr_init(&at);
            pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
            pthread_attr_setstacksize(&at, 128 << 10);
            if (j)
                *j = (sealed_job){.a = a, .fd = fd, .slot = slot};
            if (!j || pthread_create(&th, &at, sealed_main, j) != 0) {
                free(j);
                pthread_mutex_lock(&s->slots_mu);
                slot_give(s, slot);
                pthread_mutex_unlock(&s->slots_mu);
                close(fd);
                atomic_fetch_sub(&s->pending, 1);
            }
            pthread_attr_destroy(&at);
        }
    }
    return NULL;
}

static kvl_err listen_on(const char *host, uint16_t *port, int *out)
{
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(*port)};
    if (inet_pton(AF_INET, host, &sa.sin_addr) != 1)
        return kvl_fail(KVL_ERR_INVALID_ARG, "'%s' is not an IPv4 address", host);
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return kvl_fail_errno("socket");
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, (struct sockaddr *)&sa, sizeof sa) < 0 || listen(fd, 128) < 0) {
        int er = errno;
        close(fd);
        return kvl_fail(KVL_ERR_SYSTEM, "cannot listen on %s:%u: %s", host, *port, strerror(er));
    }
    socklen_t sl = sizeof sa;
    getsockname(fd, (struct sockaddr *)&sa, &sl);
    *port = ntohs(sa.sin_port);
    *out = fd;
    return KVL_OK;
}

static void relay_stop(kvl_agent *a)
{
    relay_state *s = state_of(a);
    if (!s) {
        /* agent_free: every endpoint is freed, and freeing one ends its tunnel
         * (kvl_tunnel_close): the threads return at once; they log through a,
         * which must outlive them */
        while (atomic_load(&a->relay_tunnels) > 0)
            usleep(1000);
        return;
    }
    atomic_store(&s->stop, 1);
    if (s->started)
        pthread_join(s->th, NULL);
    /* key exchanges see stop within 100 ms (their waits poll it) */
    while (atomic_load(&s->pending) > 0)
        usleep(10000);
    for (size_t i = 0; i < s->n; i++)
        close(s->fds[i]);
    if (s->fwd)
        kvl_forwarder_stop(s->fwd);
    memset(s->e2e, 0, sizeof s->e2e);
    pthread_mutex_destroy(&s->slots_mu);
    free(s);
    a->relay_state = NULL;
}

static kvl_err relay_start(kvl_agent *a)
{
    relay_state *s = calloc(1, sizeof *s);
    if (!s)
        return kvl_fail(KVL_ERR_NOMEM, "agent_create: out of memory");
    pthread_mutex_init(&s->slots_mu, NULL);
    a->relay_state = s;
    if (getrandom(s->e2e, sizeof s->e2e, 0) != sizeof s->e2e)
        return kvl_fail_errno("agent_create: getrandom");
    kvl_err e = KVL_OK;
    if (a->cfg.sealed_listen) {
        for (size_t i = 0; !e && i < a->n_addrs; i++) {
            uint16_t port = a->cfg.sealed_port;
            if ((e = listen_on(a->addrs[i], &port, &s->fds[i])) == KVL_OK) {
                s->ports[i] = port;
                s->n++;
            }
        }
        if (!e && pthread_create(&s->th, NULL, accept_main, a) == 0)
            s->started = 1;
        else if (!e)
            e = kvl_fail(KVL_ERR_SYSTEM, "agent_create: cannot start the sealed listener");
    }
    if (!e && a->cfg.relay)
        e = kvl_forwarder_start(a, &s->fwd, s->relay_ports);
    return e;
}

static void relay_info(kvl_agent *a, kvl_relay_info *out)
{
    relay_state *s = state_of(a);
    memset(out, 0, sizeof *out);
    if (!s)
        return;
    memcpy(out->e2e_key, s->e2e, sizeof out->e2e_key);
    out->n_sealed = (uint32_t)s->n;
    for (size_t i = 0; i < s->n; i++)
        out->sealed_ports[i] = s->ports[i];
    if (s->fwd) {
        kvl_forwarder_stats(s->fwd, out);
        for (size_t i = 0; i < out->n_relay; i++)
            out->relay_ports[i] = s->relay_ports[i];
    }
}

const kvl_relay_ops kvl_relay_transport = {
    .connect = relay_connect,
    .start = relay_start,
    .stop = relay_stop,
    .info = relay_info,
};
