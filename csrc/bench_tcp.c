/* bench_tcp.c: the plain-TCP baseline of `kvlink-bench tcp-limit`
 * (kvlink/bench/tcp_limit.py).
 *
 * What N TCP connections between two processes move when nothing else is
 * done: one thread per connection, each sending (or receiving) its own slice
 * of one pre-faulted buffer with blocking send/recv of the whole slice -- no
 * framing, no checksum, no event loop.  kvlink's TCP data path is measured
 * against it in the same run, over the same loopback addresses, with the same
 * memory at both ends.  It lives in the core so the baseline is native code
 * whatever machine runs the benchmark (no compiler needed there).
 */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>

#include "internal.h"

typedef struct mover {
    int fd, send;
    uint8_t *p;
    uint64_t len;
    uint64_t t0_ns, t1_ns, cpu_ns;
    int err;               /* errno; -1: the peer closed early */
    pthread_t th;
} mover;

static uint64_t mono_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static int move_all(int fd, uint8_t *p, uint64_t len, int send_side)
{
    while (len) {
        ssize_t n = send_side ? send(fd, p, len, MSG_NOSIGNAL) : recv(fd, p, len, 0);
        if (n == 0)
            return -1;
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        p += n;
        len -= (uint64_t)n;
    }
    return 0;
}

static void *mover_main(void *arg)
{
    mover *m = arg;
    uint8_t ack = 1;
    pthread_setname_np(pthread_self(), "kvl-tcp-limit"); /* for perf and top */
    m->t0_ns = mono_ns();
    m->err = move_all(m->fd, m->p, m->len, m->send);
    /* the sender's clock stops when the receiver has every byte: its one-byte answer */
    if (!m->err)
        m->err = move_all(m->fd, &ack, 1, !m->send);
    m->t1_ns = mono_ns();
    struct rusage ru;
    if (getrusage(RUSAGE_THREAD, &ru) == 0)
        m->cpu_ns = ((uint64_t)ru.ru_utime.tv_sec + (uint64_t)ru.ru_stime.tv_sec) * 1000000000u +
                    ((uint64_t)ru.ru_utime.tv_usec + (uint64_t)ru.ru_stime.tv_usec) * 1000u;
    return NULL;
}

kvl_err kvl_bench_tcp_move(const int *fds, uint32_t n, void *buf, uint64_t len, int send_side,
                           uint32_t timeout_ms, kvl_bench_tcp_result *out)
{
    if (!fds || !n || n > 1024 || (!buf && len) || !out)
        return kvl_fail(KVL_ERR_INVALID_ARG, "bench_tcp_move: fds, 1..1024 sockets, buf, out");
    mover *m = calloc(n, sizeof *m);
    if (!m)
        return kvl_fail(KVL_ERR_NOMEM, "bench_tcp_move: out of memory");
    struct timeval tv = {.tv_sec = timeout_ms / 1000, .tv_usec = (timeout_ms % 1000) * 1000};
    uint64_t per = len / n;
    kvl_err e = KVL_OK;
    uint32_t started = 0;
    for (uint32_t i = 0; i < n; i++) {
        m[i].fd = fds[i];
        m[i].send = send_side;
        m[i].p = (uint8_t *)buf + per * i;
        m[i].len = i + 1 < n ? per : len - per * i;
        if (setsockopt(fds[i], SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) ||
            setsockopt(fds[i], SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv)) {
            e = kvl_fail_errno("bench_tcp_move: setsockopt(SO_RCVTIMEO/SO_SNDTIMEO)");
            break;
        }
    }
    for (uint32_t i = 0; !e && i < n; i++, started++)
        if (pthread_create(&m[i].th, NULL, mover_main, &m[i]) != 0)
            e = kvl_fail(KVL_ERR_SYSTEM, "bench_tcp_move: cannot start thread %u of %u", i + 1, n);
    uint64_t t0 = UINT64_MAX, t1 = 0, cpu = 0;
    int err = 0;
    for (uint32_t i = 0; i < started; i++) {
        pthread_join(m[i].th, NULL);
        t0 = m[i].t0_ns < t0 ? m[i].t0_ns : t0;
        t1 = m[i].t1_ns > t1 ? m[i].t1_ns : t1;
        cpu += m[i].cpu_ns;
        if (!err)
            err = m[i].err;
    }
    free(m);
    if (e)
        return e;
    if (err == -1)
        return kvl_fail(KVL_ERR_CONN_LOST, "bench_tcp_move: the peer closed a connection early");
    if (err)
        return kvl_fail(KVL_ERR_SYSTEM, "bench_tcp_move: %s: %s", send_side ? "send" : "recv",
                        err == EAGAIN ? "no progress within the timeout" : strerror(err));
    out->wall_ns = t1 - t0;
    out->cpu_ns = cpu;
    out->bytes = len;
    return KVL_OK;
}
