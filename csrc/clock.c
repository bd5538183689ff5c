/* clock.c: the monotonic clock every deadline and rate in the core uses, and
 * the condition variables and timed waits that run on it. */
#include <errno.h>
#include <time.h>

#include "internal.h"

uint64_t kvl_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

struct timespec kvl_deadline_ts(uint32_t timeout_ms)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_sec += timeout_ms / 1000;
    ts.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    return ts;
}

void kvl_cond_init(pthread_cond_t *cv)
{
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(cv, &ca);
    pthread_condattr_destroy(&ca);
}

int kvl_cond_wait_until(pthread_cond_t *cv, pthread_mutex_t *mu, int (*pred)(void *, uint32_t),
                        void *obj, uint32_t arg, uint32_t timeout_ms)
{
    struct timespec ts = kvl_deadline_ts(timeout_ms);
    while (!pred(obj, arg))
        if (pthread_cond_timedwait(cv, mu, &ts) == ETIMEDOUT)
            return pred(obj, arg) ? 0 : -1;
    return 0;
}
