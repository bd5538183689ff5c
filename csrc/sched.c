/* sched.c: which chunk goes on which path, and what happens when one fails.
 *
 * Each path keeps an EWMA of its measured chunk service rate.  The next
 * chunk in plan order goes to the path with the earliest predicted finish,
 *     (bytes already in flight there + chunk bytes) / rate + rtt,
 * provided that path's window has room; otherwise the chunk waits for it
 * rather than going to a path predicted to finish later.  Runs on the engine
 * thread only.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static int path_usable(const kvl_path *pa)
{
    return pa->conn && !kvl_conn_is_dead(pa->conn) &&
           (pa->state == KVL_PATH_UP || pa->state == KVL_PATH_DEGRADED);
}

kvl_xfer *kvl_sched_find_xfer(kvl_peer *p, uint64_t id)
{
    for (kvl_xfer *x = p->active; x; x = x->next_active)
        if (x->id == id)
            return x;
    return NULL;
}

/* Next chunk to send for this peer: retries first, then plan order, FIFO
 * over transfers (the oldest request finishes first). */
static kvl_xfer *next_chunk(kvl_peer *p, uint32_t *ci)
{
    for (kvl_xfer *x = p->active; x; x = x->next_active) {
        if (!kvl_xfer_running(x))
            continue;
        if (x->n_retry) {
            *ci = x->retry[0];
            return x;
        }
        if (x->next_chunk < x->plan.n_chunks) {
            *ci = x->next_chunk;
            return x;
        }
    }
    return NULL;
}

static void take_chunk(kvl_xfer *x, uint32_t ci)
{
    x->bytes_pending -= x->plan.chunks[ci].bytes;
    if (x->n_retry && x->retry[0] == ci) {
        memmove(x->retry, x->retry + 1, (x->n_retry - 1) * sizeof *x->retry);
        x->n_retry--;
    } else {
        x->next_chunk++;
    }
}

/* Queues a copy of chunk ci on pa's connection; a push announces itself on
 * each connection before its first DATA there. */
static int send_copy(kvl_path *pa, kvl_xfer *x, uint32_t ci)
{
    uint64_t serial = kvl_conn_serial(pa->conn);
    if (x->op == KVL_OP_PUSH && x->ann_serial[pa->index] != serial) {
        kvl_buf b = {0};
        kvl_xfer_announce(x, &b, kvl_now_ns());
        if (kvl_conn_send_frame(pa->conn, &b) != 0)
            return -1;
        x->ann_serial[pa->index] = serial;
    }
    return kvl_conn_send_chunk(pa->conn, x, ci);
}

/* Bookkeeping for one copy of chunk ci going out on path pa. */
static void account_send(kvl_xfer *x, uint32_t ci, kvl_path *pa, int hedge)
{
    kvl_path_dispatched(pa, x->plan.chunks[ci].bytes, hedge, kvl_now_ns());
    x->attempt[ci]++;
    if (hedge) {
        x->hpath[ci] = (uint8_t)pa->index;
        x->hattempt[ci] = x->attempt[ci];
    } else {
        x->cpath[ci] = (uint8_t)pa->index;
        x->pattempt[ci] = x->attempt[ci];
        x->hpath[ci] = KVL_NO_PATH;
    }
    x->cstate[ci] = KVL_CHUNK_INFLIGHT;
    if (x->attempt[ci] > 1)
        atomic_fetch_add_explicit(&x->retries, 1, memory_order_relaxed);
}

/* The policy's view of p's paths at this instant (policy.c). */
static void snapshot(const kvl_peer *p, kvl_path_view *v, uint64_t now)
{
    for (uint32_t i = 0; i < p->n_paths; i++) {
        const kvl_path *pa = &p->paths[i];
        uint64_t last = pa->t_chunk_ns > pa->busy_start_ns ? pa->t_chunk_ns : pa->busy_start_ns;
        v[i] = (kvl_path_view){
            .usable = path_usable(pa),
            .bw_Bps = pa->bw_Bps,
            .rtt_us = pa->rtt_us,
            .nic_other_Bps = pa->nic_other_Bps,
            .inflight_bytes = pa->inflight_bytes,
            .inflight_chunks = pa->inflight_chunks,
            .idle_ns = now > last ? now - last : 0,
        };
    }
}

static int window_open(const kvl_agent *a, const kvl_path *pa)
{
    return pa->inflight_chunks < a->cfg.window_chunks || pa->inflight_bytes < a->cfg.window_bytes;
}

static kvl_path *pick_round_robin(kvl_peer *p)
{
    for (uint32_t k = 0; k < p->n_paths; k++) {
        kvl_path *pa = &p->paths[(p->rr_next + k) % p->n_paths];
        if (path_usable(pa)) {
            p->rr_next = (pa->index + 1) % p->n_paths;
            return pa;
        }
    }
    return NULL;
}

/* Straggler hedging: when nothing is left to send, an idle path takes a copy
 * of the in-flight chunk predicted to finish last, if it would finish that
 * chunk in well under the time its own path still needs. */
static void hedge(kvl_peer *p)
{
    kvl_agent *a = p->agent;
    kvl_path_view v[KVL_MAX_PATHS];
    snapshot(p, v, kvl_now_ns());
    double prior = kvl_policy_prior(v, p->n_paths);
    for (uint32_t i = 0; i < p->n_paths; i++) {
        kvl_path *idle = &p->paths[i];
        /* never two copies of one chunk where one goes by a KVL_MV_NO_HEDGE
         * mover: a late put cannot be drained at the receiver, and the fence
         * that would make it safe (docs/ucx.md, "Cancel and duplicate
         * copies") is not built; a same-host copy reads the source after the
         * other copy may have completed the transfer and let the caller
         * reuse it */
        if (!v[i].usable || v[i].inflight_chunks || (idle->mover_caps & KVL_MV_NO_HEDGE))
            continue;
        kvl_xfer *bx = NULL;
        uint32_t bci = 0;
        double worst = 0;
        for (kvl_xfer *x = p->active; x; x = x->next_active) {
            if (!kvl_xfer_running(x))
                continue;
            for (uint32_t ci = 0; ci < x->plan.n_chunks; ci++) {
                if (x->cstate[ci] != KVL_CHUNK_INFLIGHT || x->hpath[ci] != KVL_NO_PATH ||
                    x->cpath[ci] == idle->index ||
                    (p->paths[x->cpath[ci]].mover_caps & KVL_MV_NO_HEDGE))
                    continue;
                double late = kvl_policy_hedge_late_s(&v[x->cpath[ci]], &v[i],
                                                      x->plan.chunks[ci].bytes, prior);
                if (late > worst) {
                    worst = late;
                    bx = x;
                    bci = ci;
                }
            }
        }
        if (!bx)
            continue;
        kvl_log(a, KVL_LOG_DEBUG, p->name, (int)idle->index,
                "hedge: chunk %u of transfer %llu, predicted %.0f ms late on path %u, copied here",
                bci, (unsigned long long)bx->id, worst * 1e3, bx->cpath[bci]);
        account_send(bx, bci, idle, 1);
        snapshot(p, v, kvl_now_ns()); /* this path is busy now */
        if (send_copy(idle, bx, bci) != 0)
            kvl_sched_fail(bx, KVL_ERR_NOMEM, "out of memory queueing chunk %u", bci);
    }
}

void kvl_sched_dispatch(kvl_peer *p)
{
    kvl_agent *a = p->agent;
    kvl_path_view v[KVL_MAX_PATHS];
    snapshot(p, v, kvl_now_ns());
    /* bytes not yet in flight, over the peer's running transfers: summed once
     * here, then kept up to date as chunks go out */
    uint64_t pending = 0;
    for (kvl_xfer *y = p->active; y; y = y->next_active)
        if (kvl_xfer_running(y))
            pending += y->bytes_pending;
    for (;;) {
        uint32_t ci = 0;
        kvl_xfer *x = next_chunk(p, &ci);
        if (!x) {
            if (a->cfg.hedge && !a->cfg.round_robin)
                hedge(p);
            return;
        }
        uint64_t bytes = x->plan.chunks[ci].bytes;
        kvl_path *best = NULL;
        if (a->cfg.round_robin) {
            uint32_t keep = p->rr_next;
            best = pick_round_robin(p);
            if (best && !window_open(a, best)) {
                p->rr_next = keep; /* wait for that path: static assignment */
                return;
            }
        } else {
            int i = kvl_policy_pick(v, p->n_paths, bytes, pending, a->cfg.window_chunks,
                                    a->cfg.window_bytes);
            best = i < 0 ? NULL : &p->paths[i];
        }
        if (!best)
            return; /* wait: for room on the best path, or for a path to come back */
        take_chunk(x, ci);
        pending -= pending >= bytes ? bytes : pending;
        account_send(x, ci, best, 0);
        v[best->index].inflight_bytes = best->inflight_bytes;
        v[best->index].inflight_chunks = best->inflight_chunks;
        v[best->index].idle_ns = 0;
        if (send_copy(best, x, ci) != 0) {
            kvl_sched_fail(x, KVL_ERR_NOMEM, "out of memory queueing chunk %u", ci);
            return;
        }
    }
}

/* Drops one copy's in-flight accounting on its path. */
static void drop_copy(kvl_peer *p, kvl_xfer *x, uint32_t ci, int hedge_copy)
{
    uint8_t *slot = hedge_copy ? &x->hpath[ci] : &x->cpath[ci];
    if (*slot == KVL_NO_PATH)
        return;
    kvl_path_copy_dropped(&p->paths[*slot], x->plan.chunks[ci].bytes);
    *slot = KVL_NO_PATH;
}

/* Drops every copy of chunk ci: it is pending again (or done). */
static void unaccount(kvl_peer *p, kvl_xfer *x, uint32_t ci)
{
    if (x->cstate[ci] != KVL_CHUNK_INFLIGHT)
        return;
    drop_copy(p, x, ci, 0);
    drop_copy(p, x, ci, 1);
    x->cstate[ci] = KVL_CHUNK_PENDING;
}

void kvl_sched_on_chunk_done(kvl_peer *p, kvl_xfer *x, uint32_t ci, uint32_t path, uint64_t now)
{
    kvl_path *pa = &p->paths[path];
    /* the other copy of a hedged chunk lost: it is cancelled on its
     * connection, which stays up with its other chunks flowing (a push's
     * copy part-way out finishes from zeros; a pull's late answer is
     * drained by the receive side) */
    int hedge_won = x->hpath[ci] == path;
    int loser = hedge_won ? x->cpath[ci] : x->hpath[ci];
    uint32_t loser_attempt = hedge_won ? x->pattempt[ci] : x->hattempt[ci];
    unaccount(p, x, ci);
    x->cstate[ci] = KVL_CHUNK_DONE;
    if (loser != KVL_NO_PATH && p->paths[loser].conn &&
        kvl_conn_cancel_chunk(p->paths[loser].conn, x->id, ci, loser_attempt))
        kvl_log(p->agent, KVL_LOG_DEBUG, p->name, loser,
                "cancel: the other copy of chunk %u of transfer %llu won on path %u", ci,
                (unsigned long long)x->id, path);
    kvl_path_chunk_done(pa, x->plan.chunks[ci].bytes, now);
    kvl_xfer_chunk_done(x, ci, pa->index, now);
    if (!kvl_xfer_running(x)) {
        if (x->notify)
            kvl_notify_queue(p, x->id, (uint32_t)x->op, x->notify, x->notify_len);
        kvl_engine_snapshot_paths(p->agent);
    }
}

void kvl_sched_fail(kvl_xfer *x, kvl_err err, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    /* its copies still queued stop reading its memory now, so the memory
     * is free as soon as the outcome is published */
    for (uint32_t ci = 0; ci < x->plan.n_chunks; ci++) {
        if (x->cstate[ci] == KVL_CHUNK_INFLIGHT)
            for (int h = 0; h < 2; h++) {
                uint8_t path = h ? x->hpath[ci] : x->cpath[ci];
                kvl_conn *c = path == KVL_NO_PATH ? NULL : x->peer->paths[path].conn;
                if (c)
                    kvl_conn_cancel_chunk(c, x->id, ci, h ? x->hattempt[ci] : x->pattempt[ci]);
            }
        unaccount(x->peer, x, ci);
    }
    if (kvl_xfer_running(x))
        kvl_log(x->agent, err == KVL_ERR_CLOSED ? KVL_LOG_INFO : KVL_LOG_WARNING, x->peer->name,
                -1, "transfer %llu failed: %s", (unsigned long long)x->id, msg);
    kvl_xfer_set_failed(x, err, "%s", msg);
}

void kvl_sched_superseded(kvl_peer *p, kvl_xfer *x, uint32_t ci, uint32_t path,
                          uint32_t attempt)
{
    if (x->cstate[ci] != KVL_CHUNK_INFLIGHT)
        return;
    if (x->hpath[ci] == path && x->hattempt[ci] == attempt) {
        drop_copy(p, x, ci, 1); /* the primary carries on */
    } else if (x->cpath[ci] == path && x->pattempt[ci] == attempt) {
        if (x->hpath[ci] != KVL_NO_PATH) { /* the newer copy is the hedge: it carries on */
            drop_copy(p, x, ci, 0);
            x->cpath[ci] = x->hpath[ci];
            x->pattempt[ci] = x->hattempt[ci];
            x->hpath[ci] = KVL_NO_PATH;
        } else { /* the newer copy that took the chunk over is gone: send it again */
            unaccount(p, x, ci);
            x->retry[x->n_retry++] = ci;
            x->bytes_pending += x->plan.chunks[ci].bytes;
        }
    }
}

void kvl_sched_requeue(kvl_peer *p, kvl_xfer *x, uint32_t ci, kvl_err err, const char *why)
{
    unaccount(p, x, ci);
    if (++x->fails[ci] >= p->agent->cfg.max_attempts) {
        kvl_sched_fail(x, err, "chunk %u to peer '%s' failed %u times; last: %s", ci, p->name,
                       x->fails[ci], why);
        return;
    }
    kvl_log(p->agent, KVL_LOG_INFO, p->name, -1, "retry: chunk %u of transfer %llu (failure %u of %u): %s",
            ci, (unsigned long long)x->id, x->fails[ci], p->agent->cfg.max_attempts, why);
    x->retry[x->n_retry++] = ci;
    x->bytes_pending += x->plan.chunks[ci].bytes;
}

/* Takes every copy in flight on `path` off it.  A copy with a twin on
 * another path leaves the twin to carry on; a sole copy is re-queued,
 * counted as a failed attempt only when the path failed (a stall is not the
 * chunk's fault).  cancel: the connection lives on, so its copies are
 * cancelled in the stream. */
static void evacuate(kvl_peer *p, uint32_t path, int cancel, const char *why)
{
    kvl_path *pa = &p->paths[path];
    for (kvl_xfer *x = p->active; x; x = x->next_active) {
        /* requeue may fail x; reaping waits for the iteration's end */
        for (uint32_t ci = 0; ci < x->plan.n_chunks && kvl_xfer_running(x); ci++) {
            if (x->cstate[ci] != KVL_CHUNK_INFLIGHT)
                continue;
            int hedge_here = x->hpath[ci] == path, primary_here = x->cpath[ci] == path;
            if (!hedge_here && !primary_here)
                continue;
            if (cancel && pa->conn)
                kvl_conn_cancel_chunk(pa->conn, x->id, ci,
                                      hedge_here ? x->hattempt[ci] : x->pattempt[ci]);
            if (hedge_here) {
                drop_copy(p, x, ci, 1); /* the primary copy carries on */
            } else if (x->hpath[ci] != KVL_NO_PATH) {
                drop_copy(p, x, ci, 0); /* the hedge copy becomes the primary */
                x->cpath[ci] = x->hpath[ci];
                x->pattempt[ci] = x->hattempt[ci];
                x->hpath[ci] = KVL_NO_PATH;
            } else if (cancel) {
                unaccount(p, x, ci);
                x->retry[x->n_retry++] = ci;
                x->bytes_pending += x->plan.chunks[ci].bytes;
            } else {
                kvl_sched_requeue(p, x, ci, KVL_ERR_CONN_LOST, why);
            }
        }
    }
    kvl_path_evacuated(pa);
}

void kvl_sched_path_down(kvl_peer *p, uint32_t path, const char *why)
{
    kvl_path *pa = &p->paths[path]; /* its connection is gone already (kvl_path_lost) */
    kvl_path_failed(p, pa, kvl_now_ns(), why); /* DOWN, re-probed after a backoff */
    evacuate(p, path, 0, why);
    kvl_sched_check_reachable(p);
    kvl_engine_snapshot_paths(p->agent);
}

void kvl_sched_path_stalled(kvl_peer *p, uint32_t path, const char *why)
{
    kvl_path *pa = &p->paths[path];
    kvl_path_stalled(p, pa, why);
    evacuate(p, path, 1, why);
    kvl_engine_snapshot_paths(p->agent);
}

/* Every path of p out of service with no connection (DOWN or PROBING):
 * nothing moves until a reconnect works.  A stalled path keeps its
 * connection and may move again. */
static int every_path_down(const kvl_peer *p)
{
    for (uint32_t i = 0; i < p->n_paths; i++)
        if (p->paths[i].state != KVL_PATH_DOWN && p->paths[i].state != KVL_PATH_PROBING)
            return 0;
    return 1;
}

/* "all N path(s) are down; path i local->remote: its last error; ..."; with
 * states (some path is stalled): "no path is in service; path i local->remote:
 * STATE: its last error; ..." */
static void paths_msg(const kvl_peer *p, int states, char *msg, size_t cap)
{
    size_t off = states ? (size_t)snprintf(msg, cap, "no path is in service")
                        : (size_t)snprintf(msg, cap, "all %u path(s) are down", p->n_paths);
    /* every path gets its share of the message, so none is cut off the end */
    size_t share = off < cap ? (cap - off) / p->n_paths : 0;
    for (uint32_t i = 0; i < p->n_paths && share > 1 && off < cap; i++) {
        const char *why = p->paths[i].last_error;
        size_t plen = strlen(p->name);
        if (!strncmp(why, "peer '", 6) && !strncmp(why + 6, p->name, plen) &&
            !strncmp(why + 6 + plen, "': ", 3))
            why += 9 + plen; /* the peer is named once, before */
        int n = snprintf(msg + off, share, "; path %u %s->%s: %s%s%s", i, p->paths[i].local,
                         p->paths[i].remote, states ? kvl_path_state_name(p->paths[i].state) : "",
                         states ? ": " : "", why);
        off += n < 0 ? 0 : (size_t)n < share ? (size_t)n : share - 1;
    }
}

static uint32_t n_running(kvl_peer *p)
{
    uint32_t n = 0;
    for (kvl_xfer *x = p->active; x; x = x->next_active)
        n += kvl_xfer_running(x) ? 1 : 0;
    return n;
}

#define WAIT_LOG_NS 1000000000ull /* one "wait for a path" record a second per peer */

void kvl_sched_check_reachable(kvl_peer *p)
{
    if (p->retiring)
        return; /* its transfers failed with the reason already */
    if (atomic_load(&p->gone)) {
        for (kvl_xfer *x = p->active, *next; x; x = next) {
            next = x->next_active;
            if (kvl_xfer_running(x))
                kvl_sched_fail(x, KVL_ERR_CONN_LOST, "peer '%s' %s", p->name, p->gone_why);
        }
        p->wait_since_ns = 0;
        p->n_waiting = 0;
        return;
    }
    int down = every_path_down(p);
    if (!down && !p->wait_since_ns)
        return; /* the usual case: nothing waits, nothing to count */
    uint32_t running = n_running(p), n = down ? running : 0;
    uint64_t now = kvl_now_ns();
    kvl_agent *a = p->agent;
    if (n && !p->wait_since_ns) {
        p->wait_since_ns = now;
        p->wait_logged = !p->wait_log_ns || now - p->wait_log_ns >= WAIT_LOG_NS;
        if (p->wait_logged) {
            char more[64] = "";
            if (p->wait_unlogged)
                snprintf(more, sizeof more, " (%u more such waits since the last record)",
                         p->wait_unlogged);
            kvl_log(a, KVL_LOG_WARNING, p->name, -1,
                    "every path is down: %u transfer(s) wait for a path to come back, each "
                    "until its deadline; the paths are re-probed (at least every %u ms)%s",
                    n, a->cfg.probe_backoff_max_ms, more);
            p->wait_log_ns = now;
            p->wait_unlogged = 0;
        } else {
            p->wait_unlogged++;
        }
    } else if (!n && p->wait_since_ns) {
        if (p->wait_logged && !down)
            kvl_log(a, KVL_LOG_INFO, p->name, -1,
                    "a path is back after %.1f s with every path down: %u waiting "
                    "transfer(s) go on",
                    (double)(now - p->wait_since_ns) / 1e9, running);
        p->wait_since_ns = 0;
    }
    p->n_waiting = n;
}

void kvl_sched_peer_gone(kvl_peer *p, const kvl_path *pa, uint64_t met)
{
    if (atomic_load(&p->gone))
        return;
    snprintf(p->gone_why, sizeof p->gone_why,
             "restarted: the agent at %s:%u is instance %016llx now, not %016llx, and what it "
             "held is gone; add it again with its new metadata",
             pa->rhost, pa->rport, (unsigned long long)met, (unsigned long long)p->instance);
    atomic_store(&p->gone, 1); /* after gone_why: submit reads it once gone is set */
    kvl_log(p->agent, KVL_LOG_WARNING, p->name, -1, "peer %s", p->gone_why);
    kvl_sched_check_reachable(p);
}

void kvl_sched_expire(kvl_agent *a, uint64_t now)
{
    for (kvl_peer *p = a->eng_peers; p; p = p->eng_next) {
        int down = every_path_down(p), in_service = 0;
        for (uint32_t i = 0; i < p->n_paths; i++)
            in_service |= path_usable(&p->paths[i]);
        for (kvl_xfer *x = p->active, *next; x; x = next) {
            next = x->next_active;
            if (!kvl_xfer_running(x) || !x->deadline_ns || now <= x->deadline_ns)
                continue;
            if (!down) { /* slow, or stalled (the peer may be paused): the deadline's */
                char msg[512];
                int off = snprintf(msg, sizeof msg,
                                   "transfer %llu to peer '%s' missed its deadline "
                                   "(%u of %u chunks verified)",
                                   (unsigned long long)x->id, p->name, x->prog.chunks_done,
                                   x->prog.chunks_total);
                if (!in_service && off > 0 && (size_t)off + 2 < sizeof msg) {
                    memcpy(msg + off, ": ", 3);
                    paths_msg(p, 1, msg + off + 2, sizeof msg - (size_t)off - 2);
                }
                kvl_sched_fail(x, KVL_ERR_DEADLINE, "%s", msg);
                continue;
            }
            /* it waited for a path to the end: the peer stayed unreachable */
            uint64_t since = p->wait_since_ns > x->t_submit_ns ? p->wait_since_ns : x->t_submit_ns;
            char msg[512];
            int off = snprintf(msg, sizeof msg,
                               "transfer %llu to peer '%s' missed its deadline waiting %.1f s "
                               "for a path (%u of %u chunks verified): ",
                               (unsigned long long)x->id, p->name,
                               since && now > since ? (double)(now - since) / 1e9 : 0.0,
                               x->prog.chunks_done, x->prog.chunks_total);
            if (off > 0 && (size_t)off < sizeof msg)
                paths_msg(p, 0, msg + off, sizeof msg - (size_t)off);
            kvl_sched_fail(x, KVL_ERR_CONN_LOST, "%s", msg);
        }
        kvl_sched_check_reachable(p); /* what finished no longer waits */
    }
}

/* Tells the receiver of a push that no copy of its chunks counts any more. */
/* END goes out on every live connection to the peer, stalled ones
 * included: a copy of this push still queued on a connection that stalled
 * then meets a tombstone already set by the END that went another way, and
 * cannot land after the receiver learned the push is over.  With no live
 * connection at all, the receiver ends it at the announced deadline. */
static void send_end(kvl_peer *p, kvl_xfer *x)
{
    kvl_msg_status st = {.xfer = x->id};
    if (x->prog.fin != KVL_XFER_DONE) { /* the engine's own fields: no lock */
        st.status = x->prog.err ? x->prog.err : KVL_ERR_PROTOCOL;
        snprintf(st.msg, sizeof st.msg, "%s", x->prog.message ? x->prog.message : "");
    }
    for (uint32_t i = 0; i <= p->n_paths; i++) {
        kvl_conn *c = i < p->n_paths ? p->paths[i].conn : p->ctrl;
        if (!c || kvl_conn_is_dead(c))
            continue;
        kvl_buf b = {0};
        kvl_frame_start(&b);
        kvl_enc_status(&b, &st);
        kvl_frame_finish(&b, KVL_F_END, 0);
        kvl_conn_send_frame(c, &b);
    }
}

static void retire(kvl_peer *p, kvl_xfer *x, kvl_xfer *prev)
{
    if (x->op == KVL_OP_PUSH)
        send_end(p, x);
    if (prev)
        prev->next_active = x->next_active;
    else
        p->active = x->next_active;
    if (p->active_tail == x)
        p->active_tail = prev;
    for (size_t i = 0; i < x->n_held; i++)
        kvl_regions_release(&p->agent->regions, x->held[i]);
    x->n_held = 0;
    kvl_xfer_publish(x);
    kvl_xfer_release(x); /* the engine's reference */
}

void kvl_sched_reap(kvl_agent *a)
{
    for (kvl_peer *p = a->eng_peers; p; p = p->eng_next) {
        kvl_xfer *prev = NULL;
        for (kvl_xfer *x = p->active, *next; x; x = next) {
            next = x->next_active;
            if (!kvl_xfer_running(x) && x->io_refs == 0)
                retire(p, x, prev);
            else
                prev = x;
        }
    }
}
