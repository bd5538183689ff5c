/* forward.c: the relay in the middle of a relayed path (Config.relay).
 *
 * One thread per relaying agent, one epoll loop.  A connection to the relay
 * port gets a nonce, sends its request (the target's address and port, the
 * requester's name, a MAC under the cluster secret: only members are
 * forwarded for), and the relay connects to the target from its own address
 * on the target's /24 (only networks it lends a NIC on: it is no open
 * proxy).  From then on it moves bytes both ways with splice(2) through a
 * pipe of KVL_RELAY_PIPE bytes per direction: cut-through (a chunk's first
 * bytes leave before its last arrive), never more than the pipe and the two
 * sockets' buffers per hop, and no byte is read by the relay: the ends seal
 * their stream (relay.c).
 *
 * Lending only what is idle: every KVL_RELAY_TICK_MS the loop reads each
 * lent NIC's byte counters and subtracts what it forwarded there; when the
 * rest (this host's own traffic) stays above cfg.relay_yield_mbps for two
 * samples the NIC is taken back: every relayed connection through it is
 * reset (the senders retry those chunks on their other paths at once) and
 * new ones through it are refused BUSY until it has been quiet for
 * KVL_RELAY_HOLD_MS.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/tcp.h> /* tcp_info with bytes_sent / bytes_received */
#include <sys/epoll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include "../../log.h"
#include "../../sha256.h"
#include "relay.h"

#define KVL_RELAY_PIPE (1 << 20)
#define KVL_RELAY_TICK_MS 50
#define KVL_RELAY_HOLD_MS 1000
#define KVL_RELAY_PENDING 64       /* requests being read or connected at once */
#define KVL_RELAY_PER_SOURCE 64    /* relayed connections from one source address */
#define KVL_RELAY_PENDING_PER_SOURCE 8 /* ... of them still in their request: one silent
                                          client cannot hold every pending slot */
#define KVL_RELAY_OVERHEAD 1.07    /* headers and acknowledgements per forwarded byte */

enum { W_LISTEN, W_PEND_C, W_PEND_T, W_PAIR };

typedef struct fwd_watch {
    int kind;
    void *obj;
} fwd_watch;

typedef struct fwd_nic {
    char ifname[32];
    uint64_t total_prev;       /* rx + tx bytes at the last sample */
    uint64_t fwd, fwd_prev;    /* TCP bytes our relayed sockets moved through it, both ways
                                  (closed ones' in fwd_closed), at this / the last sample */
    uint64_t fwd_closed;
    double other_Bps;
    int over;                  /* consecutive samples over the limit */
    uint64_t busy_until_ns;    /* taken back until then (0: lent) */
} fwd_nic;

typedef struct fwd_pend {
    fwd_watch wc, wt;
    int cfd, tfd;
    uint32_t src;              /* client's IPv4 (network order) */
    int nic_in, nic_out;
    uint8_t nonce[KVL_RELAY_NONCE];
    uint8_t req[KVL_RELAY_REQ_MAX];
    size_t got;
    char name[64], target[32];
    uint64_t deadline_ns;
    int dead;                  /* freed this batch: its memory goes at the batch's end */
    struct fwd_pend *next, **pprev;
} fwd_pend;

typedef struct fwd_dir {
    int pipe[2];
    size_t held;               /* bytes in the pipe */
    int eof, shut;             /* source ended; its end passed on (shutdown(SHUT_WR)) */
    int opened;                /* its first bytes were "KVE1": a sealed connection, not some
                                  other protocol aimed at a neighbour's service */
} fwd_dir;

typedef struct fwd_pair {
    fwd_watch wc, wt;
    int cfd, tfd;
    uint32_t src;
    int nic_in, nic_out;
    fwd_dir ct, tc;            /* client -> target, target -> client */
    uint64_t open_by_ns;       /* both directions showed the magic by then, or it is cut */
    uint64_t tcp_c, tcp_t;     /* the last sample of each socket's TCP bytes both ways */
    int dead;                  /* freed this batch: its memory goes at the batch's end */
    struct fwd_pair *next, **pprev;
} fwd_pair;

struct kvl_forwarder {
    kvl_agent *a;
    int ep;
    int lfd[KVL_MAX_PATHS];
    fwd_watch lw[KVL_MAX_PATHS];
    uint32_t laddr[KVL_MAX_PATHS];  /* lent addresses (network order) */
    int lnic[KVL_MAX_PATHS];
    uint16_t lport[KVL_MAX_PATHS];
    size_t n;
    fwd_nic nics[KVL_MAX_PATHS];
    size_t n_nics;
    fwd_pend *pend;
    size_t n_pend;
    fwd_pair *pairs;
    size_t n_pairs;
    /* unlinked this batch; an event of the same batch may still name them */
    void *grave[256];
    size_t n_grave;
    uint64_t listen_paused_ns; /* accept failed (out of descriptors): not accepting till then */
    uint64_t t_log_ns;         /* the last refusal logged (at most one a second) */
    int pipe_small_logged;
    uint64_t t_sample_ns;
    pthread_t th;
    int started;
    atomic_int stop;
    /* counters (stats_mu) */
    pthread_mutex_t mu;
    uint64_t conns_total, bytes, refused, yields;
    uint32_t conns_now;
};

/* ---- helpers ---- */

static int nic_busy(kvl_forwarder *f, int nic, uint64_t now)
{
    return nic >= 0 && f->nics[nic].busy_until_ns > now;
}

static void watch_fd(kvl_forwarder *f, int fd, fwd_watch *w, uint32_t ev, int op)
{
    struct epoll_event e = {.events = ev, .data.ptr = w};
    epoll_ctl(f->ep, op, fd, &e);
}

static void close_fd(kvl_forwarder *f, int fd, int abortive)
{
    if (fd < 0)
        return;
    epoll_ctl(f->ep, EPOLL_CTL_DEL, fd, NULL);
    if (abortive) {
        struct linger lg = {.l_onoff = 1, .l_linger = 0};
        setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
    }
    close(fd);
}

/* Frees what the batch unlinked (or at once when the list is full: then the
 * caller's event is the pair's last one in the batch, as in teardown). */
static void bury(kvl_forwarder *f, void *obj)
{
    if (f->n_grave < sizeof f->grave / sizeof *f->grave)
        f->grave[f->n_grave++] = obj;
    else
        free(obj);
}

static void empty_grave(kvl_forwarder *f)
{
    for (size_t i = 0; i < f->n_grave; i++)
        free(f->grave[i]);
    f->n_grave = 0;
}

static void pend_free(kvl_forwarder *f, fwd_pend *p)
{
    close_fd(f, p->cfd, 1);
    close_fd(f, p->tfd, 1);
    *p->pprev = p->next;
    if (p->next)
        p->next->pprev = p->pprev;
    f->n_pend--;
    p->dead = 1;
    bury(f, p);
}

static uint64_t tcp_bytes(int fd);

static void pair_free(kvl_forwarder *f, fwd_pair *p, int abortive)
{
    /* what its sockets moved since the last sample still counts as ours */
    uint64_t c = tcp_bytes(p->cfd), t = tcp_bytes(p->tfd);
    f->nics[p->nic_in].fwd_closed += c > p->tcp_c ? c - p->tcp_c : 0;
    f->nics[p->nic_out].fwd_closed += t > p->tcp_t ? t - p->tcp_t : 0;
    close_fd(f, p->cfd, abortive);
    close_fd(f, p->tfd, abortive);
    for (int i = 0; i < 2; i++) {
        close(p->ct.pipe[i]);
        close(p->tc.pipe[i]);
    }
    *p->pprev = p->next;
    if (p->next)
        p->next->pprev = p->pprev;
    f->n_pairs--;
    pthread_mutex_lock(&f->mu);
    f->conns_now--;
    pthread_mutex_unlock(&f->mu);
    p->dead = 1;
    bury(f, p);
}

/* Answers a pending request and drops it (status != OK). */
static void refuse(kvl_forwarder *f, fwd_pend *p, int status, const char *fmt, const char *arg)
{
    uint8_t out[2 + 255];
    int n = snprintf((char *)out + 2, 255, fmt, arg);
    if (n < 0)
        n = 0;
    if (n > 254)
        n = 254;
    out[0] = (uint8_t)status;
    out[1] = (uint8_t)n;
    ssize_t w = send(p->cfd, out, 2 + (size_t)n, MSG_NOSIGNAL | MSG_DONTWAIT);
    (void)w; /* best effort: a fresh socket takes 257 bytes */
    pthread_mutex_lock(&f->mu);
    f->refused++;
    pthread_mutex_unlock(&f->mu);
    pend_free(f, p);
}

/* ---- requests ---- */

static size_t per_source(kvl_forwarder *f, uint32_t src)
{
    size_t k = 0;
    for (fwd_pair *q = f->pairs; q; q = q->next)
        k += q->src == src;
    for (fwd_pend *q = f->pend; q; q = q->next)
        k += q->src == src;
    return k;
}

static size_t pend_from(kvl_forwarder *f, uint32_t src)
{
    size_t k = 0;
    for (fwd_pend *q = f->pend; q; q = q->next)
        k += q->src == src;
    return k;
}

static void accept_all(kvl_forwarder *f, size_t li)
{
    for (;;) {
        struct sockaddr_in pa;
        socklen_t pl = sizeof pa;
        int fd = accept4(f->lfd[li], (struct sockaddr *)&pa, &pl, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0 && errno != EAGAIN && errno != EINTR && errno != ECONNABORTED) {
            /* out of descriptors or memory: the connection stays queued and the
             * listener would fire again at once; stop listening for 100 ms */
            for (size_t i = 0; i < f->n; i++)
                watch_fd(f, f->lfd[i], &f->lw[i], 0, EPOLL_CTL_MOD);
            f->listen_paused_ns = kvl_now_ns() + 100000000ull;
            return;
        }
        if (fd < 0)
            return;
        kvl_relay_tune(fd);
        fwd_pend *p = NULL;
        if (f->n_pend >= KVL_RELAY_PENDING ||
            pend_from(f, pa.sin_addr.s_addr) >= KVL_RELAY_PENDING_PER_SOURCE ||
            f->n_pairs + f->n_pend >= f->a->cfg.relay_max_conns ||
            per_source(f, pa.sin_addr.s_addr) >= KVL_RELAY_PER_SOURCE ||
            !(p = calloc(1, sizeof *p))) {
            /* full: closed unanswered, the sender's probe backs off */
            close(fd);
            pthread_mutex_lock(&f->mu);
            f->refused++;
            pthread_mutex_unlock(&f->mu);
            continue;
        }
        p->cfd = fd;
        p->tfd = -1;
        p->src = pa.sin_addr.s_addr;
        p->nic_in = f->lnic[li];
        p->wc = (fwd_watch){W_PEND_C, p};
        p->wt = (fwd_watch){W_PEND_T, p};
        p->deadline_ns = kvl_now_ns() + (uint64_t)f->a->cfg.connect_timeout_ms * 1000000ull;
        p->next = f->pend;
        p->pprev = &f->pend;
        if (f->pend)
            f->pend->pprev = &p->next;
        f->pend = p;
        f->n_pend++;
        uint8_t hello[4 + KVL_RELAY_NONCE];
        memcpy(hello, KVL_RELAY_MAGIC, 4);
        if (getrandom(p->nonce, sizeof p->nonce, 0) != sizeof p->nonce) {
            pend_free(f, p);
            continue;
        }
        memcpy(hello + 4, p->nonce, sizeof p->nonce);
        if (send(fd, hello, sizeof hello, MSG_NOSIGNAL | MSG_DONTWAIT) != (ssize_t)sizeof hello) {
            pend_free(f, p);
            continue;
        }
        watch_fd(f, fd, &p->wc, EPOLLIN | EPOLLRDHUP, EPOLL_CTL_ADD);
    }
}

/* The request is in: check it, then connect to the target. */
static void on_request(kvl_forwarder *f, fwd_pend *p, size_t len)
{
    kvl_agent *a = f->a;
    const uint8_t *r = p->req;
    size_t nl = r[10];
    memcpy(p->name, r + 11, nl);
    p->name[nl] = 0;
    for (size_t i = 0; i < nl; i++)
        if (p->name[i] < 0x21 || p->name[i] > 0x7e)
            p->name[i] = '?';
    if (a->secret_len) {
        uint8_t m[KVL_SHA256_BYTES];
        kvl_hmac h;
        kvl_hmac_init(&h, a->secret, a->secret_len);
        kvl_hmac_update(&h, "kvlink relay request", 20);
        kvl_hmac_update(&h, p->nonce, sizeof p->nonce);
        kvl_hmac_update(&h, r, len - KVL_SHA256_BYTES);
        kvl_hmac_final(&h, m);
        if (!kvl_ct_equal(m, r + len - KVL_SHA256_BYTES, sizeof m)) {
            uint64_t now = kvl_now_ns();
            if (now - f->t_log_ns >= 1000000000ull) { /* a peer's refusals: one a second */
                f->t_log_ns = now;
                kvl_log(a, KVL_LOG_WARNING, NULL, -1,
                        "relay: refused a request claiming to be '%s': it does not hold this "
                        "cluster's secret",
                        p->name);
            }
            refuse(f, p, KVL_RELAY_AUTH,
                   "agent '%s' relays only for holders of its cluster secret", a->name);
            return;
        }
    }
    struct sockaddr_in to = {.sin_family = AF_INET};
    memcpy(&to.sin_addr.s_addr, r + 4, 4);
    to.sin_port = htons((uint16_t)(r[8] << 8 | r[9]));
    inet_ntop(AF_INET, &to.sin_addr, p->target, sizeof p->target);
    /* the egress: our lent address on the target's /24 */
    size_t eg = f->n;
    for (size_t i = 0; i < f->n; i++) {
        if (f->laddr[i] == to.sin_addr.s_addr) {
            eg = f->n;
            break;
        }
        if (kvl_relay_net24(f->laddr[i]) == kvl_relay_net24(to.sin_addr.s_addr))
            eg = i;
    }
    if (eg == f->n || !to.sin_port) {
        refuse(f, p, KVL_RELAY_REFUSED,
               "the relay lends no NIC on the network of %s (it forwards only to its "
               "neighbours' /24s)",
               p->target);
        return;
    }
    uint64_t now = kvl_now_ns();
    p->nic_out = f->lnic[eg];
    if (nic_busy(f, p->nic_in, now) || nic_busy(f, p->nic_out, now)) {
        refuse(f, p, KVL_RELAY_BUSY,
               "the relay host's own traffic needs NIC %s now: not lending it",
               f->nics[nic_busy(f, p->nic_in, now) ? p->nic_in : p->nic_out].ifname);
        return;
    }
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    struct sockaddr_in la = {.sin_family = AF_INET, .sin_addr.s_addr = f->laddr[eg]};
    if (fd < 0 || bind(fd, (struct sockaddr *)&la, sizeof la) < 0) {
        if (fd >= 0)
            close(fd);
        refuse(f, p, KVL_RELAY_UNREACHABLE, "cannot open a socket to %s", p->target);
        return;
    }
    int one = 1;
    unsigned ut = 5000;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &ut, sizeof ut);
    p->tfd = fd;
    if (connect(fd, (struct sockaddr *)&to, sizeof to) < 0 && errno != EINPROGRESS) {
        refuse(f, p, KVL_RELAY_UNREACHABLE, "cannot connect to %s", p->target);
        return;
    }
    epoll_ctl(f->ep, EPOLL_CTL_DEL, p->cfd, NULL); /* nothing more from it until then */
    watch_fd(f, fd, &p->wt, EPOLLOUT, EPOLL_CTL_ADD);
}

static void on_pend_client(kvl_forwarder *f, fwd_pend *p)
{
    ssize_t n = recv(p->cfd, p->req + p->got, sizeof p->req - p->got, MSG_DONTWAIT);
    if (n <= 0) {
        if (n == 0 || (errno != EAGAIN && errno != EINTR))
            pend_free(f, p);
        return;
    }
    p->got += (size_t)n;
    if (p->got >= 4 && memcmp(p->req, KVL_RELAY_REQ, 4) != 0) {
        pend_free(f, p); /* not our protocol: closed unanswered */
        return;
    }
    if (p->got < 11)
        return;
    size_t nl = p->req[10];
    size_t need = 11 + nl + KVL_SHA256_BYTES;
    if (nl == 0 || nl > 63) {
        pend_free(f, p);
        return;
    }
    if (p->got > need) { /* bytes past the request before our answer: not our client */
        pend_free(f, p);
        return;
    }
    if (p->got == need)
        on_request(f, p, need);
}

static int pipe_new(kvl_forwarder *f, int fds[2])
{
    if (pipe2(fds, O_CLOEXEC | O_NONBLOCK) < 0)
        return -1;
    if (fcntl(fds[0], F_SETPIPE_SZ, KVL_RELAY_PIPE) < 0 && !f->pipe_small_logged) {
        /* unprivileged, past fs/pipe-user-pages-soft: pipes stay small (slower, not wrong) */
        f->pipe_small_logged = 1;
        kvl_log(f->a, KVL_LOG_WARNING, NULL, -1,
                "relay: cannot grow a pipe to %u bytes (%s): relayed connections forward "
                "through smaller ones; raise fs.pipe-max-size / pipe-user-pages-soft or run "
                "the relay with CAP_SYS_RESOURCE",
                KVL_RELAY_PIPE, strerror(errno));
    }
    return 0;
}

static void on_pend_target(kvl_forwarder *f, fwd_pend *p)
{
    int soerr = 0;
    socklen_t sl = sizeof soerr;
    getsockopt(p->tfd, SOL_SOCKET, SO_ERROR, &soerr, &sl);
    if (soerr) {
        char why[128];
        snprintf(why, sizeof why, "%s: %s", p->target, strerror(soerr));
        refuse(f, p, KVL_RELAY_UNREACHABLE, "cannot connect to %s", why);
        return;
    }
    fwd_pair *q = calloc(1, sizeof *q);
    if (!q || pipe_new(f, q->ct.pipe) != 0) {
        free(q);
        refuse(f, p, KVL_RELAY_BUSY, "%s", "the relay is out of memory or descriptors");
        return;
    }
    if (pipe_new(f, q->tc.pipe) != 0) {
        close(q->ct.pipe[0]);
        close(q->ct.pipe[1]);
        free(q);
        refuse(f, p, KVL_RELAY_BUSY, "%s", "the relay is out of memory or descriptors");
        return;
    }
    uint8_t ok[2] = {KVL_RELAY_OK, 0};
    if (send(p->cfd, ok, 2, MSG_NOSIGNAL | MSG_DONTWAIT) != 2) {
        for (int i = 0; i < 2; i++) {
            close(q->ct.pipe[i]);
            close(q->tc.pipe[i]);
        }
        free(q);
        pend_free(f, p);
        return;
    }
    q->cfd = p->cfd;
    q->tfd = p->tfd;
    q->src = p->src;
    q->nic_in = p->nic_in;
    q->nic_out = p->nic_out;
    q->open_by_ns = kvl_now_ns() + (uint64_t)f->a->cfg.connect_timeout_ms * 1000000ull;
    q->tcp_c = tcp_bytes(q->cfd); /* the request and answer were not forwarded bytes */
    q->tcp_t = tcp_bytes(q->tfd);
    q->wc = (fwd_watch){W_PAIR, q};
    q->wt = (fwd_watch){W_PAIR, q};
    epoll_ctl(f->ep, EPOLL_CTL_DEL, p->tfd, NULL);
    p->cfd = p->tfd = -1;
    pend_free(f, p);
    q->next = f->pairs;
    q->pprev = &f->pairs;
    if (f->pairs)
        f->pairs->pprev = &q->next;
    f->pairs = q;
    f->n_pairs++;
    pthread_mutex_lock(&f->mu);
    f->conns_total++;
    f->conns_now++;
    pthread_mutex_unlock(&f->mu);
    uint32_t ev = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET;
    watch_fd(f, q->cfd, &q->wc, ev, EPOLL_CTL_ADD);
    watch_fd(f, q->tfd, &q->wt, ev, EPOLL_CTL_ADD);
}

/* ---- forwarding ---- */

/* Moves what src has into dst through d's pipe; -1 when the pair must end
 * abortively (an error), 0 otherwise.  gate 0: nothing moves yet (the
 * client's bytes wait until the target showed the magic). */
static int pump(kvl_forwarder *f, fwd_dir *d, int src, int dst, int gate)
{
    if (!d->opened) {
        /* both ends of a relayed connection start with the sealed protocol's
         * magic (relay.h): anything else is not forwarded, so a member cannot
         * use the relay to speak HTTP, SSH, ... to a neighbour's services */
        char m[4];
        ssize_t n = recv(src, m, sizeof m, MSG_PEEK | MSG_DONTWAIT);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR))
            return -1;
        if (n < (ssize_t)sizeof m)
            return 0; /* the rest arrives with the next edge */
        if (memcmp(m, KVL_E2E_MAGIC, sizeof m) != 0)
            return -1;
        d->opened = 1;
    }
    if (!gate)
        return 0; /* checked, held back: it moves once the other side opened */
    for (;;) {
        int moved = 0;
        if (!d->eof && d->held < KVL_RELAY_PIPE) {
            ssize_t n = splice(src, NULL, d->pipe[1], NULL, KVL_RELAY_PIPE - d->held,
                               SPLICE_F_MOVE | SPLICE_F_NONBLOCK);
            if (n > 0) {
                d->held += (size_t)n;
                moved = 1;
            } else if (n == 0) {
                d->eof = 1;
            } else if (errno != EAGAIN && errno != EINTR) {
                return -1;
            }
        }
        if (d->held) {
            ssize_t n = splice(d->pipe[0], NULL, dst, NULL, d->held,
                               SPLICE_F_MOVE | SPLICE_F_NONBLOCK);
            if (n > 0) {
                d->held -= (size_t)n;
                pthread_mutex_lock(&f->mu);
                f->bytes += (uint64_t)n;
                pthread_mutex_unlock(&f->mu);
                moved = 1;
            } else if (n < 0 && errno != EAGAIN && errno != EINTR) {
                return -1;
            }
        }
        if (!moved)
            break;
    }
    if (d->eof && !d->held && !d->shut) {
        shutdown(dst, SHUT_WR);
        d->shut = 1;
    }
    return 0;
}

static void on_pair(kvl_forwarder *f, fwd_pair *q)
{
    /* The target speaks first (the sealed port greets with the magic): not one
     * byte of the client's reaches it before that, so a member cannot make the
     * relay write to a neighbour's service that is not kvlink's (relay.h).
     * The target's direction goes first: its opening lets the client's through
     * in the same event. */
    if (pump(f, &q->tc, q->tfd, q->cfd, 1) != 0 ||
        pump(f, &q->ct, q->cfd, q->tfd, q->tc.opened) != 0) {
        pair_free(f, q, 1);
        return;
    }
    if (q->ct.shut && q->tc.shut)
        pair_free(f, q, 0);
}

/* ---- lending only what is idle ---- */

/* TCP payload bytes fd sent and received.  Counted where the kernel counts
 * them, not where splice moves them: a burst into a socket buffer shows on
 * the NIC at once, while splice takes it later, which would look like
 * traffic of someone else's. */
static uint64_t tcp_bytes(int fd)
{
    struct tcp_info ti;
    socklen_t sl = sizeof ti;
    memset(&ti, 0, sizeof ti);
    if (fd < 0 || getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &sl) < 0)
        return 0;
    return ti.tcpi_bytes_sent + ti.tcpi_bytes_received;
}

/* Each lent NIC's relayed TCP bytes so far (open pairs sampled now). */
static void count_ours(kvl_forwarder *f)
{
    for (fwd_pair *q = f->pairs; q; q = q->next) {
        uint64_t c = tcp_bytes(q->cfd), t = tcp_bytes(q->tfd);
        if (c < q->tcp_c)
            c = q->tcp_c;
        if (t < q->tcp_t)
            t = q->tcp_t;
        f->nics[q->nic_in].fwd_closed += c - q->tcp_c;
        f->nics[q->nic_out].fwd_closed += t - q->tcp_t;
        q->tcp_c = c;
        q->tcp_t = t;
    }
    for (size_t k = 0; k < f->n_nics; k++)
        f->nics[k].fwd = f->nics[k].fwd_closed;
}

static int read_counter(const char *ifname, const char *what, uint64_t *out)
{
    char path[128];
    snprintf(path, sizeof path, "/sys/class/net/%s/statistics/%s", ifname, what);
    FILE *fp = fopen(path, "r");
    if (!fp)
        return -1;
    unsigned long long v = 0;
    int ok = fscanf(fp, "%llu", &v) == 1;
    fclose(fp);
    *out = v;
    return ok ? 0 : -1;
}

static void sample(kvl_forwarder *f, uint64_t now)
{
    double dt = f->t_sample_ns ? (double)(now - f->t_sample_ns) / 1e9 : 0;
    f->t_sample_ns = now;
    double limit = (double)f->a->cfg.relay_yield_mbps * 1e6 / 8;
    count_ours(f);
    for (size_t k = 0; k < f->n_nics; k++) {
        fwd_nic *n = &f->nics[k];
        uint64_t rx, tx;
        if (!n->ifname[0] || read_counter(n->ifname, "rx_bytes", &rx) ||
            read_counter(n->ifname, "tx_bytes", &tx))
            continue;
        uint64_t total = rx + tx, fwd = n->fwd;
        if (dt > 0 && total >= n->total_prev) {
            double mine = (double)(fwd - n->fwd_prev) * KVL_RELAY_OVERHEAD;
            double other = ((double)(total - n->total_prev) - mine) / dt;
            n->other_Bps = other > 0 ? other : 0;
            /* a few per cent of what we forward is our own error margin */
            double allowed = limit + 0.03 * (double)(fwd - n->fwd_prev) / dt;
            n->over = limit > 0 && n->other_Bps > allowed ? n->over + 1 : 0;
        }
        n->total_prev = total;
        n->fwd_prev = fwd;
        if (n->over >= 2) {
            int was_lent = n->busy_until_ns <= now;
            n->busy_until_ns = now + KVL_RELAY_HOLD_MS * 1000000ull;
            if (was_lent) {
                size_t cut = 0;
                for (fwd_pair *q = f->pairs, *nx; q; q = nx) {
                    nx = q->next;
                    if (q->nic_in == (int)k || q->nic_out == (int)k) {
                        pair_free(f, q, 1);
                        cut++;
                    }
                }
                pthread_mutex_lock(&f->mu);
                f->yields++;
                pthread_mutex_unlock(&f->mu);
                kvl_log(f->a, KVL_LOG_INFO, NULL, -1,
                        "relay: this host's own traffic on %s is %.0f Mbit/s: taking the NIC "
                        "back (%zu relayed connections reset, new ones refused until it is "
                        "quiet for %u ms)",
                        n->ifname, n->other_Bps * 8 / 1e6, cut, KVL_RELAY_HOLD_MS);
            }
        }
    }
}

static void expire(kvl_forwarder *f, uint64_t now)
{
    for (fwd_pend *p = f->pend, *nx; p; p = nx) {
        nx = p->next;
        if (now >= p->deadline_ns) {
            if (p->tfd >= 0)
                refuse(f, p, KVL_RELAY_UNREACHABLE, "%s did not answer in time", p->target);
            else
                pend_free(f, p);
        }
    }
    /* a target that never greets (a silent service), or a client that never answers it */
    for (fwd_pair *q = f->pairs, *nx; q; q = nx) {
        nx = q->next;
        if (!(q->ct.opened && q->tc.opened) && now >= q->open_by_ns)
            pair_free(f, q, 1);
    }
}

static void *fwd_main(void *arg)
{
    kvl_forwarder *f = arg;
    struct epoll_event evs[64];
    uint64_t next_tick = 0;
    while (!atomic_load(&f->stop)) {
        int n = epoll_wait(f->ep, evs, 64, KVL_RELAY_TICK_MS / 2);
        for (int i = 0; i < n; i++) {
            /* an event's object may have been unlinked by an earlier event of
             * this batch: it stays allocated (the grave) until the batch ends */
            fwd_watch *w = evs[i].data.ptr;
            if (w->kind == W_LISTEN)
                accept_all(f, (size_t)((fwd_watch *)w - f->lw));
            else if (w->kind == W_PEND_C && !((fwd_pend *)w->obj)->dead)
                on_pend_client(f, w->obj);
            else if (w->kind == W_PEND_T && !((fwd_pend *)w->obj)->dead)
                on_pend_target(f, w->obj);
            else if (w->kind == W_PAIR && !((fwd_pair *)w->obj)->dead)
                on_pair(f, w->obj);
        }
        empty_grave(f);
        uint64_t now = kvl_now_ns();
        if (now >= next_tick) {
            next_tick = now + KVL_RELAY_TICK_MS * 1000000ull;
            sample(f, now);
            expire(f, now);
            empty_grave(f);
            if (f->listen_paused_ns && now >= f->listen_paused_ns) {
                f->listen_paused_ns = 0;
                for (size_t i = 0; i < f->n; i++)
                    watch_fd(f, f->lfd[i], &f->lw[i], EPOLLIN, EPOLL_CTL_MOD);
            }
        }
    }
    return NULL;
}

/* ---- set-up ---- */

static void find_nics(kvl_forwarder *f)
{
    struct ifaddrs *ifs = NULL;
    if (getifaddrs(&ifs) != 0)
        ifs = NULL;
    for (size_t i = 0; i < f->n; i++) {
        const char *name = "";
        for (struct ifaddrs *it = ifs; it; it = it->ifa_next)
            if (it->ifa_addr && it->ifa_addr->sa_family == AF_INET &&
                ((struct sockaddr_in *)(void *)it->ifa_addr)->sin_addr.s_addr == f->laddr[i]) {
                name = it->ifa_name;
                break;
            }
        size_t k;
        for (k = 0; k < f->n_nics; k++)
            if (strcmp(f->nics[k].ifname, name) == 0)
                break;
        if (k == f->n_nics)
            snprintf(f->nics[f->n_nics++].ifname, sizeof f->nics[k].ifname, "%s", name);
        f->lnic[i] = (int)k;
    }
    if (ifs)
        freeifaddrs(ifs);
}

void kvl_forwarder_stop(kvl_forwarder *f)
{
    if (!f)
        return;
    atomic_store(&f->stop, 1);
    if (f->started)
        pthread_join(f->th, NULL);
    while (f->pend)
        pend_free(f, f->pend);
    while (f->pairs)
        pair_free(f, f->pairs, 1);
    empty_grave(f);
    for (size_t i = 0; i < f->n; i++)
        close(f->lfd[i]);
    if (f->ep >= 0)
        close(f->ep);
    pthread_mutex_destroy(&f->mu);
    free(f);
}

kvl_err kvl_forwarder_start(kvl_agent *a, kvl_forwarder **out, uint16_t *ports)
{
    kvl_forwarder *f = calloc(1, sizeof *f);
    if (!f)
        return kvl_fail(KVL_ERR_NOMEM, "relay: out of memory");
    f->a = a;
    pthread_mutex_init(&f->mu, NULL);
    f->ep = epoll_create1(EPOLL_CLOEXEC);
    const char *const *addrs = a->cfg.relay_addrs;
    size_t n = a->cfg.n_relay_addrs;
    char(*own)[48] = a->addrs;
    if (!addrs || !n)
        n = a->n_addrs;
    kvl_err e = f->ep < 0 ? kvl_fail_errno("relay: epoll_create1") : KVL_OK;
    if (!e && n > KVL_MAX_PATHS)
        e = kvl_fail(KVL_ERR_INVALID_ARG, "relay: %zu lent addresses (at most %d)", n,
                     KVL_MAX_PATHS);
    for (size_t i = 0; !e && !a->secret_len && !a->cfg.allow_unauthenticated && i < n; i++) {
        const char *host = addrs && a->cfg.n_relay_addrs ? addrs[i] : own[i];
        if (strncmp(host, "127.", 4) != 0)
            e = kvl_fail(KVL_ERR_INVALID_ARG,
                         "agent '%s' would relay on %s without a cluster secret: anyone who "
                         "reaches it could use it; give every agent the secret (Config.secret "
                         "or KVLINK_SECRET), or on a trusted network allow_unauthenticated=True",
                         a->name, host);
    }
    for (size_t i = 0; !e && i < n; i++) {
        const char *host = addrs && a->cfg.n_relay_addrs ? addrs[i] : own[i];
        struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(a->cfg.relay_port)};
        if (inet_pton(AF_INET, host, &sa.sin_addr) != 1) {
            e = kvl_fail(KVL_ERR_INVALID_ARG, "relay: '%s' is not an IPv4 address", host);
            break;
        }
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        int one = 1;
        if (fd >= 0)
            setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (fd < 0 || bind(fd, (struct sockaddr *)&sa, sizeof sa) < 0 || listen(fd, 128) < 0) {
            int er = errno;
            if (fd >= 0)
                close(fd);
            e = kvl_fail(KVL_ERR_SYSTEM,
                         "relay: cannot listen on %s:%u: %s (is the address on a local "
                         "interface and the port free?)",
                         host, a->cfg.relay_port, strerror(er));
            break;
        }
        socklen_t sl = sizeof sa;
        getsockname(fd, (struct sockaddr *)&sa, &sl);
        f->lfd[i] = fd;
        f->laddr[i] = sa.sin_addr.s_addr;
        f->lport[i] = ntohs(sa.sin_port);
        ports[i] = f->lport[i];
        f->lw[i] = (fwd_watch){W_LISTEN, NULL};
        f->n++;
        watch_fd(f, fd, &f->lw[i], EPOLLIN, EPOLL_CTL_ADD);
    }
    if (!e) {
        find_nics(f);
        if (pthread_create(&f->th, NULL, fwd_main, f) == 0)
            f->started = 1;
        else
            e = kvl_fail(KVL_ERR_SYSTEM, "relay: cannot start its thread");
    }
    if (e) {
        kvl_forwarder_stop(f);
        return e;
    }
    *out = f;
    return KVL_OK;
}

void kvl_forwarder_stats(kvl_forwarder *f, kvl_relay_info *out)
{
    pthread_mutex_lock(&f->mu);
    out->relayed_conns = f->conns_now;
    out->relayed_total = f->conns_total;
    out->relayed_bytes = f->bytes;
    out->relay_refused = f->refused;
    out->relay_yields = f->yields;
    pthread_mutex_unlock(&f->mu);
    out->n_relay = (uint32_t)f->n;
}
