/* loop.c: the engine thread's reactor.
 *
 * One engine thread per agent owns every socket, the schedulers and the
 * in-flight state.  Callers talk to it through a command queue (woken by an
 * eventfd) and read results from per-transfer and per-agent queues guarded
 * by their own mutexes; the engine never calls back into Python.  This file
 * knows descriptors, the command queue and time; what a command, a tick or
 * the end of an iteration means is the agent's (agent.c registers
 * kvl_loop_hooks), so the modules that post commands or watch descriptors
 * call down into it and nothing here calls up into them.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

void kvl_engine_post(kvl_agent *a, kvl_cmd *cmd)
{
    cmd->next = NULL;
    pthread_mutex_lock(&a->mu);
    if (a->cmd_tail)
        a->cmd_tail->next = cmd;
    else
        a->cmd_head = cmd;
    a->cmd_tail = cmd;
    pthread_mutex_unlock(&a->mu);
    uint64_t one = 1;
    ssize_t rc = write(a->wakefd, &one, sizeof one);
    (void)rc; /* a full eventfd counter still wakes the engine */
}

/* ---- the event loop's registrations (the transport's descriptors) ---- */

int kvl_engine_watch(kvl_agent *a, int fd, void *ptr, uint32_t events)
{
    struct epoll_event ev = {.events = events, .data.ptr = ptr};
    return epoll_ctl(a->epfd, EPOLL_CTL_ADD, fd, &ev);
}

int kvl_engine_rewatch(kvl_agent *a, int fd, void *ptr, uint32_t events)
{
    struct epoll_event ev = {.events = events, .data.ptr = ptr};
    return epoll_ctl(a->epfd, EPOLL_CTL_MOD, fd, &ev);
}

void kvl_engine_unwatch(kvl_agent *a, int fd) { epoll_ctl(a->epfd, EPOLL_CTL_DEL, fd, NULL); }

uint8_t *kvl_engine_scratch(kvl_agent *a, size_t *len)
{
    *len = a->scratch_len;
    return a->scratch;
}

/* The engine thread: epoll on every descriptor and the eventfd, the tick,
 * and at the end of each iteration the agent's own work (hooks). */
void *kvl_loop_main(void *arg)
{
    kvl_agent *a = arg;
    const kvl_loop_hooks *h = a->hooks;
    struct epoll_event evs[64];
    uint64_t interval = (uint64_t)a->cfg.monitor_interval_ms * 1000000ull;
    /* Named for top -H / py-spy; the name is also how tests find this thread. */
    pthread_setname_np(pthread_self(), "kvl-engine");
    a->next_tick_ns = kvl_now_ns() + interval;
    while (!atomic_load(&a->stopping)) {
        if (atomic_load(&a->closing) && h->may_stop(a, kvl_now_ns()))
            break;
        uint64_t now = kvl_now_ns();
        uint64_t next = a->next_stall_ns < a->next_tick_ns ? a->next_stall_ns : a->next_tick_ns;
        int timeout = now >= next ? 0 : (int)((next - now) / 1000000 + 1);
        int n = epoll_wait(a->epfd, evs, 64, timeout);
        for (int i = 0; i < n; i++) {
            if (evs[i].data.ptr == NULL) {
                uint64_t v;
                ssize_t rc = read(a->wakefd, &v, sizeof v);
                (void)rc;
                pthread_mutex_lock(&a->mu);
                kvl_cmd *cmd = a->cmd_head;
                a->cmd_head = a->cmd_tail = NULL;
                pthread_mutex_unlock(&a->mu);
                h->commands(a, cmd);
                a->stream->progress(a);
            } else {
                a->stream->on_event(evs[i].data.ptr, evs[i].events);
            }
        }
        now = kvl_now_ns();
        if (now >= a->next_stall_ns) {
            h->stall_check(a, now);
            a->next_stall_ns = now + interval / 4;
        }
        if (now >= a->next_tick_ns) {
            h->tick(a, now);
            for (size_t i = 0; i < a->n_addrs; i++)
                a->stream->tick(a->listeners[i], now);
            a->next_tick_ns = now + interval;
        }
        h->iteration_end(a, now);
        /* The quarter-tick stall check runs only while it has work: an idle agent
         * wakes once a tick, not four times (idle CPU of a loaded vLLM connector). */
        if (!h->busy(a))
            a->next_stall_ns = UINT64_MAX;
        else if (a->next_stall_ns == UINT64_MAX)
            a->next_stall_ns = now + interval / 4;
    }
    return NULL;
}
