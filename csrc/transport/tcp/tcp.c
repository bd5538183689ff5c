/* tcp.c: the native TCP transport's sockets: listen, connect, the options
 * every data-path socket needs, TCP_INFO samples and the blocking helpers of
 * the handshake.  The byte stream of a connection is stream.c.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <linux/tcp.h> /* struct tcp_info with bytes_acked and delivery_rate */
#include <poll.h>
#include <stdlib.h>
#include <sys/epoll.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "tcp.h"

/* Give up on a connection whose sent data stays unacknowledged this long:
 * a TCP sender never errors by itself while a link is down. */
#define USER_TIMEOUT_MS 5000

kvl_err kvl_sock_nonblock(int fd, int on)
{
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, on ? fl | O_NONBLOCK : fl & ~O_NONBLOCK) < 0)
        return kvl_fail_errno("fcntl(O_NONBLOCK)");
    return KVL_OK;
}

static kvl_err parse_addr(const char *host, uint16_t port, struct sockaddr_in *sa)
{
    memset(sa, 0, sizeof *sa);
    sa->sin_family = AF_INET;
    sa->sin_port = htons(port);
    if (inet_pton(AF_INET, host, &sa->sin_addr) != 1)
        return kvl_fail(KVL_ERR_INVALID_ARG, "'%s' is not an IPv4 address", host);
    return KVL_OK;
}

kvl_err kvl_tcp_tune(int fd, int sock_buf)
{
    int one = 1;
    /* acks and small control frames must not wait for Nagle */
    if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) < 0)
        return kvl_fail_errno("setsockopt(TCP_NODELAY)");
    if (setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one) < 0)
        return kvl_fail_errno("setsockopt(SO_KEEPALIVE)");
    int idle = 2, intvl = 1, cnt = 3;
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
    unsigned ut = USER_TIMEOUT_MS;
    setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &ut, sizeof ut);
    if (sock_buf > 0) {
        /* fixed buffers switch kernel autotuning off: only when asked */
        setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sock_buf, sizeof sock_buf);
        setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &sock_buf, sizeof sock_buf);
    }
    return KVL_OK;
}

kvl_err kvl_tcp_listen(kvl_agent *a, const char *host, uint16_t *port, kvl_ep **out)
{
    struct sockaddr_in sa;
    kvl_err e = parse_addr(host, *port, &sa);
    if (e)
        return e;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return kvl_fail_errno("socket");
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, (struct sockaddr *)&sa, sizeof sa) < 0) {
        int er = errno;
        close(fd);
        return kvl_fail(KVL_ERR_SYSTEM,
                        "cannot listen on %s:%u: %s (is the address configured on a local "
                        "interface and the port free?)",
                        host, *port, strerror(er));
    }
    if (listen(fd, 128) < 0) {
        close(fd);
        return kvl_fail_errno("listen");
    }
    socklen_t sl = sizeof sa;
    getsockname(fd, (struct sockaddr *)&sa, &sl);
    *port = ntohs(sa.sin_port);
    kvl_ep *ep = kvl_tcp_ep_new(a, fd, 1);
    if (!ep || kvl_engine_watch(a, fd, ep, EPOLLIN) != 0) {
        if (ep)
            ep->fd = -1;
        kvl_tcp_ep_free(ep);
        close(fd);
        return kvl_fail(KVL_ERR_NOMEM, "cannot watch the listener on %s:%u", host, *port);
    }
    ep->watched = 1;
    *out = ep;
    return KVL_OK;
}

static kvl_err connect_fd(const char *local, const char *remote, uint16_t port,
                          uint32_t timeout_ms, int sock_buf, int *out)
{
    struct sockaddr_in la, ra;
    kvl_err e = parse_addr(local, 0, &la);
    if (!e)
        e = parse_addr(remote, port, &ra);
    if (e)
        return e;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return kvl_fail_errno("socket");
    /* binding the source address makes the path leave through the NIC that
     * owns it (with rail-aligned subnets the route table agrees) */
    if (bind(fd, (struct sockaddr *)&la, sizeof la) < 0) {
        int er = errno;
        close(fd);
        return kvl_fail(KVL_ERR_SYSTEM, "cannot bind source address %s: %s", local,
                        strerror(er));
    }
    if ((e = kvl_tcp_tune(fd, sock_buf))) {
        close(fd);
        return e;
    }
    int rc = connect(fd, (struct sockaddr *)&ra, sizeof ra);
    if (rc < 0 && errno != EINPROGRESS) {
        int er = errno;
        close(fd);
        return kvl_fail(KVL_ERR_UNREACHABLE, "connect %s -> %s:%u: %s", local, remote, port,
                        strerror(er));
    }
    if (rc < 0) {
        struct pollfd pfd = {.fd = fd, .events = POLLOUT};
        int n;
        do
            n = poll(&pfd, 1, (int)timeout_ms);
        while (n < 0 && errno == EINTR);
        int soerr = 0;
        socklen_t sl = sizeof soerr;
        if (n == 0) {
            close(fd);
            return kvl_fail(KVL_ERR_UNREACHABLE, "connect %s -> %s:%u: no answer within %u ms",
                            local, remote, port, timeout_ms);
        }
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl);
        if (n < 0 || soerr) {
            close(fd);
            return kvl_fail(KVL_ERR_UNREACHABLE, "connect %s -> %s:%u: %s", local, remote,
                            port, strerror(n < 0 ? errno : soerr));
        }
    }
    if ((e = kvl_sock_nonblock(fd, 0))) {
        close(fd);
        return e;
    }
    *out = fd;
    return KVL_OK;
}

kvl_err kvl_tcp_connect(kvl_agent *a, const char *local, const char *host, uint16_t port,
                        uint32_t timeout_ms, kvl_ep **out)
{
    int fd = -1;
    kvl_err e = connect_fd(local, host, port, timeout_ms, a->cfg.sock_buf_bytes, &fd);
    if (e)
        return e;
    kvl_ep *ep = kvl_tcp_ep_new(a, fd, 0);
    if (!ep) {
        close(fd);
        return kvl_fail(KVL_ERR_NOMEM, "connect: out of memory");
    }
    *out = ep;
    return KVL_OK;
}

int kvl_tcp_sample(int fd, kvl_tp_sample *out)
{
    struct tcp_info ti;
    socklen_t sl = sizeof ti;
    memset(&ti, 0, sizeof ti);
    if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &sl) < 0)
        return -1;
    out->rtt_us = (double)ti.tcpi_rtt;
    out->delivery_Bps = (double)ti.tcpi_delivery_rate;
    out->bytes_acked = ti.tcpi_bytes_acked;
    out->bytes_received = ti.tcpi_bytes_received;
    out->last_ack_recv_ms = ti.tcpi_last_ack_recv;
    out->last_data_recv_ms = ti.tcpi_last_data_recv;
    out->app_limited = ti.tcpi_delivery_rate_app_limited;
    return 0;
}

void kvl_tcp_abort(int fd)
{
    /* linger 0: close with RST, dropping what is still queued both ways */
    struct linger lg = {.l_onoff = 1, .l_linger = 0};
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
}

static int wait_fd(int fd, short ev, uint64_t deadline_ns)
{
    for (;;) {
        uint64_t now = kvl_now_ns();
        if (now >= deadline_ns)
            return 0;
        struct pollfd pfd = {.fd = fd, .events = ev};
        int n = poll(&pfd, 1, (int)((deadline_ns - now) / 1000000 + 1));
        if (n > 0)
            return 1;
        if (n < 0 && errno != EINTR)
            return -1;
    }
}

kvl_err kvl_tcp_send_all(kvl_ep *ep, const void *buf, size_t len, uint64_t deadline_ns)
{
    int fd = ep->fd;
    const uint8_t *p = buf;
    while (len) {
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
            p += n;
            len -= (size_t)n;
            continue;
        }
        if (n < 0 && errno != EAGAIN && errno != EINTR)
            return kvl_fail(KVL_ERR_UNREACHABLE, "send: %s", strerror(errno));
        if (wait_fd(fd, POLLOUT, deadline_ns) <= 0)
            return kvl_fail(KVL_ERR_TIMEOUT, "send: timed out");
    }
    return KVL_OK;
}

kvl_err kvl_tcp_recv_all(kvl_ep *ep, void *buf, size_t len, uint64_t deadline_ns)
{
    int fd = ep->fd;
    uint8_t *p = buf;
    while (len) {
        ssize_t n = recv(fd, p, len, MSG_DONTWAIT);
        if (n > 0) {
            p += n;
            len -= (size_t)n;
            continue;
        }
        if (n == 0)
            return kvl_fail(KVL_ERR_UNREACHABLE, "connection closed by the peer");
        if (errno != EAGAIN && errno != EINTR)
            return kvl_fail(KVL_ERR_UNREACHABLE, "recv: %s", strerror(errno));
        if (wait_fd(fd, POLLIN, deadline_ns) <= 0)
            return kvl_fail(KVL_ERR_TIMEOUT, "recv: timed out");
    }
    return KVL_OK;
}
