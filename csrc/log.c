/* log.c: what the engine has to say, for the application's logger.
 *
 * C never calls Python, so records go into a bounded ring (LOG_MAX) that a
 * Python thread drains with kvl_next_log and hands to the "kvlink" logger.
 * A full ring drops the oldest record and counts it; the next record taken
 * says how many were lost.  Any thread may log; the ring is under log_mu.
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

#define LOG_LIMIT_PER_S 10 /* records a peer's misbehaviour may cause a second */

void kvl_log(kvl_agent *a, int level, const char *peer, int path, const char *fmt, ...)
{
    kvl_log_record r = {.level = (uint32_t)level, .path = path, .t_ns = kvl_now_ns()};
    snprintf(r.peer, sizeof r.peer, "%s", peer ? peer : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r.msg, sizeof r.msg, fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&a->log_mu);
    if (a->log_count == KVL_LOG_MAX) { /* nobody drains: the oldest goes */
        a->log_head = (a->log_head + 1) % KVL_LOG_MAX;
        a->log_count--;
        a->log_dropped++;
    }
    a->log_ring[(a->log_head + a->log_count) % KVL_LOG_MAX] = r;
    a->log_count++;
    pthread_cond_signal(&a->log_cv);
    pthread_mutex_unlock(&a->log_mu);
}

void kvl_log_limited(kvl_agent *a, int level, const char *peer, const char *fmt, ...)
{
    uint64_t now = kvl_now_ns();
    if (now - a->loglim_t_ns > 1000000000ull) { /* a new one-second window */
        if (a->loglim_dropped)
            kvl_log(a, level, NULL, -1, "%u more records like the ones above were not logged",
                    a->loglim_dropped);
        a->loglim_t_ns = now;
        a->loglim_n = a->loglim_dropped = 0;
    }
    if (a->loglim_n >= LOG_LIMIT_PER_S) {
        a->loglim_dropped++;
        return;
    }
    a->loglim_n++;
    char msg[sizeof ((kvl_log_record *)0)->msg];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    kvl_log(a, level, peer, -1, "%s", msg);
}

kvl_err kvl_next_log(kvl_agent *a, uint32_t timeout_ms, kvl_log_record *out)
{
    kvl_clear_error();
    struct timespec ts = kvl_deadline_ts(timeout_ms);
    pthread_mutex_lock(&a->log_mu);
    int rc = 0;
    while (!a->log_count && !a->log_woken && rc == 0)
        rc = pthread_cond_timedwait(&a->log_cv, &a->log_mu, &ts);
    kvl_err e = KVL_OK;
    if (a->log_count) {
        *out = a->log_ring[a->log_head];
        out->dropped = a->log_dropped;
        a->log_dropped = 0;
        a->log_head = (a->log_head + 1) % KVL_LOG_MAX;
        a->log_count--;
    } else if (a->log_woken) {
        e = KVL_ERR_CLOSED;
    } else {
        e = KVL_ERR_TIMEOUT;
    }
    pthread_mutex_unlock(&a->log_mu);
    if (e == KVL_ERR_CLOSED)
        return kvl_fail(e, "the agent is closing");
    if (e == KVL_ERR_TIMEOUT)
        return kvl_fail(e, "no log record within %u ms", timeout_ms);
    return KVL_OK;
}

void kvl_log_wake(kvl_agent *a)
{
    pthread_mutex_lock(&a->log_mu);
    a->log_woken = 1;
    pthread_cond_broadcast(&a->log_cv);
    pthread_mutex_unlock(&a->log_mu);
}
