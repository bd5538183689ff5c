/* path.h: one path to a peer (a NIC pair) or a peer's control connection,
 * and the only functions that change it (path.c).
 *
 * Every field of kvl_path is written in path.c and nowhere else: the
 * monitor, the scheduler, the prober and the frame handlers report what
 * happened (a chunk went out, a probe failed, the connection closed) and
 * path.c updates the counters, estimates and state that follow from it.
 * Everyone may read the fields (the scheduler and paths() take snapshots).
 * tests/unit/test_path_writes.py fails when a write appears elsewhere.
 *
 * Engine thread only, unless a function says otherwise (add_peer sets a
 * path up before the engine adopts the peer).
 */
#ifndef KVLINK_PATH_H
#define KVLINK_PATH_H

#include "base.h"

struct kvl_path {
    uint32_t index;
    kvl_conn *conn;
    kvl_ep *ep;                /* connected endpoint waiting for the engine to adopt it */
    uint32_t state;            /* kvl_path_state */
    char local[48], remote[48];
    uint64_t inflight_bytes;
    uint32_t inflight_chunks;
    double bw_Bps;             /* EWMA of the busy-period delivery rate; 0 = no sample yet */
    double rtt_us;             /* smoothed RTT from TCP_INFO, sampled every tick */
    uint64_t busy_start_ns;    /* when the path last went from idle to busy */
    uint64_t busy_bytes;       /* bytes verified since busy_start_ns */
    char rhost[48];            /* the peer address and port this path connects to */
    uint16_t rport;
    uint32_t laddr;            /* index of the local address (a->addrs) it leaves from */
    char via[48];              /* relayed: the relay's address ("" direct), fixed */
    uint16_t via_port;
    char via_name[64];         /* ... and its agent name */
    /* monitor (monitor.c) */
    double delivery_Bps;
    double nic_other_Bps;
    uint64_t t_progress_ns;    /* last time bytes moved either way (tick resolution) */
    uint64_t t_chunk_ns;       /* last chunk verified on this path */
    uint64_t seen_acked, seen_received;
    uint32_t stall_ms;
    uint64_t t_last_ping_ns, ping_sent_ns; /* ping_sent_ns != 0: a probe is outstanding */
    uint64_t bytes_sent_prev, bytes_recv_prev; /* totals of earlier connections */
    uint64_t bytes_put_prev;   /* ... of which placed by a one-sided mover (bytes_put) */
    /* re-probing (probe.c) */
    uint64_t next_probe_ns;
    uint32_t backoff_ms;
    uint32_t reconnects;
    uint64_t hedges;
    uint64_t t_down_ns;
    uint32_t probe_fails;      /* reconnects that failed since the path last was up */
    char down_cause[96];       /* why it left service, kept through failed reconnects */
    uint64_t t_stall_ns;       /* STALLED since */
    uint64_t stall_acked, stall_received; /* TCP counters when it stalled */
    uint32_t stall_limit_ms;   /* silence that counted as a stall at that moment */
    double jitter_ms;          /* longest silence the path recovered from (decays) */
    uint64_t chunks_done;
    char last_error[160];
    /* what carries the connection's payloads (transport.h): its mover's kind and
     * KVL_MV_* bits, 0 in-stream; the scheduler reads the bits, never a name */
    uint32_t mover_kind, mover_caps;
    char tnote[128];           /* why this transport (kvl_path_info.transport_note) */
    /* a connection that a KVL_MV_FALLS_BACK mover carried died: the path's next
     * connections run in-stream on the same NIC (no mover) until this
     * CLOCK_MONOTONIC time; atomic (the connecting threads read it) */
    uint64_t mover_off_until_ns;
    char mover_died[96];       /* engine: why it died (for the fallen-back path's note) */
    uint32_t mover_died_kind;  /* engine: the mover that carried it */
};

/* ---- state ---- */
/* Moves pa (a data path of p, or &p->ctrl_path) to state, logging why;
 * DOWN and STALLED keep why as last_error. */
void kvl_path_set_state(kvl_peer *p, kvl_path *pa, uint32_t state, const char *why);
const char *kvl_path_state_name(uint32_t state);
/* 0 once a reconnect of the path failed since it went down. */
int kvl_path_may_work(const kvl_path *pa);
/* Refreshes p->may_work after a path's state or probe count changed. */
void kvl_peer_update_hint(kvl_peer *p);

/* ---- set-up (add_peer, before the engine adopts the peer) ---- */
/* Data path `index` from local address laddr (its text: local) to
 * host:port, through the relay rt->via when set (rt may be NULL: direct); ep
 * (may be NULL) is its connection, for the engine to adopt. */
void kvl_path_init(kvl_path *pa, uint32_t index, uint32_t laddr, const char *local,
                   const char *host, uint16_t port, const kvl_route *rt, kvl_ep *ep);
/* Where pa's next connection goes (also the engine: the control connection
 * moves to a path that works). */
void kvl_path_route(kvl_path *pa, const char *local, const char *host, uint16_t port);
/* pa's first connection failed: DOWN, and known dead until a probe works. */
void kvl_path_never_connected(kvl_peer *p, kvl_path *pa, const char *why);

/* ---- its connection ---- */
/* The engine took pa's endpoint over as c; c NULL: it could not (DOWN). */
void kvl_path_adopted(kvl_peer *p, kvl_path *pa, kvl_conn *c);
/* A probe reconnected pa as c (the control connection's is p->ctrl): UP,
 * backoff and failure count reset, the new connection's counters from zero. */
void kvl_path_reconnected(kvl_peer *p, kvl_path *pa, kvl_conn *c, uint64_t now);
/* A reconnect of data path pa failed: known dead (kvl_path_may_work) until one works. */
void kvl_path_reconnect_failed(kvl_peer *p, kvl_path *pa);
/* The next probe of pa waits twice as long as the last (from 100 ms, at most max_ms). */
void kvl_path_backoff(kvl_path *pa, uint64_t now, uint32_t max_ms);
/* pa's connection, or a reconnect of it, failed at now: DOWN, re-probed
 * after its backoff (kvl_path_backoff, up to probe_backoff_max_ms). */
void kvl_path_failed(kvl_peer *p, kvl_path *pa, uint64_t now, const char *why);
/* pa's connection closed having sent / received / placed these bytes (kept
 * in the *_prev totals).  mover_caps: the KVL_MV_* bits of the mover it still
 * ran (0: none, or the agent closes); one that falls back keeps the path's
 * next connections in-stream for KVL_MOVER_FALLBACK_MS, remembering why. */
void kvl_path_lost(kvl_path *pa, uint64_t sent, uint64_t recv, uint64_t put, uint32_t mover_caps,
                   const char *why);
/* pa's new connection carries its payloads by mover kind / caps (0: in-stream),
 * note saying why (paths()' transport_note). */
void kvl_path_carried_by(kvl_path *pa, uint32_t mover_kind, uint32_t mover_caps, const char *note);
/* The transport's note for pa changed (a mover learnt its keys). */
void kvl_path_noted(kvl_path *pa, const char *note);

/* ---- the monitor ---- */
/* A PING went out on pa at now. */
void kvl_path_ping_sent(kvl_path *pa, uint64_t now);
/* A keep-alive PING went out on pa (the control connection) at now: no
 * probe is outstanding for it. */
void kvl_path_keepalive_sent(kvl_path *pa, uint64_t now);
/* A PONG for the PING sent at sent_ns came back: the RTT estimate follows
 * it if it answers the outstanding probe; either way the path moved. */
void kvl_path_pong(kvl_path *pa, uint64_t sent_ns, uint64_t now);
/* Once a tick per connected path: the silence it recovered from decays. */
void kvl_path_tick(kvl_path *pa);
/* The kernel's view of pa's connection at now: RTT, delivery rate (a busy
 * path's estimate follows a slowdown once it is past ramp_ns of busy time),
 * progress and how long it has been silent. */
void kvl_path_sampled(kvl_path *pa, const kvl_tp_sample *s, uint64_t now, uint64_t ramp_ns);
/* Traffic not ours on the NIC pa sends through. */
void kvl_path_nic_sampled(kvl_path *pa, double other_Bps);
/* The monitor found pa stalled: the TCP counters and the silence limit at
 * that moment (kvl_path_recovered's measure). */
void kvl_path_stall_detected(kvl_path *pa, uint64_t acked, uint64_t received, uint32_t limit_ms);
/* pa goes out of service as STALLED from now (its chunks are evacuated). */
void kvl_path_stalled(kvl_peer *p, kvl_path *pa, const char *why);
/* Stalled pa moved again ms after it stalled: UP, and a path that recovers
 * from longer silences is allowed them (jitter_ms). */
void kvl_path_recovered(kvl_peer *p, kvl_path *pa, uint64_t ms, uint64_t now);

/* ---- the scheduler ---- */
/* A copy of a chunk of `bytes` went out on pa (hedge: a second copy); an
 * idle path starts a busy period. */
void kvl_path_dispatched(kvl_path *pa, uint64_t bytes, int hedge, uint64_t now);
/* A copy of `bytes` left pa's in-flight accounting (verified, cancelled or
 * moved); never below zero. */
void kvl_path_copy_dropped(kvl_path *pa, uint64_t bytes);
/* Every copy on pa was taken off it: nothing in flight there. */
void kvl_path_evacuated(kvl_path *pa);
/* A chunk of `bytes` was verified on pa at now: the busy period's rate
 * updates the estimate. */
void kvl_path_chunk_done(kvl_path *pa, uint64_t bytes, uint64_t now);

#endif
