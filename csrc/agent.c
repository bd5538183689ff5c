/* agent.c: an agent's life (create, close, its configuration) and what the
 * engine thread's commands, ticks and iterations mean (kvl_loop_hooks for
 * loop.c): the one module that calls every other on the engine thread's
 * behalf.  Nothing calls up into it but the public API.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#define SCRATCH_BYTES (256u << 10) /* drain buffer for payloads nobody may receive */

/* ---- peers on the engine thread ---- */

static void adopt_peer(kvl_agent *a, kvl_peer *p)
{
    kvl_conn *c = kvl_conn_adopt(a, p->ctrl_ep);
    if (c)
        kvl_conn_bind_outbound(c, p, -1);
    p->ctrl = c;
    p->ctrl_ep = NULL;
    for (uint32_t i = 0; i < p->n_paths; i++) {
        kvl_path *pa = &p->paths[i];
        if (!pa->ep)
            continue;
        c = kvl_conn_adopt(a, pa->ep);
        if (c)
            kvl_conn_bind_outbound(c, p, (int)i);
        kvl_path_adopted(p, pa, c);
    }
    p->eng_next = a->eng_peers;
    a->eng_peers = p;
    kvl_engine_snapshot_paths(a);
    pthread_mutex_lock(&p->mu);
    p->adopted = 1;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

/* remove_peer / replaced: its transfers fail now; reap_peers frees it once
 * its frames have left (up to close_linger_ms) and no probe uses it. */
static void retire_peer(kvl_agent *a, kvl_peer *p, const char *why)
{
    p->retiring = 1;
    p->retire_by_ns = kvl_now_ns() + (uint64_t)a->cfg.close_linger_ms * 1000000ull;
    kvl_log(a, KVL_LOG_INFO, p->name, -1, "peer %s", why);
    for (kvl_xfer *x = p->active; x; x = x->next_active)
        if (kvl_xfer_running(x))
            kvl_sched_fail(x, KVL_ERR_CONN_LOST, "peer '%s' was %s", p->name, why);
    kvl_engine_snapshot_paths(a);
}

static int peer_has_output(const kvl_peer *p)
{
    if (p->ctrl && kvl_conn_has_output(p->ctrl))
        return 1;
    for (uint32_t i = 0; i < p->n_paths; i++)
        if (p->paths[i].conn && kvl_conn_has_output(p->paths[i].conn))
            return 1;
    return 0;
}

static void reap_peers(kvl_agent *a, uint64_t now)
{
    for (kvl_peer **pp = &a->eng_peers; *pp;) {
        kvl_peer *p = *pp;
        if (!p->retiring || p->active || p->probes ||
            (peer_has_output(p) && now < p->retire_by_ns)) {
            pp = &p->eng_next;
            continue;
        }
        if (p->ctrl)
            kvl_conn_fail(p->ctrl, KVL_OK, "peer removed");
        for (uint32_t i = 0; i < p->n_paths; i++)
            if (p->paths[i].conn)
                kvl_conn_fail(p->paths[i].conn, KVL_OK, "peer removed");
        *pp = p->eng_next;
        kvl_peer_free(p);
        kvl_engine_snapshot_paths(a);
    }
}

/* A submitted transfer joins its peer's FIFO (it retires from there). */
static void append_active(kvl_peer *p, kvl_xfer *x)
{
    x->next_active = NULL;
    if (p->active_tail)
        p->active_tail->next_active = x;
    else
        p->active = x;
    p->active_tail = x;
}

static void run_commands(kvl_agent *a, kvl_cmd *cmd)
{
    while (cmd) {
        kvl_cmd *next = cmd->next;
        kvl_peer *p = cmd->type == KVL_CMD_SUBMIT ? cmd->xfer->peer : cmd->peer;
        if (cmd->type == KVL_CMD_CANCEL) {
            /* (after its SUBMIT: commands run in order). Failing it drops its queued
             * copies; it is retired, and a push's END sent, once no I/O uses its memory */
            kvl_xfer *x = cmd->xfer;
            if (kvl_xfer_running(x))
                kvl_sched_fail(x, KVL_ERR_CANCELLED, "transfer %llu to peer '%s' was cancelled%s%s",
                               (unsigned long long)x->id, x->peer->name, cmd->error[0] ? ": " : "",
                               cmd->error);
            kvl_xfer_release(x);
        } else if (cmd->type == KVL_CMD_REGIONS) {
            for (kvl_conn *c = a->conns; c; c = kvl_conn_next(c))
                kvl_conn_regions_changed(c);
        } else if (cmd->type == KVL_CMD_ACCEPT) {
            a->stream->accept_fd(a, cmd->fd, &cmd->wrap);
        } else if (cmd->type == KVL_CMD_ADOPT_PEER) {
            adopt_peer(a, p);
        } else if (p && p->retiring && cmd->type != KVL_CMD_PROBED) {
            /* removed or replaced: new work fails, nothing else is started */
            if (cmd->type == KVL_CMD_SUBMIT) {
                append_active(p, cmd->xfer);
                kvl_sched_fail(cmd->xfer, KVL_ERR_CONN_LOST, "peer '%s' was removed", p->name);
            } else if (cmd->type == KVL_CMD_REFRESH) {
                pthread_mutex_lock(&p->mu);
                p->refresh_pending = 0; /* the waiter gives up now */
                pthread_cond_broadcast(&p->cv);
                pthread_mutex_unlock(&p->mu);
            }
            free(cmd->tag);
        } else if (cmd->type == KVL_CMD_SUBMIT) {
            append_active(p, cmd->xfer);
            /* with every path down it waits for one to come back, up to
             * its deadline (counted, and logged at the start of a wait) */
            kvl_sched_check_reachable(p);
        } else if (cmd->type == KVL_CMD_REMOVE_PEER) {
            retire_peer(a, p, cmd->error);
        } else if (cmd->type == KVL_CMD_PROBED) {
            kvl_prober_done(a, cmd);
        } else if (cmd->type == KVL_CMD_PREPARE) {
            kvl_buf b = {0};
            kvl_frame_start(&b);
            kvl_enc_notify(&b, 0, KVL_OP_PREPARE, cmd->tag, cmd->tag_len);
            kvl_frame_finish(&b, KVL_F_NOTIFY, 0);
            kvl_conn *c = p->ctrl;
            for (uint32_t i = 0; !c && i < p->n_paths; i++)
                c = p->paths[i].conn;
            if (c)
                kvl_conn_send_frame(c, &b);
            else
                kvl_buf_free(&b);
            kvl_monitor_probe_all(p, kvl_now_ns());
            free(cmd->tag);
        } else if (cmd->type == KVL_CMD_REFRESH) {
            kvl_buf b = {0};
            kvl_frame_start(&b);
            kvl_frame_finish(&b, KVL_F_REGIONS_REQ, 0);
            if (!p->ctrl || kvl_conn_send_frame(p->ctrl, &b) != 0) {
                pthread_mutex_lock(&p->mu);
                p->refresh_pending = 0; /* the waiter gives up now */
                pthread_cond_broadcast(&p->cv);
                pthread_mutex_unlock(&p->mu);
            }
        }
        free(cmd);
        cmd = next;
    }
}

/* close() was asked.  First call: running transfers fail (nothing new is
 * dispatched) and frames of theirs not yet started are dropped.  Then the
 * loop goes on until every queue is sent and every notification
 * acknowledged, or the linger time is up.  Returns 1 when it may stop. */
static int close_drained(kvl_agent *a, uint64_t now)
{
    if (!a->linger_end_ns) {
        a->linger_end_ns = now + (uint64_t)a->cfg.close_linger_ms * 1000000ull;
        for (kvl_peer *p = a->eng_peers; p; p = p->eng_next)
            for (kvl_xfer *x = p->active; x; x = x->next_active)
                if (kvl_xfer_running(x))
                    kvl_sched_fail(x, KVL_ERR_CLOSED,
                                   "the agent was closed while the transfer ran");
        for (kvl_conn *c = a->conns; c; c = kvl_conn_next(c))
            kvl_conn_drop_unstarted(c);
    }
    if (now >= a->linger_end_ns)
        return 1;
    for (kvl_peer *p = a->eng_peers; p; p = p->eng_next)
        if (p->active || kvl_notify_pending(p)) /* a failed push retires with its END */
            return 0;
    for (kvl_conn *c = a->conns; c; c = kvl_conn_next(c))
        if (kvl_conn_has_output(c))
            return 0;
    return 1;
}

/* ---- what a closing connection tells (conn.c's hooks) ---- */

static void outbound_lost(kvl_conn *c, kvl_peer *p, int path, int was_ctrl, const char *why)
{
    kvl_notify_conn_lost(p, c);
    if (path >= 0)
        kvl_sched_path_down(p, (uint32_t)path, why);
    else if (was_ctrl)
        kvl_path_failed(p, &p->ctrl_path, kvl_now_ns(), why);
}

static const kvl_conn_hooks agent_conn_hooks = {
    .payload_dropped = kvl_place_payload_dropped,
    .slot_free = kvl_place_slot_free,
    .outbound_lost = outbound_lost,
};

/* ---- the loop's hooks: what a tick and an iteration do ---- */

static void on_tick(kvl_agent *a, uint64_t now)
{
    kvl_monitor_tick(a, now);
    kvl_rx_expire(a, now);
    kvl_sched_expire(a, now);
    for (kvl_peer *p = a->eng_peers; p; p = p->eng_next)
        kvl_notify_resend(p, now);
    kvl_conn_expire(a, now);
    kvl_engine_snapshot_paths(a);
    kvl_engine_snapshot_inbound(a);
}

/* Dispatch, then free what this iteration retired: no handler ever sees a
 * freed transfer or connection. */
static void on_iteration_end(kvl_agent *a, uint64_t now)
{
    for (kvl_peer *p = a->eng_peers; p; p = p->eng_next)
        if (p->active && !atomic_load(&a->closing))
            kvl_sched_dispatch(p);
    kvl_sched_reap(a);
    reap_peers(a, now);
    kvl_conn_reap(a);
}

static const kvl_loop_hooks agent_hooks = {
    .commands = run_commands,
    .tick = on_tick,
    .stall_check = kvl_monitor_stall_check,
    .iteration_end = on_iteration_end,
    .busy = kvl_monitor_any_busy,
    .may_stop = close_drained,
};

/* ---- agent lifecycle ---- */

static kvl_err check_config(const kvl_config *cfg)
{
    if (!cfg->name || !cfg->name[0] || strlen(cfg->name) >= KVL_NAME_MAX)
        return kvl_fail(KVL_ERR_INVALID_ARG, "config.name must be 1..%d bytes", KVL_NAME_MAX - 1);
    if (!cfg->addrs || cfg->n_addrs == 0 || cfg->n_addrs > KVL_MAX_PATHS)
        return kvl_fail(KVL_ERR_INVALID_ARG, "config.addrs must list 1..%d addresses",
                        KVL_MAX_PATHS);
    for (size_t i = 0; i < cfg->n_addrs; i++) {
        struct in_addr ia;
        if (!cfg->addrs[i] || inet_pton(AF_INET, cfg->addrs[i], &ia) != 1)
            return kvl_fail(KVL_ERR_INVALID_ARG, "config.addrs[%zu] '%s' is not an IPv4 address",
                            i, cfg->addrs[i] ? cfg->addrs[i] : "(null)");
    }
    if (cfg->chunk_bytes < 4096 || cfg->chunk_bytes > KVL_MAX_CHUNK)
        return kvl_fail(KVL_ERR_INVALID_ARG, "config.chunk_bytes must be 4 KiB..1 GiB");
    if (cfg->min_chunk_bytes == 0 || cfg->min_chunk_bytes > cfg->chunk_bytes)
        return kvl_fail(KVL_ERR_INVALID_ARG, "config.min_chunk_bytes must be 1..chunk_bytes");
    if (cfg->secret_len && (!cfg->secret || cfg->secret_len < KVL_SECRET_MIN ||
                            cfg->secret_len > KVL_SECRET_MAX))
        return kvl_fail(KVL_ERR_INVALID_ARG,
                        "config.secret must be %d..%d bytes (got %zu): use a random one, e.g. "
                        "`openssl rand -hex 32`",
                        KVL_SECRET_MIN, KVL_SECRET_MAX, cfg->secret_len);
    if (cfg->io_threads > KVL_MAX_IO_THREADS)
        return kvl_fail(KVL_ERR_INVALID_ARG, "config.io_threads must be 0..%d (got %u)",
                        KVL_MAX_IO_THREADS, cfg->io_threads);
    if (!cfg->max_connections)
        return kvl_fail(KVL_ERR_INVALID_ARG, "config.max_connections must be positive");
    if (cfg->transport > KVL_TRANSPORT_FAULT)
        return kvl_fail(KVL_ERR_INVALID_ARG, "config.transport must be 0..3 (got %u)",
                        cfg->transport);
    if (cfg->fault_spec[0] && cfg->transport != KVL_TRANSPORT_FAULT)
        return kvl_fail(KVL_ERR_INVALID_ARG,
                        "config.fault_spec is for transport 3 (fault, tests only): clear it");
    kvl_err me = kvl_movers_usable(cfg, (uint32_t)cfg->secret_len);
    if (me)
        return me;
    if (!cfg->connect_timeout_ms || !cfg->monitor_interval_ms || !cfg->max_attempts ||
        !cfg->window_chunks || !cfg->stall_factor || !cfg->probe_backoff_max_ms)
        return kvl_fail(KVL_ERR_INVALID_ARG,
                        "config: connect_timeout_ms, monitor_interval_ms, max_attempts, "
                        "window_chunks, stall_factor and probe_backoff_max_ms must be positive");
    return KVL_OK;
}

/* Without a secret, anyone who reaches a listener may write its
 * remote_write regions: only loopback unless the user said otherwise. */
static kvl_err check_exposure(const kvl_config *cfg)
{
    for (size_t i = 0; !cfg->secret_len && !cfg->allow_unauthenticated && i < cfg->n_addrs; i++) {
        struct in_addr ia;
        inet_pton(AF_INET, cfg->addrs[i], &ia);
        if ((ntohl(ia.s_addr) >> 24) != 127)
            return kvl_fail(KVL_ERR_INVALID_ARG,
                            "agent '%s' would listen on %s without a secret, and any process "
                            "that reaches it could write its remote_write regions. Give every "
                            "agent the same cluster secret (Config(secret=...), or the "
                            "environment: KVLINK_SECRET or KVLINK_SECRET_FILE), or on a trusted "
                            "network allow it (allow_unauthenticated=True, or "
                            "KVLINK_ALLOW_UNAUTHENTICATED=1); docs/security.md",
                            cfg->name, cfg->addrs[i]);
    }
    return KVL_OK;
}

static void agent_free(kvl_agent *a)
{
    kvl_relay()->stop(a);
    a->stream->stop(a); /* every endpoint but the listeners is gone; they never had an I/O thread */
    for (size_t i = 0; a->listeners && i < a->n_addrs; i++)
        if (a->listeners[i]) {
            a->stream->close(a->listeners[i], 0);
            a->stream->free(a->listeners[i]);
        }
    if (a->epfd >= 0)
        close(a->epfd);
    if (a->wakefd >= 0)
        close(a->wakefd);
    kvl_regions_destroy(&a->regions);
    free(a->addrs);
    free(a->ports);
    free(a->listeners);
    free(a->scratch);
    kvl_stage_pool_destroy(a); /* after every connection: none holds a slot any more */
    pthread_mutex_destroy(&a->stage_mu);
    free(a->nics);
    free(a->snap);
    pthread_mutex_destroy(&a->mu);
    pthread_mutex_destroy(&a->notif_mu);
    pthread_cond_destroy(&a->notif_cv);
    pthread_mutex_destroy(&a->stats_mu);
    pthread_cond_destroy(&a->paths_cv);
    pthread_mutex_destroy(&a->inq_mu);
    pthread_cond_destroy(&a->inq_cv);
    pthread_mutex_destroy(&a->log_mu);
    pthread_cond_destroy(&a->log_cv);
    explicit_bzero(a->secret, sizeof a->secret);
    explicit_bzero(a->token_seed, sizeof a->token_seed);
    free(a);
}

kvl_err kvl_agent_create(const kvl_config *cfg, kvl_agent **out)
{
    kvl_clear_error();
    if (!cfg || !out)
        return kvl_fail(KVL_ERR_INVALID_ARG, "agent_create: NULL argument");
    kvl_err e = check_config(cfg);
    if (e)
        return e;
    kvl_agent *a = calloc(1, sizeof *a);
    if (!a)
        return kvl_fail(KVL_ERR_NOMEM, "agent_create: out of memory");
    a->epfd = a->wakefd = -1;
    pthread_mutex_init(&a->mu, NULL);
    pthread_mutex_init(&a->stage_mu, NULL);
    pthread_mutex_init(&a->notif_mu, NULL);
    pthread_mutex_init(&a->stats_mu, NULL);
    kvl_cond_init(&a->paths_cv);
    a->paths_gen = 1; /* never 0: kvl_paths_wait's "tell me the current one" */
    kvl_cond_init(&a->notif_cv);
    pthread_mutex_init(&a->inq_mu, NULL);
    kvl_cond_init(&a->inq_cv);
    pthread_mutex_init(&a->log_mu, NULL);
    kvl_cond_init(&a->log_cv);
    kvl_regions_init(&a->regions);
    a->cfg = *cfg;
    a->cfg.name = a->name;
    a->cfg.addrs = NULL;
    a->cfg.secret = NULL;
    a->secret_len = cfg->secret_len;
    if (cfg->secret_len)
        memcpy(a->secret, cfg->secret, cfg->secret_len);
    snprintf(a->name, sizeof a->name, "%s", cfg->name);
    a->stream = kvl_stream_default();
    a->hooks = &agent_hooks;
    a->conn_hooks = &agent_conn_hooks;
    a->revoke_rx = kvl_proto_revoke_rx;
    a->n_addrs = cfg->n_addrs;
    a->addrs = calloc(cfg->n_addrs, sizeof *a->addrs);
    a->ports = calloc(cfg->n_addrs, sizeof *a->ports);
    a->listeners = calloc(cfg->n_addrs, sizeof *a->listeners);
    a->scratch_len = SCRATCH_BYTES;
    a->scratch = malloc(a->scratch_len);
    if (!a->addrs || !a->ports || !a->listeners || !a->scratch) {
        agent_free(a);
        return kvl_fail(KVL_ERR_NOMEM, "agent_create: out of memory");
    }
    if (getrandom(&a->instance, sizeof a->instance, 0) != sizeof a->instance)
        a->instance = kvl_now_ns() ^ ((uint64_t)getpid() << 32);
    if (getrandom(&a->rx_seed, sizeof a->rx_seed, 0) != sizeof a->rx_seed ||
        getrandom(&a->shares.seed, sizeof a->shares.seed, 0) != sizeof a->shares.seed ||
        getrandom(a->token_seed, sizeof a->token_seed, 0) != sizeof a->token_seed) {
        e = kvl_fail_errno("agent_create: getrandom");
        agent_free(a);
        return e;
    }
    a->epfd = epoll_create1(EPOLL_CLOEXEC);
    a->wakefd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (a->epfd < 0 || a->wakefd < 0) {
        e = kvl_fail_errno("agent_create: epoll/eventfd");
        agent_free(a);
        return e;
    }
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    epoll_ctl(a->epfd, EPOLL_CTL_ADD, a->wakefd, &ev);
    for (size_t i = 0; i < cfg->n_addrs; i++) {
        snprintf(a->addrs[i], sizeof a->addrs[i], "%s", cfg->addrs[i]);
        uint16_t port = cfg->port;
        if ((e = a->stream->listen(a, a->addrs[i], &port, &a->listeners[i])) == KVL_OK)
            a->ports[i] = port;
        if (e) {
            agent_free(a);
            return e;
        }
    }
    /* after listen, so an address this host lacks is reported as such first */
    if ((e = check_exposure(cfg))) {
        agent_free(a);
        return e;
    }
    kvl_monitor_init(a);
    if ((e = a->stream->start(a, cfg->io_threads))) {
        agent_free(a);
        return e;
    }
    /* relayed connections arrive as commands: the engine takes them once it runs */
    if ((e = kvl_relay()->start(a))) {
        agent_free(a);
        return e;
    }
    if (kvl_prober_start(a) != KVL_OK) {
        e = kvl_fail(KVL_ERR_SYSTEM, "agent_create: cannot start the prober thread");
        agent_free(a);
        return e;
    }
    if (pthread_create(&a->thread, NULL, kvl_loop_main, a) != 0) {
        atomic_store(&a->stopping, 1);
        kvl_prober_stop(a);
        e = kvl_fail(KVL_ERR_SYSTEM, "agent_create: cannot start the engine thread");
        agent_free(a);
        return e;
    }
    a->thread_started = 1;
    for (size_t i = 0; !a->secret_len && i < a->n_addrs; i++)
        if (strncmp(a->addrs[i], "127.", 4) != 0) {
            kvl_log(a, KVL_LOG_WARNING, NULL, -1,
                    "agent '%s' listens on %s without authentication (allow_unauthenticated): "
                    "any process that reaches it may write its remote_write regions",
                    a->name, a->addrs[i]);
            break;
        }
    *out = a;
    return KVL_OK;
}

static void fail_and_drop(kvl_xfer *x)
{
    kvl_xfer_set_failed(x, KVL_ERR_CLOSED, "the agent was closed while the transfer ran");
    kvl_xfer_publish(x);
    kvl_xfer_release(x); /* the engine's reference */
}

kvl_err kvl_agent_close(kvl_agent *a)
{
    kvl_clear_error();
    if (!a)
        return KVL_OK;
    atomic_store(&a->closed, 1);
    /* no relayed connection arrives or is forwarded from here on */
    kvl_relay()->stop(a);
    /* the engine sends what is queued (bounded by close_linger_ms) and
     * exits; then everything stops */
    atomic_store(&a->closing, 1);
    pthread_mutex_lock(&a->inq_mu); /* kvl_inbound_next waiters give up now */
    pthread_cond_broadcast(&a->inq_cv);
    pthread_mutex_unlock(&a->inq_mu);
    pthread_mutex_lock(&a->stats_mu); /* ...and kvl_paths_wait ones */
    pthread_cond_broadcast(&a->paths_cv);
    pthread_mutex_unlock(&a->stats_mu);
    uint64_t one = 1;
    ssize_t rc = write(a->wakefd, &one, sizeof one);
    (void)rc;
    if (a->thread_started)
        pthread_join(a->thread, NULL);
    a->thread_started = 0;
    atomic_store(&a->stopping, 1);
    /* the engine first (it queues probe jobs), then the prober (it posts
     * commands, which the teardown below drains) */
    if (a->thread_started)
        pthread_join(a->thread, NULL);
    kvl_prober_stop(a);
    pthread_mutex_lock(&a->notif_mu);
    pthread_cond_broadcast(&a->notif_cv);
    pthread_mutex_unlock(&a->notif_mu);
    /* the engine is gone: everything below is single-threaded */
    kvl_conn_close_all(a);
    for (kvl_cmd *cmd = a->cmd_head, *next; cmd; cmd = next) {
        next = cmd->next;
        if (cmd->type == KVL_CMD_SUBMIT)
            fail_and_drop(cmd->xfer);
        if (cmd->type == KVL_CMD_CANCEL)
            kvl_xfer_release(cmd->xfer);
        if (cmd->type == KVL_CMD_PROBED && cmd->ep)
            a->stream->discard(cmd->ep);
        if (cmd->type == KVL_CMD_ACCEPT) {
            close(cmd->fd);
            if (cmd->wrap.release)
                cmd->wrap.release(cmd->wrap.arg);
        }
        if (cmd->type == KVL_CMD_REMOVE_PEER) { /* out of the callers' list: freed below */
            cmd->peer->retiring = 1;
            if (!cmd->peer->adopted) { /* in no engine list either */
                cmd->peer->next = a->peers;
                a->peers = cmd->peer;
            }
        }
        free(cmd->tag);
        free(cmd);
    }
    /* peers being retired are no longer in the callers' list: free them too */
    kvl_peer **tail = &a->peers;
    while (*tail)
        tail = &(*tail)->next;
    for (kvl_peer *p = a->eng_peers; p; p = p->eng_next)
        if (p->retiring) {
            *tail = p;
            p->next = NULL;
            tail = &p->next;
        }
    for (kvl_peer *p = a->peers, *next; p; p = next) {
        next = p->next;
        for (kvl_xfer *x = p->active, *xn; x; x = xn) {
            xn = x->next_active;
            x->n_held = 0; /* the regions are freed with the agent */
            fail_and_drop(x);
        }
        if (!p->adopted) {
            if (p->ctrl_ep)
                a->stream->discard(p->ctrl_ep);
            for (uint32_t i = 0; i < p->n_paths; i++)
                if (p->paths[i].ep)
                    a->stream->discard(p->paths[i].ep);
        }
        kvl_peer_free(p);
    }
    kvl_rx_free_all(a);
    for (kvl_inbound *ib = a->inbound, *next; ib; ib = next) {
        next = ib->next;
        free(ib);
    }
    kvl_notify_queue_free(a);
    kvl_share_free_all(a);
    agent_free(a);
    return KVL_OK;
}

void kvl_engine_accept(kvl_agent *a, int fd, const kvl_tp_wrap *w)
{
    kvl_cmd *cmd = atomic_load(&a->closing) ? NULL : calloc(1, sizeof *cmd);
    if (!cmd) {
        close(fd);
        if (w->release)
            w->release(w->arg);
        return;
    }
    cmd->type = KVL_CMD_ACCEPT;
    cmd->fd = fd;
    cmd->wrap = *w;
    kvl_engine_post(a, cmd);
}

kvl_err kvl_agent_relay_info(kvl_agent *a, kvl_relay_info *out)
{
    kvl_clear_error();
    if (!a || !out)
        return kvl_fail(KVL_ERR_INVALID_ARG, "relay_info: NULL argument");
    kvl_relay()->info(a, out);
    return KVL_OK;
}

kvl_err kvl_agent_n_addrs(kvl_agent *a, size_t *n)
{
    *n = a->n_addrs;
    return KVL_OK;
}

kvl_err kvl_agent_addr(kvl_agent *a, size_t i, char *host, uint16_t *port)
{
    kvl_clear_error();
    if (i >= a->n_addrs)
        return kvl_fail(KVL_ERR_INVALID_ARG, "address index %zu out of range", i);
    snprintf(host, 48, "%s", a->addrs[i]);
    *port = a->ports[i];
    return KVL_OK;
}

kvl_err kvl_agent_instance(kvl_agent *a, uint64_t *id)
{
    *id = a->instance;
    return KVL_OK;
}
