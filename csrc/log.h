/* log.h: log records for the application (log.c). */
#ifndef KVLINK_LOG_H_
#define KVLINK_LOG_H_

#include "base.h"

/* ---- log.c ---- */
/* Queues a record for the application's logger (any thread).  path -1: none. */
void kvl_log(kvl_agent *a, int level, const char *peer, int path, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

/* Engine thread: kvl_log for what a peer's frames cause (refused
 * handshakes, wrong keys): at most 10 records a second, then a count. */
void kvl_log_limited(kvl_agent *a, int level, const char *peer, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#endif
