/* iopool.c: the TCP transport's I/O threads (Config.io_threads).
 *
 * With io_threads > 0 the bulk of the data path runs on a pool of threads:
 * every payload byte sent or received, and its crc32c.  The engine thread
 * keeps everything else -- frame headers and bodies, routing, ownership,
 * scheduling, small frames -- so its decisions keep a single owner.
 *
 * A data endpoint is served by one I/O thread for its life (round robin at
 * creation).  When a chunk frame reaches the head of its send queue, or a
 * payload starts arriving, the engine hands that one frame or payload to
 * the thread as a job and stops watching the socket in that direction; the
 * thread polls the sockets of its jobs, moves bytes while they are ready,
 * and posts the endpoint to the pool's finished list when a job ends
 * (waking the engine through its eventfd).  The engine collects results
 * there (stream.c: tcp_progress) and carries on exactly as if it had moved
 * the bytes itself.
 *
 * Hand-offs are under ep->jmu, which the thread holds for each step (one
 * non-blocking syscall of at most IO_BATCH bytes, and its crc).  Taking it,
 * the engine knows no byte of ep is being placed or sent: that is how a
 * cancel, a revocation (another copy of the chunk takes over its
 * destination) and a close stay synchronous with the engine's decisions.
 * Lock order: io->mu, then ep->jmu; the engine never holds ep->jmu while it
 * takes io->mu or the pool's mu.
 */
#include <errno.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "tcp.h"

#define SCRATCH (256u << 10)   /* drain buffer for payload bytes nobody may receive */

typedef struct kvl_tcp_pool kvl_tcp_pool;
typedef struct kvl_iothread kvl_iothread;

struct kvl_iothread {
    kvl_tcp_pool *pool;
    pthread_t th;
    int started;
    int efd;                   /* wakes the thread: a job came or one was killed */
    pthread_mutex_t mu;        /* eps[], listed, pins */
    pthread_cond_t cv;         /* pins dropped */
    kvl_ep **eps;              /* endpoints with a job, or killed and not yet dropped */
    size_t n, cap;
    uint8_t *scratch;
};

struct kvl_tcp_pool {
    kvl_agent *a;
    kvl_tcp_budget budget;     /* the stream's, across the agent's connections (stream.c) */
    atomic_int stop;
    uint32_t n, next;
    kvl_iothread *t;
    pthread_mutex_t mu;        /* the finished list */
    kvl_ep *done_head, *done_tail;
};

static void wake(int fd)
{
    uint64_t one = 1;
    ssize_t rc = write(fd, &one, sizeof one);
    (void)rc; /* a full counter still wakes */
}

/* Posts ep (its job just finished) for the engine. */
static void post_done(kvl_tcp_pool *pool, kvl_ep *ep)
{
    pthread_mutex_lock(&pool->mu);
    if (!ep->done_queued) {
        ep->done_queued = 1;
        ep->done_next = NULL;
        if (pool->done_tail)
            pool->done_tail->done_next = ep;
        else
            pool->done_head = ep;
        pool->done_tail = ep;
    }
    pthread_mutex_unlock(&pool->mu);
    wake(pool->a->wakefd);
}

/* One round over ep: as much as the socket takes or gives without blocking. */
static void serve(kvl_iothread *t, kvl_ep *ep, short revents)
{
    int finished = 0;
    pthread_mutex_lock(&ep->jmu);
    if (!ep->killed && ep->rx_job && (revents & (POLLIN | POLLHUP | POLLERR)) &&
        kvl_tcp_rx_step(ep, t->scratch, SCRATCH)) {
        ep->rx_job = 0;
        ep->rx_fin = 1;
        finished = 1;
    }
    if (!ep->killed && ep->tx_job && (revents & (POLLOUT | POLLHUP | POLLERR)) &&
        kvl_tcp_tx_step(ep)) {
        ep->tx_job = 0;
        ep->tx_fin = 1;
        finished = 1;
    }
    pthread_mutex_unlock(&ep->jmu);
    if (finished)
        post_done(t->pool, ep);
}

static void *io_main(void *arg)
{
    kvl_iothread *t = arg;
    kvl_tcp_pool *pool = t->pool;
    char name[16];
    snprintf(name, sizeof name, "kvl-io%u", (unsigned)(t - pool->t));
    pthread_setname_np(pthread_self(), name);
    struct pollfd *fds = NULL;
    kvl_ep **eps = NULL;
    size_t cap = 0;
    while (!atomic_load(&pool->stop)) {
        /* drop what needs us no more; pin the rest while we poll them */
        pthread_mutex_lock(&t->mu);
        size_t n = 0;
        for (size_t i = 0; i < t->n; i++) {
            kvl_ep *ep = t->eps[i];
            pthread_mutex_lock(&ep->jmu);
            int keep = !ep->killed && (ep->rx_job || ep->tx_job);
            short want = (short)((ep->rx_job ? POLLIN : 0) | (ep->tx_job ? POLLOUT : 0));
            int fd = ep->fd;
            pthread_mutex_unlock(&ep->jmu);
            if (!keep) {
                ep->listed = 0;
                t->eps[i--] = t->eps[--t->n];
                continue;
            }
            if (n == cap) {
                size_t nc = cap ? 2 * cap : 16;
                struct pollfd *nf = realloc(fds, (nc + 1) * sizeof *nf);
                if (nf)
                    fds = nf;
                kvl_ep **ne = nf ? realloc(eps, nc * sizeof *ne) : NULL;
                if (!ne)
                    break; /* out of memory: serve those we have this round */
                eps = ne;
                cap = nc;
            }
            ep->pins++;
            eps[n] = ep;
            fds[n].fd = fd;
            fds[n].events = want;
            fds[n++].revents = 0;
        }
        pthread_cond_broadcast(&t->cv);
        pthread_mutex_unlock(&t->mu);
        if (!fds && !(fds = malloc(sizeof *fds)))
            continue;
        fds[n].fd = t->efd;
        fds[n].events = POLLIN;
        fds[n].revents = 0;
        int r = poll(fds, n + 1, -1); /* a job, a kill and stop all come with a wakeup */
        if (r > 0 && fds[n].revents) {
            uint64_t v;
            ssize_t rc = read(t->efd, &v, sizeof v);
            (void)rc;
        }
        for (size_t i = 0; i < n; i++)
            if (r > 0 && fds[i].revents)
                serve(t, eps[i], fds[i].revents);
        pthread_mutex_lock(&t->mu);
        for (size_t i = 0; i < n; i++)
            eps[i]->pins--;
        pthread_cond_broadcast(&t->cv);
        pthread_mutex_unlock(&t->mu);
    }
    free(fds);
    free(eps);
    return NULL;
}

static kvl_tcp_pool *pool_of(kvl_agent *a) { return (kvl_tcp_pool *)a->tp_state; }

kvl_tcp_budget *kvl_tcp_budget_of(kvl_agent *a)
{
    kvl_tcp_pool *pool = pool_of(a);
    return pool ? &pool->budget : NULL;
}

/* The pool exists with no thread too: it holds the stream's budgets. */
kvl_err kvl_tcp_pool_start(kvl_agent *a, uint32_t n)
{
    kvl_tcp_pool *pool = calloc(1, sizeof *pool);
    if (!pool || (n && !(pool->t = calloc(n, sizeof *pool->t)))) {
        free(pool);
        return kvl_fail(KVL_ERR_NOMEM, "agent_create: out of memory for %u I/O threads", n);
    }
    kvl_tcp_budget_init(&pool->budget);
    pool->a = a;
    pool->n = n;
    pthread_mutex_init(&pool->mu, NULL);
    a->tp_state = pool;
    for (uint32_t i = 0; i < n; i++) {
        kvl_iothread *t = &pool->t[i];
        t->pool = pool;
        t->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        pthread_mutex_init(&t->mu, NULL);
        kvl_cond_init(&t->cv);
        t->scratch = malloc(SCRATCH);
        if (t->efd < 0 || !t->scratch || pthread_create(&t->th, NULL, io_main, t) != 0) {
            kvl_tcp_pool_stop(a);
            return kvl_fail(KVL_ERR_SYSTEM, "agent_create: cannot start I/O thread %u of %u",
                            i + 1, n);
        }
        t->started = 1;
    }
    return KVL_OK;
}

void kvl_tcp_pool_stop(kvl_agent *a)
{
    kvl_tcp_pool *pool = pool_of(a);
    if (!pool)
        return;
    atomic_store(&pool->stop, 1);
    for (uint32_t i = 0; i < pool->n; i++) {
        kvl_iothread *t = &pool->t[i];
        if (t->started) {
            wake(t->efd);
            pthread_join(t->th, NULL);
        }
        if (t->efd >= 0)
            close(t->efd);
        free(t->eps);
        free(t->scratch);
        pthread_mutex_destroy(&t->mu);
        pthread_cond_destroy(&t->cv);
    }
    pthread_mutex_destroy(&pool->mu);
    free(pool->t);
    free(pool);
    a->tp_state = NULL;
}

kvl_iothread *kvl_tcp_pool_pick(kvl_agent *a)
{
    kvl_tcp_pool *pool = pool_of(a);
    if (!pool || !pool->n)
        return NULL;
    return &pool->t[pool->next++ % pool->n];
}

void kvl_tcp_job_start(kvl_ep *ep, int tx)
{
    kvl_iothread *t = ep->io;
    pthread_mutex_lock(&ep->jmu);
    if (tx)
        ep->tx_job = 1;
    else
        ep->rx_job = 1;
    pthread_mutex_unlock(&ep->jmu);
    int ok = 1;
    pthread_mutex_lock(&t->mu);
    if (!ep->listed) {
        if (t->n == t->cap) {
            size_t nc = t->cap ? 2 * t->cap : 16;
            kvl_ep **ne = realloc(t->eps, nc * sizeof *ne);
            if (ne) {
                t->eps = ne;
                t->cap = nc;
            }
        }
        if (t->n < t->cap) {
            t->eps[t->n++] = ep;
            ep->listed = 1;
        } else {
            ok = 0;
        }
    }
    pthread_mutex_unlock(&t->mu);
    if (!ok) { /* out of memory: the job ends failed at once */
        pthread_mutex_lock(&ep->jmu);
        if (tx) {
            ep->tx_job = 0;
            ep->tx_fin = 1;
            ep->tx_err = ENOMEM;
        } else {
            ep->rx_job = 0;
            ep->rx_fin = 1;
            ep->rx_err = ENOMEM;
        }
        pthread_mutex_unlock(&ep->jmu);
        post_done(t->pool, ep);
        return;
    }
    wake(t->efd);
}

void kvl_tcp_job_kill(kvl_ep *ep)
{
    if (!ep->io)
        return;
    pthread_mutex_lock(&ep->jmu); /* waits out a step in progress */
    ep->killed = 1;
    ep->rx_job = ep->tx_job = 0;
    pthread_mutex_unlock(&ep->jmu);
    wake(ep->io->efd);
}

void kvl_tcp_job_forget(kvl_ep *ep)
{
    kvl_iothread *t = ep->io;
    if (!t)
        return;
    kvl_tcp_job_kill(ep);
    pthread_mutex_lock(&t->mu);
    while (ep->pins)
        pthread_cond_wait(&t->cv, &t->mu); /* one poll round at most: it was woken */
    if (ep->listed) {
        for (size_t i = 0; i < t->n; i++)
            if (t->eps[i] == ep) {
                t->eps[i] = t->eps[--t->n];
                break;
            }
        ep->listed = 0;
    }
    pthread_mutex_unlock(&t->mu);
    kvl_tcp_pool *pool = t->pool;
    pthread_mutex_lock(&pool->mu);
    if (ep->done_queued) {
        kvl_ep *prev = NULL;
        for (kvl_ep *e = pool->done_head; e; prev = e, e = e->done_next)
            if (e == ep) {
                if (prev)
                    prev->done_next = ep->done_next;
                else
                    pool->done_head = ep->done_next;
                if (pool->done_tail == ep)
                    pool->done_tail = prev;
                break;
            }
        ep->done_queued = 0;
    }
    pthread_mutex_unlock(&pool->mu);
}

kvl_ep *kvl_tcp_pool_next_done(kvl_agent *a)
{
    kvl_tcp_pool *pool = pool_of(a);
    if (!pool || !pool->n)
        return NULL;
    pthread_mutex_lock(&pool->mu);
    kvl_ep *ep = pool->done_head;
    if (ep) {
        pool->done_head = ep->done_next;
        if (!pool->done_head)
            pool->done_tail = NULL;
        ep->done_queued = 0;
        ep->done_next = NULL;
    }
    pthread_mutex_unlock(&pool->mu);
    return ep;
}
