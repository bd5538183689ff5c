/* policy.c: the scheduler's decisions, as pure functions over path snapshots.
 *
 * sched.c takes a snapshot of a peer's paths (kvl_path_view), asks these
 * functions and carries the answer out.  Nothing here touches the engine, a
 * clock or a socket, so every rule is tested on its own (tests/c/test_policy.c).
 */
#include "internal.h"

#define DEFAULT_BPS 1e9            /* prior for a path without samples: ties go by load */
#define HEDGE_GAIN 2.0             /* hedge only if the copy would finish in under half the time */
#define REMEASURE_NS 2000000000ull /* an idle, low-rated path is tried again after 2 s */

double kvl_policy_prior(const kvl_path_view *v, uint32_t n)
{
    double sum = 0;
    int known = 0;
    for (uint32_t i = 0; i < n; i++)
        if (v[i].usable && v[i].bw_Bps > 0) {
            sum += v[i].bw_Bps;
            known++;
        }
    return known ? sum / known : DEFAULT_BPS;
}

/* Rate to plan with: measured, or the prior; an idle path whose NIC carries
 * other traffic is scored by what that traffic leaves free.  An idle path
 * rated below the others and unused for REMEASURE_NS plans with the prior
 * once, so it gets a chunk and a fresh measurement: paths that once shared a
 * bottleneck (or met a burst of other traffic) are not left out for good. */
double kvl_policy_rate(const kvl_path_view *pv, double prior)
{
    double bw = pv->bw_Bps > 0 ? pv->bw_Bps : prior;
    if (!pv->inflight_chunks && bw < prior && pv->idle_ns > REMEASURE_NS)
        bw = prior;
    if (!pv->inflight_chunks && pv->nic_other_Bps > 0) {
        double left = bw - pv->nic_other_Bps;
        bw = left > 0.1 * bw ? left : 0.1 * bw;
    }
    return bw;
}

int kvl_policy_window_open(const kvl_path_view *pv, uint32_t window_chunks, uint64_t window_bytes)
{
    return pv->inflight_chunks < window_chunks || pv->inflight_bytes < window_bytes;
}

static double finish_s(const kvl_path_view *pv, uint64_t bytes, double prior)
{
    return (double)(pv->inflight_bytes + bytes) / kvl_policy_rate(pv, prior) + pv->rtt_us * 1e-6;
}

int kvl_policy_pick(const kvl_path_view *v, uint32_t n, uint64_t bytes, uint64_t pending_bytes,
                    uint32_t window_chunks, uint64_t window_bytes)
{
    double prior = kvl_policy_prior(v, n);
    int best = -1;
    double best_t = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (!v[i].usable)
            continue;
        double t = finish_s(&v[i], bytes, prior);
        if (best < 0 || t < best_t) {
            best = (int)i;
            best_t = t;
        }
    }
    if (best < 0 || kvl_policy_window_open(&v[best], window_chunks, window_bytes))
        return best;
    /* The earliest finish is on a full path.  A path with room still takes
     * the chunk if it would deliver it before all the remaining work is done
     * at the aggregate rate: a slow path then helps instead of becoming the
     * straggler.  Otherwise the chunk waits for the fast path. */
    double remaining = (double)pending_bytes, agg = 0;
    int alt = -1;
    double alt_t = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (!v[i].usable)
            continue;
        remaining += (double)v[i].inflight_bytes;
        agg += kvl_policy_rate(&v[i], prior);
        if (!kvl_policy_window_open(&v[i], window_chunks, window_bytes))
            continue;
        double t = finish_s(&v[i], bytes, prior);
        if (alt < 0 || t < alt_t) {
            alt = (int)i;
            alt_t = t;
        }
    }
    return alt >= 0 && agg > 0 && alt_t <= remaining / agg ? alt : -1;
}

double kvl_policy_hedge_late_s(const kvl_path_view *slow, const kvl_path_view *idle,
                               uint64_t chunk_bytes, double prior)
{
    if (!idle->usable || idle->inflight_chunks)
        return 0;
    double left = (double)slow->inflight_bytes / kvl_policy_rate(slow, prior);
    double here = (double)chunk_bytes / kvl_policy_rate(idle, prior) + idle->rtt_us * 1e-6;
    return left > HEDGE_GAIN * here ? left : 0;
}
