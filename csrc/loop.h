/* loop.h: the engine thread's reactor (loop.c). */
#ifndef KVLINK_LOOP_H
#define KVLINK_LOOP_H

#include <stdint.h>

typedef struct kvl_agent kvl_agent;
typedef struct kvl_cmd kvl_cmd;

/* What the loop runs on the agent's behalf (agent.c fills one at create).
 * Every hook runs on the engine thread. */
typedef struct kvl_loop_hooks {
    /* The eventfd fired: the commands callers queued, in order (the list is
     * the hook's to free). */
    void (*commands)(kvl_agent *a, kvl_cmd *list);
    /* Every monitor_interval_ms. */
    void (*tick)(kvl_agent *a, uint64_t now);
    /* A quarter tick, while busy() says there is work to watch. */
    void (*stall_check)(kvl_agent *a, uint64_t now);
    int (*busy)(const kvl_agent *a);
    /* After every wakeup's events: dispatch, then free what was retired. */
    void (*iteration_end)(kvl_agent *a, uint64_t now);
    /* close() was asked: 1 once the loop may stop (queues drained or the
     * linger is over). */
    int (*may_stop)(kvl_agent *a, uint64_t now);
} kvl_loop_hooks;

/* The engine thread's body (pthread_create's start routine; arg: the agent).
 * Returns when a->stopping is set or a close has drained. */
void *kvl_loop_main(void *arg);

/* Queues a command for the engine thread and wakes it.  Takes cmd over.
 * Any thread; never blocks on the engine. */
void kvl_engine_post(kvl_agent *a, kvl_cmd *cmd);

#endif
