/* scheduler.h: dispatch, retry, failover, hedging (sched.c). */
#ifndef KVLINK_SCHEDULER_H_
#define KVLINK_SCHEDULER_H_

#include "base.h"

/* ---- sched.c: dispatch and path scoring ---- */
void kvl_sched_dispatch(kvl_peer *p);
/* Chunk ci verified; path delivered the winning copy. */
void kvl_sched_on_chunk_done(kvl_peer *p, kvl_xfer *x, uint32_t ci, uint32_t path, uint64_t now);
/* A chunk failed on its path (checksum, or the path went down): requeue it
 * or fail the transfer when it ran out of attempts. */
void kvl_sched_requeue(kvl_peer *p, kvl_xfer *x, uint32_t ci, kvl_err err, const char *why);
void kvl_sched_path_down(kvl_peer *p, uint32_t path, const char *why);
/* The copy (path, attempt) of chunk ci was drained because a newer copy
 * took the chunk over: the newer copy carries on if it is still in flight,
 * else the chunk is sent again (not counted as a failure). */
void kvl_sched_superseded(kvl_peer *p, kvl_xfer *x, uint32_t ci, uint32_t path,
                          uint32_t attempt);
/* Path went silent while busy: its copies are cancelled in the stream and
 * re-queued (not counted as failures); the connection stays, the path gets
 * no chunks until it moves again (monitor.c). */
void kvl_sched_path_stalled(kvl_peer *p, uint32_t path, const char *why);
/* After a path of p changed or a transfer joined it: with every path down
 * (DOWN or PROBING) its running transfers wait for one to come back, each
 * until its deadline (kvl_sched_expire fails it then, naming each path's
 * reason); the start of such a wait is logged (at most once a second per
 * peer) and so is its end when a path is back; p->n_waiting counts them for
 * paths().  A peer that is gone (kvl_sched_peer_gone) fails them now. */
void kvl_sched_check_reachable(kvl_peer *p);
/* A reconnect of pa met instance met of p's name, not p's: the peer
 * restarted and nothing of p comes back.  Its transfers fail, submit
 * refuses, and both say to add the peer again (once; engine thread). */
void kvl_sched_peer_gone(kvl_peer *p, const kvl_path *pa, uint64_t met);
/* Fails a running transfer from the engine: drops its chunks' in-flight
 * accounting, records the error and wakes waiters. */
void kvl_sched_fail(kvl_xfer *x, kvl_err err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Every tick: transfers past their deadline fail (CONN_LOST with each
 * path's reason when every path is down, else DEADLINE). */
void kvl_sched_expire(kvl_agent *a, uint64_t now);
/* Releases finished transfers' resources once no I/O touches them.  Runs at
 * the end of each engine iteration, so handlers never see a freed transfer. */
void kvl_sched_reap(kvl_agent *a);
kvl_xfer *kvl_sched_find_xfer(kvl_peer *p, uint64_t id);

#endif
