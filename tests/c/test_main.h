/* test_main.h: the few helpers the C-level tests share.
 *
 * Each test binary is one file that includes this header, calls CHECK* as it
 * goes and ends main with `return test_report("name");`.  A failed check
 * prints where and why and the run goes on, so one run shows every failure;
 * the binary then exits 1.  Sanitizer reports abort on their own
 * (-fno-sanitize-recover=all), which make also counts as a failure.
 */
#ifndef KVL_TEST_MAIN_H
#define KVL_TEST_MAIN_H

#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

/* Atomic so tests may check from several threads. */
static unsigned long test_checks;
static unsigned long test_failures;

/* Stop printing after this many failures: a broken invariant inside a
 * randomised loop would otherwise print thousands of identical lines. */
#define TEST_MAX_PRINTED 50

static inline int test_check(int ok, const char *file, int line, const char *expr)
{
    __atomic_fetch_add(&test_checks, 1, __ATOMIC_RELAXED);
    if (ok)
        return 1;
    fflush(stdout); /* keep progress lines and failures in order when piped */
    if (__atomic_add_fetch(&test_failures, 1, __ATOMIC_RELAXED) <= TEST_MAX_PRINTED)
        fprintf(stderr, "%s:%d: check failed: %s\n", file, line, expr);
    return 0;
}

/* CHECK(cond) and CHECKF(cond, fmt, ...) evaluate to whether cond held, so a
 * caller can skip work that depends on it: if (!CHECK(p)) continue; */
#define CHECK(cond) test_check(!!(cond), __FILE__, __LINE__, #cond)
#define CHECKF(cond, ...)                                                                 \
    (test_check(!!(cond), __FILE__, __LINE__, #cond) ||                                   \
     (test_failures <= TEST_MAX_PRINTED && (fprintf(stderr, "    "),                      \
                                            fprintf(stderr, __VA_ARGS__),                 \
                                            fprintf(stderr, "\n"), 0)))
#define CHECK_EQ_U64(a, b)                                                                \
    CHECKF((uint64_t)(a) == (uint64_t)(b), "%s = %" PRIu64 " (0x%" PRIx64 "), expected %" \
           PRIu64 " (0x%" PRIx64 ")", #a, (uint64_t)(a), (uint64_t)(a), (uint64_t)(b),    \
           (uint64_t)(b))

/* splitmix64: tiny, seedable, good enough to drive randomised tests.  Every
 * test seeds it with a fixed constant so a failure reproduces exactly. */
typedef struct test_rng {
    uint64_t s;
} test_rng;

static inline uint64_t rng_u64(test_rng *r)
{
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Uniform in [lo, hi] (inclusive); the modulo bias is irrelevant here. */
static inline uint64_t rng_range(test_rng *r, uint64_t lo, uint64_t hi)
{
    uint64_t span = hi - lo + 1;
    return span ? lo + rng_u64(r) % span : rng_u64(r);
}

static inline void rng_fill(test_rng *r, void *dst, size_t n)
{
    uint8_t *p = dst;
    while (n) {
        uint64_t v = rng_u64(r);
        for (int i = 0; i < 8 && n; i++, n--)
            *p++ = (uint8_t)(v >> (8 * i));
    }
}

static inline double test_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Prints the summary line and gives main's exit status. */
static inline int test_report(const char *name, double t0)
{
    if (test_failures > TEST_MAX_PRINTED)
        fprintf(stderr, "... %lu more failures not shown\n", test_failures - TEST_MAX_PRINTED);
    printf("%s: %lu checks, %lu failed (%.2f s)\n", name, test_checks, test_failures,
           test_now_s() - t0);
    return test_failures ? 1 : 0;
}

#endif
