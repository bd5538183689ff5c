/* monitor.h: the per-tick path monitor (monitor.c). */
#ifndef KVLINK_MONITOR_H_
#define KVLINK_MONITOR_H_

#include "base.h"

/* ---- monitor.c: the per-tick path monitor ---- */
void kvl_monitor_init(kvl_agent *a);
void kvl_monitor_tick(kvl_agent *a, uint64_t now);
/* The stall check, run every quarter tick while a path is busy. */
void kvl_monitor_stall_check(kvl_agent *a, uint64_t now);
/* 1 while some path has chunks in flight or is STALLED (the stall check has
 * work), else 0: an idle engine then wakes only for its tick. */
int kvl_monitor_any_busy(const kvl_agent *a);
/* Sends a PING on every idle, up data path of p (pre-warm). */
void kvl_monitor_probe_all(kvl_peer *p, uint64_t now);
/* A PONG came back on an outbound data connection. */
void kvl_monitor_on_pong(kvl_peer *p, int path, uint64_t sent_ns, uint64_t now);

#endif
