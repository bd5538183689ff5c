/* policy.h: the scheduler's decisions, pure functions over path snapshots (policy.c). */
#ifndef KVLINK_POLICY_H_
#define KVLINK_POLICY_H_

#include "base.h"

/* ---- policy.c: the scheduler's decisions, pure functions ---- */
/* What the scheduler needs to know of a path, at one instant. */
typedef struct kvl_path_view {
    int usable;               /* UP or DEGRADED with a live connection */
    double bw_Bps;            /* EWMA of its delivery rate; 0: no sample yet */
    double rtt_us;
    double nic_other_Bps;     /* traffic on its NIC that is not ours */
    uint64_t inflight_bytes;
    uint32_t inflight_chunks;
    uint64_t idle_ns;         /* since it last verified a chunk or got busy */
} kvl_path_view;
/* Mean rate of the usable paths that have one, else 1 GB/s. */
double kvl_policy_prior(const kvl_path_view *v, uint32_t n);
/* The rate a path is planned with (measured, prior, less competing traffic). */
double kvl_policy_rate(const kvl_path_view *pv, double prior);
int kvl_policy_window_open(const kvl_path_view *pv, uint32_t window_chunks, uint64_t window_bytes);
/* The path for a chunk of `bytes`: the earliest predicted finish
 * ((in flight + bytes) / rate + rtt) among usable paths with window room; a
 * full best path gives way to one with room only if that one still beats
 * the remaining work (pending_bytes + all in flight) at the aggregate rate.
 * -1: wait (no usable path, or the chunk should wait for the best one). */
int kvl_policy_pick(const kvl_path_view *v, uint32_t n, uint64_t bytes, uint64_t pending_bytes,
                    uint32_t window_chunks, uint64_t window_bytes);
/* Seconds the chunk's current copy on `slow` is predicted to need, if an
 * idle path would deliver a copy in under half of that; else 0 (no hedge). */
double kvl_policy_hedge_late_s(const kvl_path_view *slow, const kvl_path_view *idle,
                               uint64_t chunk_bytes, double prior);

#endif
