/* sock.c: the relay folder's blocking socket helpers (relay hop, key
 * exchange): every wait has a deadline. */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "relay.h"

void kvl_relay_tune(int fd)
{
    int one = 1, idle = 2, intvl = 1, cnt = 3;
    unsigned ut = 5000;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
    setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &ut, sizeof ut);
}

int kvl_relay_log_ok(atomic_ullong *last)
{
    unsigned long long now = kvl_now_ns(), prev = atomic_load(last);
    return now - prev >= 1000000000ull && atomic_compare_exchange_strong(last, &prev, now);
}

int kvl_relay_dial(const char *local, struct sockaddr_in *to, uint32_t timeout_ms, char *why,
                   size_t why_len)
{
    char dst[48];
    inet_ntop(AF_INET, &to->sin_addr, dst, sizeof dst);
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        snprintf(why, why_len, "socket: %s", strerror(errno));
        return -1;
    }
    struct sockaddr_in la = {.sin_family = AF_INET};
    if (local && (inet_pton(AF_INET, local, &la.sin_addr) != 1 ||
                  bind(fd, (struct sockaddr *)&la, sizeof la) < 0)) {
        snprintf(why, why_len, "cannot bind source address %s: %s", local, strerror(errno));
        close(fd);
        return -1;
    }
    kvl_relay_tune(fd);
    int rc = connect(fd, (struct sockaddr *)to, sizeof *to);
    if (rc < 0 && errno == EINPROGRESS) {
        struct pollfd p = {.fd = fd, .events = POLLOUT};
        int n;
        do
            n = poll(&p, 1, (int)timeout_ms);
        while (n < 0 && errno == EINTR);
        int soerr = 0;
        socklen_t sl = sizeof soerr;
        if (n == 0)
            soerr = ETIMEDOUT;
        else if (n < 0)
            soerr = errno;
        else
            getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl);
        rc = soerr ? -1 : 0;
        errno = soerr;
    }
    if (rc < 0) {
        snprintf(why, why_len, "connect %s -> %s:%u: %s", local ? local : "*", dst,
                 ntohs(to->sin_port),
                 errno == ETIMEDOUT ? "no answer in time" : strerror(errno));
        close(fd);
        return -1;
    }
    return fd;
}

static int wait_io(int fd, short ev, uint64_t deadline_ns, atomic_int *stop)
{
    for (;;) {
        uint64_t now = kvl_now_ns();
        if (now >= deadline_ns || (stop && atomic_load(stop))) {
            errno = ETIMEDOUT;
            return -1;
        }
        uint64_t left_ms = (deadline_ns - now) / 1000000 + 1;
        struct pollfd p = {.fd = fd, .events = ev};
        int n = poll(&p, 1, left_ms > 100 ? 100 : (int)left_ms);
        if (n > 0)
            return 0;
        if (n < 0 && errno != EINTR)
            return -1;
    }
}

int kvl_relay_send(int fd, const void *buf, size_t len, uint64_t deadline_ns)
{
    const uint8_t *p = buf;
    while (len) {
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
            p += n;
            len -= (size_t)n;
        } else if (n < 0 && errno != EAGAIN && errno != EINTR) {
            return -1;
        } else if (wait_io(fd, POLLOUT, deadline_ns, NULL) != 0) {
            return -1;
        }
    }
    return 0;
}

int kvl_relay_recv(int fd, void *buf, size_t len, uint64_t deadline_ns, atomic_int *stop)
{
    uint8_t *p = buf;
    while (len) {
        ssize_t n = recv(fd, p, len, MSG_DONTWAIT);
        if (n > 0) {
            p += n;
            len -= (size_t)n;
        } else if (n == 0) {
            errno = ECONNRESET;
            return -1;
        } else if (errno != EAGAIN && errno != EINTR) {
            return -1;
        } else if (wait_io(fd, POLLIN, deadline_ns, stop) != 0) {
            return -1;
        }
    }
    return 0;
}
