/* snapshot.h: the path snapshots callers read (snapshot.c). */
#ifndef KVLINK_SNAPSHOT_H
#define KVLINK_SNAPSHOT_H

typedef struct kvl_agent kvl_agent;

/* Engine thread: publishes every path's state for kvl_paths and wakes
 * kvl_paths_wait when a state or the set of paths changed. */
void kvl_engine_snapshot_paths(kvl_agent *a);
/* Engine thread: publishes the inbound counters for kvl_inbound_stats_get. */
void kvl_engine_snapshot_inbound(kvl_agent *a);

#endif
