/* test_policy.c: the scheduler's decisions (csrc/policy.c) on hand-made path
 * snapshots: earliest finish, windows, the slow-path rule, the prior,
 * re-measuring idle paths, competing traffic and hedging; then random
 * snapshots against the rules' invariants. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "test_main.h"

#define GBPS 1e9
#define MB 1000000ull
#define WC 2           /* window: chunks */
#define WB (16 * MB)   /* window: bytes */

static kvl_path_view path(double gbps, uint64_t inflight, uint32_t chunks)
{
    return (kvl_path_view){.usable = 1, .bw_Bps = gbps * GBPS, .rtt_us = 50,
                           .inflight_bytes = inflight, .inflight_chunks = chunks};
}

static void test_earliest_finish(void)
{
    kvl_path_view v[2] = {path(1, 0, 0), path(2, 0, 0)};
    CHECK(kvl_policy_pick(v, 2, 8 * MB, 0, WC, WB) == 1); /* faster wins */
    v[1] = path(2, 12 * MB, 1); /* (12+8)/2 = 10 ms > 8/1 = 8 ms */
    CHECK(kvl_policy_pick(v, 2, 8 * MB, 0, WC, WB) == 0);
    v[0].usable = 0; /* never an unusable path */
    CHECK(kvl_policy_pick(v, 2, 8 * MB, 0, WC, WB) == 1);
    v[1].usable = 0;
    CHECK(kvl_policy_pick(v, 2, 8 * MB, 0, WC, WB) == -1);
}

static void test_window_and_slow_path(void)
{
    /* the fast path is full; the slow one (10x slower) is empty */
    kvl_path_view v[2] = {path(10, 32 * MB, 2), path(1, 0, 0)};
    /* little work left: the slow path would finish 8 MB after the rest is
     * done at the aggregate rate, so the chunk waits for the fast path */
    CHECK(kvl_policy_pick(v, 2, 8 * MB, 0, WC, WB) == -1);
    /* a lot left: the slow path delivers its chunk in time, so it helps */
    CHECK(kvl_policy_pick(v, 2, 8 * MB, 1000 * MB, WC, WB) == 1);
    /* window counts chunks or bytes, whichever admits more */
    kvl_path_view w = path(1, 100 * MB, 1);
    CHECK(kvl_policy_window_open(&w, WC, WB));
    w = path(1, 1 * MB, 5);
    CHECK(kvl_policy_window_open(&w, WC, WB));
    w = path(1, 20 * MB, 2);
    CHECK(!kvl_policy_window_open(&w, WC, WB));
}

static void test_prior_and_remeasure(void)
{
    kvl_path_view v[3] = {path(1, 0, 0), path(3, 0, 0), path(0, 0, 0)};
    CHECK(kvl_policy_prior(v, 3) == 2 * GBPS); /* mean of the known */
    CHECK(kvl_policy_rate(&v[2], 2 * GBPS) == 2 * GBPS);
    kvl_path_view none[1] = {path(0, 0, 0)};
    CHECK(kvl_policy_prior(none, 1) == 1e9); /* nothing known: 1 GB/s */
    /* a low-rated idle path plans with the prior once idle for > 2 s */
    v[0].idle_ns = 1000000000ull;
    CHECK(kvl_policy_rate(&v[0], 2 * GBPS) == 1 * GBPS);
    v[0].idle_ns = 3000000000ull;
    CHECK(kvl_policy_rate(&v[0], 2 * GBPS) == 2 * GBPS);
    v[0].inflight_chunks = 1; /* busy: its own rate */
    CHECK(kvl_policy_rate(&v[0], 2 * GBPS) == 1 * GBPS);
}

static void test_competing_traffic(void)
{
    kvl_path_view a = path(2, 0, 0);
    a.nic_other_Bps = 1.5 * GBPS;
    CHECK(kvl_policy_rate(&a, 2 * GBPS) == 0.5 * GBPS);
    a.nic_other_Bps = 5 * GBPS; /* never below a tenth */
    CHECK(kvl_policy_rate(&a, 2 * GBPS) == 0.2 * GBPS);
    a.inflight_chunks = 1; /* busy: its measured rate already includes it */
    CHECK(kvl_policy_rate(&a, 2 * GBPS) == 2 * GBPS);
}

static void test_hedge(void)
{
    kvl_path_view slow = path(0.1, 100 * MB, 2), idle = path(1, 0, 0);
    double late = kvl_policy_hedge_late_s(&slow, &idle, 8 * MB, 1 * GBPS);
    CHECK(late > 0.99 && late < 1.01); /* 100 MB at 0.1 GB/s */
    idle.inflight_chunks = 1;
    CHECK(kvl_policy_hedge_late_s(&slow, &idle, 8 * MB, 1 * GBPS) == 0); /* not idle */
    idle = path(1, 0, 0);
    slow = path(1, 12 * MB, 2); /* 12 ms left against 8 ms here: not worth a copy */
    CHECK(kvl_policy_hedge_late_s(&slow, &idle, 8 * MB, 1 * GBPS) == 0);
    idle.usable = 0;
    slow = path(0.1, 100 * MB, 2);
    CHECK(kvl_policy_hedge_late_s(&slow, &idle, 8 * MB, GBPS) == 0);
}

static double finish(const kvl_path_view *v, uint32_t n, uint32_t i, uint64_t bytes)
{
    double prior = kvl_policy_prior(v, n);
    return (double)(v[i].inflight_bytes + bytes) / kvl_policy_rate(&v[i], prior) +
           v[i].rtt_us * 1e-6;
}

/* Random snapshots: the answer is -1 or a usable path with window room; if
 * the best path has room, it is the earliest finish of all usable paths. */
static void test_random(void)
{
    test_rng r = {0x706f6c6963790001ull};
    for (int round = 0; round < 20000; round++) {
        uint32_t n = (uint32_t)rng_range(&r, 1, 16);
        kvl_path_view v[16];
        for (uint32_t i = 0; i < n; i++) {
            v[i] = path((double)rng_range(&r, 0, 100) / 10, rng_range(&r, 0, 64) * MB,
                        (uint32_t)rng_range(&r, 0, 4));
            v[i].usable = rng_range(&r, 0, 9) != 0;
            v[i].rtt_us = (double)rng_range(&r, 10, 5000);
            v[i].idle_ns = rng_range(&r, 0, 4) * 1000000000ull;
            v[i].nic_other_Bps = rng_range(&r, 0, 3) ? 0 : (double)rng_range(&r, 0, 5) * GBPS;
        }
        uint64_t bytes = rng_range(&r, 1, 64) * MB;
        int got = kvl_policy_pick(v, n, bytes, rng_range(&r, 0, 2000) * MB, WC, WB);
        if (got < 0)
            continue;
        CHECKF(v[got].usable && kvl_policy_window_open(&v[got], WC, WB), "round %d", round);
        int all_open = 1;
        for (uint32_t i = 0; i < n; i++)
            all_open &= !v[i].usable || kvl_policy_window_open(&v[i], WC, WB);
        if (!all_open)
            continue;
        for (uint32_t i = 0; i < n; i++)
            if (v[i].usable)
                CHECKF(finish(v, n, (uint32_t)got, bytes) <= finish(v, n, i, bytes),
                       "round %d: path %u finishes before the pick %d", round, i, got);
    }
}

int main(void)
{
    double t0 = test_now_s();
    test_earliest_finish();
    test_window_and_slow_path();
    test_prior_and_remeasure();
    test_competing_traffic();
    test_hedge();
    test_random();
    return test_report("test_policy", t0);
}
