/* test_path.c: the path object (csrc/path.c, path.h) through its functions
 * only: the state machine and what it logs, the probe backoff, a reconnect
 * resetting the counters, in-flight accounting that stays consistent and
 * never underflows, the busy-period rate estimate, the RTT and stall
 * bookkeeping, and the mover fallback timer, armed only for a mover that
 * falls back.
 *
 * Links path.o with log.o, clock.o and errors.o alone: the agent here is a
 * zeroed kvl_agent with its log ring and snapshot lock set up, the peer a
 * zeroed kvl_peer.  Connections are never dereferenced by path.c, so fake
 * pointers stand in for them. */
#include <pthread.h>
#include <string.h>

#include "internal.h"
#include "test_main.h"

#define MS 1000000ull

static kvl_agent *agent_new(void)
{
    kvl_agent *a = calloc(1, sizeof *a);
    pthread_mutex_init(&a->log_mu, NULL);
    kvl_cond_init(&a->log_cv);
    pthread_mutex_init(&a->stats_mu, NULL);
    kvl_cond_init(&a->paths_cv);
    return a;
}

static void agent_free(kvl_agent *a)
{
    pthread_mutex_destroy(&a->log_mu);
    pthread_cond_destroy(&a->log_cv);
    pthread_mutex_destroy(&a->stats_mu);
    pthread_cond_destroy(&a->paths_cv);
    free(a);
}

/* A peer as add_peer leaves it: n data paths 10.0.0.1+i -> 10.0.1.1+i:7000+i,
 * the control connection over path 0's pair. */
static kvl_peer *peer_new(kvl_agent *a, uint32_t n)
{
    kvl_peer *p = calloc(1, sizeof *p);
    p->agent = a;
    snprintf(p->name, sizeof p->name, "b");
    p->n_paths = n;
    kvl_path_route(&p->ctrl_path, "10.0.0.1", "10.0.1.1", 7000);
    for (uint32_t i = 0; i < n; i++) {
        char local[32], host[32];
        snprintf(local, sizeof local, "10.0.0.%u", 1 + i);
        snprintf(host, sizeof host, "10.0.1.%u", 1 + i);
        kvl_path_init(&p->paths[i], i, i, local, host, (uint16_t)(7000 + i), NULL, NULL);
    }
    kvl_peer_update_hint(p);
    return p;
}

/* The next log record, or level 0 when there is none. */
static kvl_log_record next_log(kvl_agent *a)
{
    kvl_log_record r;
    if (kvl_next_log(a, 0, &r) != KVL_OK)
        memset(&r, 0, sizeof r);
    return r;
}

static int no_more_logs(kvl_agent *a)
{
    return next_log(a).level == 0;
}

static void test_init(void)
{
    kvl_agent *a = agent_new();
    kvl_peer *p = peer_new(a, 2);
    kvl_path *pa = &p->paths[1];
    int ep;
    kvl_path_init(pa, 1, 1, "10.0.0.2", "10.0.1.2", 7001, NULL, (kvl_ep *)&ep);
    CHECK_EQ_U64(pa->index, 1);
    CHECK(!strcmp(pa->local, "10.0.0.2"));
    CHECK(!strcmp(pa->rhost, "10.0.1.2"));
    CHECK(!strcmp(pa->remote, "10.0.1.2:7001"));
    CHECK_EQ_U64(pa->rport, 7001);
    CHECK(pa->ep == (kvl_ep *)&ep);
    CHECK(!strcmp(p->ctrl_path.local, "10.0.0.1") && !strcmp(p->ctrl_path.rhost, "10.0.1.1"));
    CHECK_EQ_U64(p->ctrl_path.rport, 7000);
    CHECK(!p->ctrl_path.remote[0]); /* the control connection's remote is never set */
    CHECK(kvl_path_may_work(pa) && atomic_load(&p->may_work));
    /* the engine adopts: one endpoint taken over, the other not */
    int conn;
    kvl_path_adopted(p, pa, (kvl_conn *)&conn);
    CHECK(pa->conn == (kvl_conn *)&conn && !pa->ep);
    CHECK(no_more_logs(a));
    kvl_path_adopted(p, &p->paths[0], NULL);
    CHECK_EQ_U64(p->paths[0].state, KVL_PATH_DOWN);
    CHECK(!p->paths[0].conn && !p->paths[0].ep);
    kvl_log_record r = next_log(a);
    CHECK_EQ_U64(r.level, KVL_LOG_WARNING);
    CHECK_EQ_U64(r.path, 0);
    CHECKF(!strcmp(r.msg, "path 10.0.0.1 -> 10.0.1.1: UP -> DOWN: engine: cannot take the "
                          "connection over"), "%s", r.msg);
    /* adoption failing is no failed reconnect: the path may still come back */
    CHECK(kvl_path_may_work(&p->paths[0]));
    free(p);
    agent_free(a);
}

static void test_states(void)
{
    kvl_agent *a = agent_new();
    kvl_peer *p = peer_new(a, 2);
    kvl_path *pa = &p->paths[0];

    /* add_peer: a path that never connected is known dead; the peer is not
     * while another path works */
    kvl_path_never_connected(p, pa, "connection refused");
    CHECK_EQ_U64(pa->state, KVL_PATH_DOWN);
    CHECK_EQ_U64(pa->probe_fails, 1);
    CHECK(!kvl_path_may_work(pa));
    CHECK(atomic_load(&p->may_work));
    CHECK(!strcmp(pa->last_error, "connection refused"));
    CHECK(!strcmp(pa->down_cause, "connection refused"));
    CHECK(pa->t_down_ns > 0);
    kvl_log_record r = next_log(a);
    CHECK_EQ_U64(r.level, KVL_LOG_WARNING);
    CHECK(!strcmp(r.peer, "b"));
    CHECKF(!strcmp(r.msg, "path 10.0.0.1 -> 10.0.1.1: UP -> DOWN: connection refused"), "%s",
           r.msg);
    kvl_path_never_connected(p, &p->paths[1], "no route");
    CHECK(!atomic_load(&p->may_work)); /* every path known dead */
    CHECK_EQ_U64(next_log(a).level, KVL_LOG_WARNING);

    /* the same state again: nothing happens, nothing is logged */
    uint64_t down_at = pa->t_down_ns;
    kvl_path_set_state(p, pa, KVL_PATH_DOWN, "again");
    CHECK(no_more_logs(a));
    CHECK(!strcmp(pa->last_error, "connection refused"));

    /* a probe that fails: PROBING -> DOWN is debug, the cause of the
     * outage stays and so does the time it began */
    kvl_path_set_state(p, pa, KVL_PATH_PROBING, "reconnecting");
    CHECK_EQ_U64(next_log(a).level, KVL_LOG_DEBUG);
    kvl_path_set_state(p, pa, KVL_PATH_DOWN, "timed out");
    CHECK_EQ_U64(next_log(a).level, KVL_LOG_DEBUG);
    kvl_path_reconnect_failed(p, pa);
    CHECK_EQ_U64(pa->probe_fails, 2);
    CHECK(!strcmp(pa->last_error, "timed out"));
    CHECK(!strcmp(pa->down_cause, "connection refused"));
    CHECK_EQ_U64(pa->t_down_ns, down_at);

    /* a probe that works: INFO, and the peer works again */
    int conn;
    kvl_path_set_state(p, pa, KVL_PATH_PROBING, "reconnecting");
    CHECK_EQ_U64(next_log(a).level, KVL_LOG_DEBUG);
    kvl_path_reconnected(p, pa, (kvl_conn *)&conn, 5 * MS);
    CHECK_EQ_U64(pa->state, KVL_PATH_UP);
    r = next_log(a);
    CHECK_EQ_U64(r.level, KVL_LOG_INFO);
    CHECKF(!strcmp(r.msg, "path 10.0.0.1 -> 10.0.1.1: PROBING -> UP: reconnected"), "%s", r.msg);
    CHECK(atomic_load(&p->may_work));

    /* UP <-> DEGRADED follows the rate: debug */
    kvl_path_set_state(p, pa, KVL_PATH_DEGRADED, "slow");
    CHECK_EQ_U64(next_log(a).level, KVL_LOG_DEBUG);
    kvl_path_set_state(p, pa, KVL_PATH_UP, "fast");
    CHECK_EQ_U64(next_log(a).level, KVL_LOG_DEBUG);

    /* stalled and back: WARNING then INFO; the stall is an outage */
    kvl_path_stall_detected(pa, 111, 222, 200);
    CHECK_EQ_U64(pa->stall_acked, 111);
    CHECK_EQ_U64(pa->stall_received, 222);
    CHECK_EQ_U64(pa->stall_limit_ms, 200);
    uint64_t before = kvl_now_ns();
    kvl_path_stalled(p, pa, "silent");
    CHECK_EQ_U64(pa->state, KVL_PATH_STALLED);
    CHECK(pa->t_stall_ns >= before && pa->t_down_ns >= before);
    CHECK(!strcmp(pa->last_error, "silent") && !strcmp(pa->down_cause, "silent"));
    CHECK_EQ_U64(next_log(a).level, KVL_LOG_WARNING);
    CHECK(kvl_path_may_work(pa)); /* stalled may come back */
    kvl_path_recovered(p, pa, 300, 9 * MS);
    CHECK_EQ_U64(pa->state, KVL_PATH_UP);
    CHECK_EQ_U64(pa->t_progress_ns, 9 * MS);
    CHECK(pa->jitter_ms == 500.0); /* 300 ms silent + the 200 ms that made it a stall */
    r = next_log(a);
    CHECK_EQ_U64(r.level, KVL_LOG_INFO);
    CHECKF(!strcmp(r.msg, "path 10.0.0.1 -> 10.0.1.1: STALLED -> UP: moving again after 300 ms"),
           "%s", r.msg);
    /* a shorter silence keeps the longer one it recovered from */
    kvl_path_stall_detected(pa, 1, 2, 200);
    kvl_path_stalled(p, pa, "silent");
    kvl_path_recovered(p, pa, 10, 10 * MS);
    CHECK(pa->jitter_ms == 500.0);
    /* ...which decays a little every tick */
    kvl_path_tick(pa);
    CHECK(pa->jitter_ms < 500.0 && pa->jitter_ms > 497.0);
    CHECK(next_log(a).level && next_log(a).level && no_more_logs(a));
    CHECK(!strcmp(kvl_path_state_name(KVL_PATH_STALLED), "STALLED"));
    CHECK(!strcmp(kvl_path_state_name(99), "?"));
    free(p);
    agent_free(a);
}

/* The control connection's state is not in the path snapshots: its
 * changes wake kvl_paths_wait themselves, a data path's do not. */
static void test_ctrl_wakes_waiters(void)
{
    kvl_agent *a = agent_new();
    kvl_peer *p = peer_new(a, 1);
    kvl_path_set_state(p, &p->paths[0], KVL_PATH_DOWN, "lost");
    CHECK_EQ_U64(a->paths_gen, 0);
    kvl_path_set_state(p, &p->ctrl_path, KVL_PATH_DOWN, "connection lost");
    CHECK_EQ_U64(a->paths_gen, 1);
    kvl_log_record r = next_log(a);
    r = next_log(a);
    CHECK_EQ_U64(r.path, -1);
    CHECKF(!strcmp(r.msg, "control connection 10.0.0.1 -> 10.0.1.1: UP -> DOWN: connection lost"),
           "%s", r.msg);
    /* a reconnected control connection: its connection is p->ctrl, not the path's */
    int conn;
    kvl_path_set_state(p, &p->ctrl_path, KVL_PATH_PROBING, "reconnecting");
    kvl_path_reconnected(p, &p->ctrl_path, (kvl_conn *)&conn, 1);
    CHECK(!p->ctrl_path.conn);
    CHECK_EQ_U64(p->ctrl_path.state, KVL_PATH_UP);
    CHECK_EQ_U64(p->ctrl_path.reconnects, 1);
    CHECK_EQ_U64(a->paths_gen, 3);
    /* the control connection moves to the next pair that works */
    kvl_path_route(&p->ctrl_path, "10.0.0.9", "10.0.1.9", 7009);
    CHECK(!strcmp(p->ctrl_path.local, "10.0.0.9") && !strcmp(p->ctrl_path.rhost, "10.0.1.9"));
    CHECK_EQ_U64(p->ctrl_path.rport, 7009);
    free(p);
    agent_free(a);
}

static void test_backoff_and_reconnect(void)
{
    kvl_agent *a = agent_new();
    kvl_peer *p = peer_new(a, 1);
    kvl_path *pa = &p->paths[0];
    const uint32_t want[] = {100, 200, 400, 800, 1000, 1000, 1000};
    for (size_t k = 0; k < sizeof want / sizeof *want; k++) {
        uint64_t now = (k + 1) * 1000 * MS;
        kvl_path_backoff(pa, now, 1000);
        CHECK_EQ_U64(pa->backoff_ms, want[k]);
        CHECK_EQ_U64(pa->next_probe_ns, now + want[k] * MS);
    }
    /* a cap below the first step still caps */
    kvl_path fresh;
    memset(&fresh, 0, sizeof fresh);
    kvl_path_backoff(&fresh, 0, 50);
    CHECK_EQ_U64(fresh.backoff_ms, 50);

    /* a connection that fails: DOWN, re-probed after the agent's capped backoff */
    a->cfg.probe_backoff_max_ms = 1000;
    kvl_path_failed(p, pa, 2 * MS, "reset by peer");
    CHECK_EQ_U64(pa->state, KVL_PATH_DOWN);
    CHECK(!strcmp(pa->last_error, "reset by peer"));
    CHECK_EQ_U64(pa->backoff_ms, 1000);
    CHECK_EQ_U64(pa->next_probe_ns, 1002 * MS);
    /* a reconnect resets what belonged to the old connection */
    kvl_path_reconnect_failed(p, pa);
    kvl_path_ping_sent(pa, 3 * MS);
    kvl_tp_sample s = {.bytes_acked = 5000, .bytes_received = 6000};
    kvl_path_sampled(pa, &s, 4 * MS, 0);
    CHECK(pa->ping_sent_ns && pa->seen_acked == 5000 && pa->probe_fails == 1);
    int c1, c2;
    kvl_path_set_state(p, pa, KVL_PATH_PROBING, "reconnecting");
    kvl_path_reconnected(p, pa, (kvl_conn *)&c1, 7 * MS);
    CHECK(pa->conn == (kvl_conn *)&c1);
    CHECK_EQ_U64(pa->state, KVL_PATH_UP);
    CHECK_EQ_U64(pa->backoff_ms, 0);
    CHECK_EQ_U64(pa->probe_fails, 0);
    CHECK_EQ_U64(pa->reconnects, 1);
    CHECK_EQ_U64(pa->t_progress_ns, 7 * MS);
    CHECK_EQ_U64(pa->ping_sent_ns, 0);
    CHECK_EQ_U64(pa->seen_acked, 0);
    CHECK_EQ_U64(pa->seen_received, 0);
    CHECK(atomic_load(&p->may_work));
    kvl_path_failed(p, pa, 8 * MS, "reset again");
    CHECK_EQ_U64(pa->backoff_ms, 100); /* starts over */
    CHECK_EQ_U64(pa->next_probe_ns, 108 * MS);
    kvl_path_set_state(p, pa, KVL_PATH_PROBING, "reconnecting");
    kvl_path_reconnected(p, pa, (kvl_conn *)&c2, 9 * MS);
    CHECK_EQ_U64(pa->reconnects, 2);
    CHECK(pa->conn == (kvl_conn *)&c2);
    free(p);
    agent_free(a);
}

/* Random dispatches and drops against a model: in-flight bytes and chunks
 * always match it, drops on an idle path stay at zero, busy periods begin
 * only when an idle path gets a copy. */
static void test_inflight(void)
{
    kvl_path pa;
    memset(&pa, 0, sizeof pa);
    test_rng rng = {0x9a7e};
    uint64_t live[64];
    uint32_t n = 0;
    uint64_t bytes = 0, hedges = 0, now = 0;
    for (int step = 0; step < 20000; step++) {
        now += rng_range(&rng, 1, 1000);
        uint64_t r = rng_range(&rng, 0, 9);
        if (r < 5 && n < 64) {
            uint64_t b = rng_range(&rng, 1, 1 << 20);
            int hedge = r == 0;
            uint32_t was = pa.inflight_chunks;
            uint64_t busy = pa.busy_start_ns;
            kvl_path_dispatched(&pa, b, hedge, now);
            CHECK_EQ_U64(pa.busy_start_ns, was ? busy : now);
            if (!was)
                CHECK_EQ_U64(pa.busy_bytes, 0);
            live[n++] = b;
            bytes += b;
            hedges += (uint64_t)hedge;
        } else if (r < 9 && n) {
            uint32_t k = (uint32_t)rng_range(&rng, 0, n - 1);
            kvl_path_copy_dropped(&pa, live[k]);
            bytes -= live[k];
            live[k] = live[--n];
        } else if (r == 9 && !n) {
            kvl_path_copy_dropped(&pa, 4096); /* nothing there: stays at zero */
        } else if (r == 9 && rng_range(&rng, 0, 9) == 0) {
            kvl_path_evacuated(&pa);
            n = 0;
            bytes = 0;
        }
        if (!CHECK_EQ_U64(pa.inflight_bytes, bytes) || !CHECK_EQ_U64(pa.inflight_chunks, n))
            break;
    }
    CHECK_EQ_U64(pa.hedges, hedges);
    /* a drop larger than what is accounted (a copy taken off twice) floors at zero */
    kvl_path_evacuated(&pa);
    kvl_path_dispatched(&pa, 100, 0, now);
    kvl_path_copy_dropped(&pa, 1000);
    CHECK_EQ_U64(pa.inflight_bytes, 0);
    CHECK_EQ_U64(pa.inflight_chunks, 0);
    kvl_path_copy_dropped(&pa, 1000);
    CHECK_EQ_U64(pa.inflight_chunks, 0);
}

/* The rate estimate: a busy period's rate, a short period raising it only. */
static void test_rate(void)
{
    kvl_path pa;
    memset(&pa, 0, sizeof pa);
    /* 10 MB in 20 ms: too short to set a first estimate */
    kvl_path_dispatched(&pa, 10000000, 0, 1000 * MS);
    kvl_path_copy_dropped(&pa, 10000000);
    kvl_path_chunk_done(&pa, 10000000, 1020 * MS);
    CHECK(pa.bw_Bps == 0);
    CHECK_EQ_U64(pa.chunks_done, 1);
    CHECK_EQ_U64(pa.t_chunk_ns, 1020 * MS);
    CHECK_EQ_U64(pa.t_progress_ns, 1020 * MS);
    /* 100 MB over 100 ms of busy time: 1 GB/s */
    kvl_path_dispatched(&pa, 100000000, 0, 2000 * MS);
    kvl_path_copy_dropped(&pa, 100000000);
    kvl_path_chunk_done(&pa, 100000000, 2100 * MS);
    CHECKF(pa.bw_Bps > 0.999e9 && pa.bw_Bps < 1.001e9, "bw %g", pa.bw_Bps);
    /* a short, slower period leaves it; a short, faster one raises it */
    kvl_path_dispatched(&pa, 1000000, 0, 3000 * MS);
    kvl_path_chunk_done(&pa, 1000000, 3010 * MS); /* 0.1 GB/s */
    CHECKF(pa.bw_Bps > 0.999e9 && pa.bw_Bps < 1.001e9, "bw %g", pa.bw_Bps);
    kvl_path_copy_dropped(&pa, 1000000);
    kvl_path_dispatched(&pa, 40000000, 0, 4000 * MS);
    kvl_path_chunk_done(&pa, 40000000, 4010 * MS); /* 4 GB/s: 0.7 * 1 + 0.3 * 4 */
    CHECKF(pa.bw_Bps > 1.899e9 && pa.bw_Bps < 1.901e9, "bw %g", pa.bw_Bps);
    CHECK_EQ_U64(pa.chunks_done, 4);
    /* a long, slower period lowers it */
    kvl_path_copy_dropped(&pa, 40000000);
    kvl_path_dispatched(&pa, 50000000, 0, 5000 * MS);
    kvl_path_chunk_done(&pa, 50000000, 5100 * MS); /* 0.5 GB/s: 0.7 * 1.9 + 0.3 * 0.5 */
    CHECKF(pa.bw_Bps > 1.479e9 && pa.bw_Bps < 1.481e9, "bw %g", pa.bw_Bps);
}

static void test_monitor_samples(void)
{
    kvl_path pa;
    memset(&pa, 0, sizeof pa);
    /* RTT from PINGs: the first sets it, later ones smooth it; a PONG for
     * an older PING moves only the progress time */
    kvl_path_ping_sent(&pa, 10 * MS);
    CHECK_EQ_U64(pa.ping_sent_ns, 10 * MS);
    CHECK_EQ_U64(pa.t_last_ping_ns, 10 * MS);
    kvl_path_pong(&pa, 10 * MS, 11 * MS);
    CHECK(pa.rtt_us == 1000.0);
    CHECK_EQ_U64(pa.ping_sent_ns, 0);
    CHECK_EQ_U64(pa.t_progress_ns, 11 * MS);
    kvl_path_ping_sent(&pa, 20 * MS);
    kvl_path_pong(&pa, 10 * MS, 22 * MS); /* stale */
    CHECK(pa.rtt_us == 1000.0);
    CHECK_EQ_U64(pa.ping_sent_ns, 20 * MS);
    CHECK_EQ_U64(pa.t_progress_ns, 22 * MS);
    kvl_path_pong(&pa, 20 * MS, 22 * MS); /* 2000 us: 0.7 * 1000 + 0.3 * 2000 */
    CHECK(pa.rtt_us > 1299.9 && pa.rtt_us < 1300.1);

    /* TCP_INFO samples: an idle path is never silent; a busy one is silent
     * while its counters stand still */
    kvl_tp_sample s = {.rtt_us = 50, .delivery_Bps = 2e9, .bytes_acked = 100,
                       .bytes_received = 200};
    kvl_path_sampled(&pa, &s, 100 * MS, 0);
    CHECK(pa.rtt_us > 1299.9); /* idle: the kernel's RTT is not taken */
    CHECK(pa.delivery_Bps == 2e9);
    CHECK_EQ_U64(pa.t_progress_ns, 100 * MS);
    CHECK_EQ_U64(pa.seen_acked, 100);
    CHECK_EQ_U64(pa.seen_received, 200);
    CHECK_EQ_U64(pa.stall_ms, 0);
    kvl_path_dispatched(&pa, 1000, 0, 100 * MS);
    kvl_path_sampled(&pa, &s, 350 * MS, 0);
    CHECK(pa.rtt_us == 50);
    CHECK_EQ_U64(pa.t_progress_ns, 100 * MS);
    CHECK_EQ_U64(pa.stall_ms, 250);
    s.bytes_acked++;
    kvl_path_sampled(&pa, &s, 400 * MS, 0);
    CHECK_EQ_U64(pa.t_progress_ns, 400 * MS);
    CHECK_EQ_U64(pa.stall_ms, 0);
    /* an application-limited rate sample is not the path's */
    s.delivery_Bps = 1e6;
    s.app_limited = 1;
    kvl_path_sampled(&pa, &s, 410 * MS, 0);
    CHECK(pa.delivery_Bps == 2e9);

    /* a busy path's estimate follows the kernel's rate down, past its ramp-up only */
    memset(&pa, 0, sizeof pa);
    kvl_path_dispatched(&pa, 100000000, 0, 1000 * MS);
    kvl_path_chunk_done(&pa, 100000000, 1100 * MS); /* 1 GB/s */
    kvl_path_copy_dropped(&pa, 100000000);
    kvl_path_dispatched(&pa, 1000, 0, 2000 * MS); /* busy again: a new period */
    kvl_tp_sample slow = {.delivery_Bps = 0.2e9};
    kvl_path_sampled(&pa, &slow, 2100 * MS, 200 * MS); /* within the ramp */
    CHECKF(pa.bw_Bps > 0.999e9, "bw %g", pa.bw_Bps);
    kvl_path_sampled(&pa, &slow, 2300 * MS, 200 * MS);
    CHECKF(pa.bw_Bps > 0.599e9 && pa.bw_Bps < 0.601e9, "bw %g", pa.bw_Bps);
    kvl_tp_sample fair = {.delivery_Bps = 0.5e9}; /* above 70% of the estimate: kept */
    kvl_path_sampled(&pa, &fair, 2400 * MS, 200 * MS);
    CHECKF(pa.bw_Bps > 0.599e9 && pa.bw_Bps < 0.601e9, "bw %g", pa.bw_Bps);

    kvl_path_nic_sampled(&pa, 3e9);
    CHECK(pa.nic_other_Bps == 3e9);
}

/* The connection's end: byte totals carried over, and the fallback timer
 * armed only for a mover that falls back. */
static void test_lost_and_fallback(void)
{
    kvl_agent *a = agent_new();
    kvl_peer *p = peer_new(a, 1);
    kvl_path *pa = &p->paths[0];
    int conn;
    kvl_path_carried_by(pa, 2, KVL_MV_ONE_SIDED | KVL_MV_FALLS_BACK, "UCX: rndv");
    CHECK_EQ_U64(pa->mover_kind, 2);
    CHECK_EQ_U64(pa->mover_caps, KVL_MV_ONE_SIDED | KVL_MV_FALLS_BACK);
    CHECK(!strcmp(pa->tnote, "UCX: rndv"));
    kvl_path_noted(pa, "UCX: rndv, keys for 3 regions");
    CHECK(!strcmp(pa->tnote, "UCX: rndv, keys for 3 regions"));
    CHECK_EQ_U64(pa->mover_kind, 2);

    /* a mover that does not fall back (and no mover, and a closing agent) */
    kvl_path_adopted(p, pa, (kvl_conn *)&conn);
    CHECK(pa->conn == (kvl_conn *)&conn);
    kvl_path_lost(pa, 10, 20, 5, KVL_MV_ONE_SIDED | KVL_MV_NO_HEDGE, "reset");
    CHECK(!pa->conn);
    CHECK_EQ_U64(pa->mover_off_until_ns, 0);
    CHECK(!pa->mover_died[0]);
    CHECK_EQ_U64(pa->mover_died_kind, 0);
    kvl_path_lost(pa, 1, 2, 0, 0, "reset");
    CHECK_EQ_U64(pa->mover_off_until_ns, 0);
    CHECK_EQ_U64(pa->bytes_sent_prev, 11);
    CHECK_EQ_U64(pa->bytes_recv_prev, 22);
    CHECK_EQ_U64(pa->bytes_put_prev, 5);

    /* one that does: in-stream for KVL_MOVER_FALLBACK_MS, saying why */
    uint64_t before = kvl_now_ns();
    kvl_path_lost(pa, 100, 200, 50, KVL_MV_ONE_SIDED | KVL_MV_FALLS_BACK, "UCX endpoint error");
    uint64_t after = kvl_now_ns();
    uint64_t off = __atomic_load_n(&pa->mover_off_until_ns, __ATOMIC_RELAXED);
    CHECK(off >= before + KVL_MOVER_FALLBACK_MS * MS && off <= after + KVL_MOVER_FALLBACK_MS * MS);
    CHECK(!strcmp(pa->mover_died, "UCX endpoint error"));
    CHECK_EQ_U64(pa->mover_died_kind, 2);
    CHECK_EQ_U64(pa->bytes_sent_prev, 111);
    CHECK_EQ_U64(pa->bytes_recv_prev, 222);
    CHECK_EQ_U64(pa->bytes_put_prev, 55);
    /* the fallen-back connection runs in-stream: its loss leaves the timer */
    kvl_path_carried_by(pa, 0, 0, "UCX path died: TCP");
    kvl_path_lost(pa, 0, 0, 0, 0, "reset again");
    CHECK_EQ_U64(pa->mover_off_until_ns, off);
    CHECK(!strcmp(pa->mover_died, "UCX endpoint error"));
    CHECK_EQ_U64(pa->mover_died_kind, 2);
    CHECK(no_more_logs(a));
    free(p);
    agent_free(a);
}

int main(void)
{
    double t0 = test_now_s();
    test_init();
    test_states();
    test_ctrl_wakes_waiters();
    test_backoff_and_reconnect();
    test_inflight();
    test_rate();
    test_monitor_samples();
    test_lost_and_fallback();
    return test_report("test_path", t0);
}
