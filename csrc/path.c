/* path.c: the one place a path (or a peer's control connection) changes:
 * its state, so every change has a reason and reaches the log, and every
 * other field (path.h), from the events the rest of the engine reports.
 *
 *   UP <-> DEGRADED      by its rate against the best path's (monitor.c)
 *   UP/DEGRADED -> STALLED  busy and silent (monitor.c); back to UP as soon
 *                        as anything moves, or cut (-> DOWN) when it stays silent
 *   any -> DOWN          the connection failed or was cut; re-probed after a backoff
 *   DOWN -> PROBING      a reconnect is in progress (probe.c)
 *   PROBING -> UP        reconnected; PROBING -> DOWN: it failed (backoff doubles)
 *
 * Engine thread only (and add_peer before the engine adopts the peer).
 */
#include <stdio.h>
#include <string.h>

#include "internal.h"

#define PROBE_BACKOFF_MIN_MS 100 /* the first wait before a down path is re-probed */
#define JITTER_DECAY (1.0 / 256) /* per tick: a recovered stall is forgotten in ~20 s */
#define SLOWDOWN 0.7           /* kernel rate below 70% of the estimate: follow it down */
#define EWMA_NEW 0.3           /* weight of a new rate sample: adapts in ~3 chunks */
#define SHORT_BUSY_NS 50000000ull /* busy periods under 50 ms only raise the rate estimate */

static const char *const names[] = {"UP", "DEGRADED", "DOWN", "PROBING", "STALLED"};

void kvl_peer_update_hint(kvl_peer *p)
{
    int any = 0;
    for (uint32_t i = 0; i < p->n_paths && !any; i++)
        any = kvl_path_may_work(&p->paths[i]);
    atomic_store(&p->may_work, any);
}

/* Wakes kvl_paths_wait for a change the snapshots (snapshot.c) do not show
 * (a control connection's state). */
static void paths_changed(kvl_agent *a)
{
    pthread_mutex_lock(&a->stats_mu);
    a->paths_gen++;
    pthread_cond_broadcast(&a->paths_cv);
    pthread_mutex_unlock(&a->stats_mu);
}

const char *kvl_path_state_name(uint32_t state)
{
    return state < sizeof names / sizeof *names ? names[state] : "?";
}

void kvl_path_set_state(kvl_peer *p, kvl_path *pa, uint32_t state, const char *why)
{
    if (pa->state == state)
        return;
    uint32_t old = pa->state;
    pa->state = state;
    kvl_peer_update_hint(p);
    int ctrl = pa == &p->ctrl_path;
    if (state == KVL_PATH_DOWN || state == KVL_PATH_STALLED) {
        if (why)
            snprintf(pa->last_error, sizeof pa->last_error, "%s", why);
        if (old == KVL_PATH_UP || old == KVL_PATH_DEGRADED) {
            pa->t_down_ns = kvl_now_ns(); /* when it left service (stalled or down) */
            snprintf(pa->down_cause, sizeof pa->down_cause, "%s", why ? why : "");
        }
    }
    /* DEGRADED <-> UP follows the rate every tick and PROBING is routine:
     * those are debug; losing and regaining a path is what operators want */
    int level = state == KVL_PATH_DOWN || state == KVL_PATH_STALLED ? KVL_LOG_WARNING
                : old == KVL_PATH_PROBING || old == KVL_PATH_STALLED ? KVL_LOG_INFO
                                                                      : KVL_LOG_DEBUG;
    if (old == KVL_PATH_PROBING && state == KVL_PATH_DOWN)
        level = KVL_LOG_DEBUG; /* a failed reconnect: the path was down already */
    if (ctrl) /* a data path's change wakes waiters with the snapshot that shows it */
        paths_changed(p->agent);
    kvl_log(p->agent, level, p->name, ctrl ? -1 : (int)pa->index, "%s %s -> %s: %s -> %s%s%s",
            ctrl ? "control connection" : "path", pa->local, pa->rhost[0] ? pa->rhost : "?",
            kvl_path_state_name(old), kvl_path_state_name(state), why ? ": " : "", why ? why : "");
}

int kvl_path_may_work(const kvl_path *pa)
{
    if (pa->state != KVL_PATH_DOWN && pa->state != KVL_PATH_PROBING)
        return 1;
    return pa->rhost[0] && pa->probe_fails == 0;
}

/* ---- set-up ---- */

void kvl_path_route(kvl_path *pa, const char *local, const char *host, uint16_t port)
{
    snprintf(pa->local, sizeof pa->local, "%s", local);
    snprintf(pa->rhost, sizeof pa->rhost, "%s", host);
    pa->rport = port;
}

void kvl_path_init(kvl_path *pa, uint32_t index, uint32_t laddr, const char *local,
                   const char *host, uint16_t port, const kvl_route *rt, kvl_ep *ep)
{
    pa->index = index;
    pa->laddr = laddr;
    pa->ep = ep;
    if (rt && rt->via[0]) {
        snprintf(pa->via, sizeof pa->via, "%s", rt->via);
        pa->via_port = rt->via_port;
        snprintf(pa->via_name, sizeof pa->via_name, "%s", rt->via_name);
    }
    snprintf(pa->remote, sizeof pa->remote, "%s:%u", host, port);
    kvl_path_route(pa, local, host, port);
}

void kvl_path_never_connected(kvl_peer *p, kvl_path *pa, const char *why)
{
    pa->probe_fails = 1; /* it failed to connect: known dead until a probe works */
    kvl_path_set_state(p, pa, KVL_PATH_DOWN, why);
}

/* ---- its connection ---- */

void kvl_path_adopted(kvl_peer *p, kvl_path *pa, kvl_conn *c)
{
    if (!c)
        kvl_path_set_state(p, pa, KVL_PATH_DOWN, "engine: cannot take the connection over");
    else
        pa->conn = c;
    pa->ep = NULL;
}

void kvl_path_reconnected(kvl_peer *p, kvl_path *pa, kvl_conn *c, uint64_t now)
{
    if (pa != &p->ctrl_path) /* the control connection's is p->ctrl */
        pa->conn = c;
    kvl_path_set_state(p, pa, KVL_PATH_UP, "reconnected");
    pa->backoff_ms = 0;
    pa->probe_fails = 0;
    kvl_peer_update_hint(p);
    pa->reconnects++;
    pa->t_progress_ns = now;
    pa->ping_sent_ns = 0;
    pa->seen_acked = pa->seen_received = 0;
}

void kvl_path_reconnect_failed(kvl_peer *p, kvl_path *pa)
{
    pa->probe_fails++;
    kvl_peer_update_hint(p);
}

void kvl_path_backoff(kvl_path *pa, uint64_t now, uint32_t max_ms)
{
    uint32_t b = pa->backoff_ms ? pa->backoff_ms * 2 : PROBE_BACKOFF_MIN_MS;
    if (b > max_ms)
        b = max_ms;
    pa->backoff_ms = b;
    pa->next_probe_ns = now + (uint64_t)b * 1000000ull;
}

void kvl_path_failed(kvl_peer *p, kvl_path *pa, uint64_t now, const char *why)
{
    kvl_path_backoff(pa, now, p->agent->cfg.probe_backoff_max_ms);
    kvl_path_set_state(p, pa, KVL_PATH_DOWN, why);
}

void kvl_path_lost(kvl_path *pa, uint64_t sent, uint64_t recv, uint64_t put, uint32_t mover_caps,
                   const char *why)
{
    pa->bytes_sent_prev += sent;
    pa->bytes_recv_prev += recv;
    pa->bytes_put_prev += put;
    if (mover_caps & KVL_MV_FALLS_BACK) { /* "a UCX path that dies falls back to TCP" */
        snprintf(pa->mover_died, sizeof pa->mover_died, "%s", why);
        pa->mover_died_kind = pa->mover_kind;
        __atomic_store_n(&pa->mover_off_until_ns,
                         kvl_now_ns() + KVL_MOVER_FALLBACK_MS * 1000000ull, __ATOMIC_RELAXED);
    }
    pa->conn = NULL;
}

void kvl_path_carried_by(kvl_path *pa, uint32_t mover_kind, uint32_t mover_caps, const char *note)
{
    pa->mover_kind = mover_kind;
    pa->mover_caps = mover_caps;
    kvl_path_noted(pa, note);
}

void kvl_path_noted(kvl_path *pa, const char *note)
{
    snprintf(pa->tnote, sizeof pa->tnote, "%s", note);
}

/* ---- the monitor ---- */

void kvl_path_ping_sent(kvl_path *pa, uint64_t now)
{
    pa->ping_sent_ns = now;
    pa->t_last_ping_ns = now;
}

void kvl_path_keepalive_sent(kvl_path *pa, uint64_t now)
{
    pa->t_last_ping_ns = now;
}

void kvl_path_pong(kvl_path *pa, uint64_t sent_ns, uint64_t now)
{
    if (sent_ns == pa->ping_sent_ns && now > sent_ns) {
        double rtt = (double)(now - sent_ns) / 1e3;
        pa->rtt_us = pa->rtt_us > 0 ? 0.7 * pa->rtt_us + 0.3 * rtt : rtt;
        pa->ping_sent_ns = 0;
    }
    pa->t_progress_ns = now;
}

void kvl_path_tick(kvl_path *pa)
{
    pa->jitter_ms -= pa->jitter_ms * JITTER_DECAY;
}

void kvl_path_sampled(kvl_path *pa, const kvl_tp_sample *s, uint64_t now, uint64_t ramp_ns)
{
    if (s->rtt_us > 0 && pa->inflight_chunks)
        pa->rtt_us = s->rtt_us;
    if (s->delivery_Bps > 0 && !s->app_limited) {
        pa->delivery_Bps = s->delivery_Bps;
        /* chunk completions update the rate only per chunk; a link that
         * slows down shows in the kernel's samples within a tick, so a busy
         * path's estimate follows them down at once (once past its ramp-up) */
        if (pa->inflight_chunks && pa->bw_Bps > 0 && s->delivery_Bps < SLOWDOWN * pa->bw_Bps &&
            now - pa->busy_start_ns > ramp_ns)
            pa->bw_Bps = 0.5 * (pa->bw_Bps + s->delivery_Bps);
    }
    if (s->bytes_acked != pa->seen_acked || s->bytes_received != pa->seen_received ||
        !pa->inflight_chunks)
        pa->t_progress_ns = now;
    pa->seen_acked = s->bytes_acked;
    pa->seen_received = s->bytes_received;
    pa->stall_ms = (uint32_t)((now - pa->t_progress_ns) / 1000000ull);
}

void kvl_path_nic_sampled(kvl_path *pa, double other_Bps)
{
    pa->nic_other_Bps = other_Bps;
}

void kvl_path_stall_detected(kvl_path *pa, uint64_t acked, uint64_t received, uint32_t limit_ms)
{
    pa->stall_acked = acked;
    pa->stall_received = received;
    pa->stall_limit_ms = limit_ms;
}

void kvl_path_stalled(kvl_peer *p, kvl_path *pa, const char *why)
{
    kvl_path_set_state(p, pa, KVL_PATH_STALLED, why);
    pa->t_stall_ns = kvl_now_ns();
}

void kvl_path_recovered(kvl_peer *p, kvl_path *pa, uint64_t ms, uint64_t now)
{
    double silence = (double)ms + pa->stall_limit_ms;
    if (silence > pa->jitter_ms)
        pa->jitter_ms = silence;
    char why[96];
    snprintf(why, sizeof why, "moving again after %llu ms", (unsigned long long)ms);
    kvl_path_set_state(p, pa, KVL_PATH_UP, why);
    pa->t_progress_ns = now;
}

/* ---- the scheduler ---- */

void kvl_path_dispatched(kvl_path *pa, uint64_t bytes, int hedge, uint64_t now)
{
    if (pa->inflight_chunks == 0) {
        pa->busy_start_ns = now;
        pa->busy_bytes = 0;
    }
    if (hedge)
        pa->hedges++;
    pa->inflight_bytes += bytes;
    pa->inflight_chunks++;
}

void kvl_path_copy_dropped(kvl_path *pa, uint64_t bytes)
{
    pa->inflight_bytes = pa->inflight_bytes >= bytes ? pa->inflight_bytes - bytes : 0;
    if (pa->inflight_chunks)
        pa->inflight_chunks--;
}

void kvl_path_evacuated(kvl_path *pa)
{
    pa->inflight_bytes = 0;
    pa->inflight_chunks = 0;
}

void kvl_path_chunk_done(kvl_path *pa, uint64_t bytes, uint64_t now)
{
    /* Rate over the current busy period rather than per chunk: acks that
     * arrive back to back would make per-chunk samples absurdly high. */
    pa->busy_bytes += bytes;
    if (now > pa->busy_start_ns) {
        double sample = (double)pa->busy_bytes * 1e9 / (double)(now - pa->busy_start_ns);
        /* A short busy period is mostly connection ramp-up (slow start after
         * idle): it may raise the estimate but not lower it, or a path that
         * got little work would keep getting little work. */
        int short_period = now - pa->busy_start_ns < SHORT_BUSY_NS;
        if (pa->bw_Bps <= 0) {
            if (!short_period)
                pa->bw_Bps = sample; /* until then the path plans with the prior */
        } else if (!short_period || sample > pa->bw_Bps)
            pa->bw_Bps = (1 - EWMA_NEW) * pa->bw_Bps + EWMA_NEW * sample;
    }
    pa->t_progress_ns = now;
    pa->t_chunk_ns = now;
    pa->chunks_done++;
}
