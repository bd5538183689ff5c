/* test_tcp_stream.c: the TCP stream (csrc/transport/tcp/: tcp.c, stream.c,
 * iopool.c) alone, over real loopback sockets.
 *
 * What it links: the three TCP objects and the leaf objects they call (wire,
 * crc32c, errors, clock, log, staging and its cuda), nothing of the core
 * above them.  The core's side of the contract -- the kvl_proto_* upcalls,
 * the event loop (kvl_engine_watch/rewatch/unwatch) and the drain scratch of
 * transport.h's last section -- is a small recording harness in this file.
 * That is a test double of the *other* side of the contract the stream is
 * tested against, not a mock of the code under test: every byte still goes
 * through the stream's own sockets, framing, I/O threads and mover glue, and
 * the harness only records what the stream hands the core and answers as
 * transport.h says the core answers (on_error closes the endpoint, as
 * kvl_conn_fail does).  A tiny epoll loop plays the engine thread (on_event,
 * then progress after every wakeup).  Two test movers stand in for shm and
 * UCX: a receiver-pulled one (rx_begin / pull / skip over memory the test
 * owns) and a one-sided one (post copies into the receiver's sink, ready()
 * says 0 until the test says the writes are done, wait() answers what the
 * test says).
 *
 * Cases (every wait bounded by a deadline; each runs on the engine thread
 * and again with io_threads=2 where the I/O threads have a part in it):
 *  1. listen / connect / send_all / recv_all / attach; frames without a
 *     payload arrive whole (header and body) both ways.
 *  2. a chunk frame of several MiB over many iovecs arrives byte-exact into
 *     a sink of several pieces; its crc matches the trailer and the data;
 *     the hold is released once; a staged (memcpy) frame too.
 *  3. cancel: an unstarted chunk never arrives; a chunk part-way out goes
 *     on as zeros with a trailer that does not verify, its hold released at
 *     the cancel and never again; drop_unstarted drops only chunk frames.
 *  4. revocation mid-payload: the rest is drained, the sink's bytes after
 *     the cut are untouched, and the stream stays in step (the next frame).
 *  5. hostile input: a body above kvl_proto_max_body, a bad magic, another
 *     version, OOB without a mover, a cover above KVL_MAX_COVER, a cover the
 *     mover refuses: each ends in on_error (or on_version), no crash; a valid
 *     cover lands the pulled bytes, which verify; a pull whose source is gone
 *     (EFAULT) cannot verify.  End to end with that mover on both sides,
 *     the sender's hold outlives the frame until the chunk's ACK (or the
 *     close).
 *  6. a one-sided mover: the trailer goes only once ready() said 1 (woken
 *     through watch_fd); cancel of a posted, unfinished copy waits on it
 *     (wait() 1: released, the trailer cannot verify; wait() 0: the hold is
 *     kept, the connection fails from the event loop, not inside cancel, and
 *     the hold goes at the close, after the mover was freed); revocation on
 *     the receiving end of puts fences its mover before it returns and
 *     fails the connection from the event loop.
 *  7. stream budgets (issue 22): answers queued to a peer that does not
 *     read them are counted at their true memory (a READ_RESP of 8192
 *     pieces: its 128 KiB iovec array) and pause reading that connection
 *     (never dropping an answer) until they drain; over the agent's budget
 *     a connection holding little reads on; all of it back at the close.
 *  8. one readiness event reads at most READ_FRAMES (32) frames.
 *  9. a body buffer grows as the body arrives; a trickled body is cut at
 *     its deadline (connect_timeout + length at 64 KiB/s), not before; a
 *     full body pool cuts the body arriving longest, and the newer one
 *     arrives whole.
 * 10. a DATA frame of zero-length pieces (payload_len 0) ends its payload
 *     at once, so the core answers it.
 */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include "test_main.h"
#include "transport/tcp/tcp.h"

extern const kvl_stream_ops kvl_tcp_stream;
static const kvl_stream_ops *ops = &kvl_tcp_stream;

#define WAIT_MS 10000 /* what any single wait may take before it counts as a hang */

/* ------------------------------------------------------------------ */
/* The core's side: a recording harness                                */
/* ------------------------------------------------------------------ */

#define MAX_FRAMES 32
#define MAX_SINK 16

/* What a frame holds: the test's token, released exactly once. */
typedef struct tok {
    int released;
    int mover_freed_at_release; /* the tx mover's freed count when it was released */
} tok;

struct kvl_conn {
    kvl_agent *a;
    kvl_ep *ep;
    uint32_t max_body;
    int n_frames;
    kvl_frame_hdr hdr[MAX_FRAMES];
    uint8_t *body[MAX_FRAMES];
    struct iovec sink[MAX_SINK]; /* the test's; none: the payload is drained */
    int nsink;
    struct iovec cur[MAX_SINK];  /* the payload in progress's */
    int ncur;
    int live;                    /* what payload_live answers (1 at every frame) */
    int live_calls;
    int n_payloads;
    uint32_t crc[MAX_FRAMES], trailer[MAX_FRAMES];
    uint64_t payload_seq[MAX_FRAMES];
    int n_errors;
    kvl_err err;
    char why[256];
    int n_version;
    int answer_pieces;         /* answer each READ_REQ with a READ_RESP of this many 1-byte pieces */
    int in_call;               /* the test is inside ops->cancel or revoke: no upcall may come */
    int upcall_in_call;
    int closed;
};

static struct {
    kvl_conn *accepted[8];
    int n_accepted;
    uint64_t seq;                /* orders events the test compares */
    struct kvl_mover *tx_mover;  /* whose freed count a release records */
} H;

static kvl_conn *conn_new(kvl_agent *a, kvl_ep *ep)
{
    kvl_conn *c = calloc(1, sizeof *c);
    c->a = a;
    c->ep = ep;
    c->max_body = 65536;
    c->live = 1;
    return c;
}

static void conn_free(kvl_conn *c)
{
    if (!c)
        return;
    for (int i = 0; i < c->n_frames && i < MAX_FRAMES; i++)
        free(c->body[i]);
    free(c);
}

static void conn_close(kvl_conn *c)
{
    if (!c->closed) {
        c->closed = 1;
        ops->close(c->ep, 1);
    }
}

kvl_conn *kvl_proto_accepted(kvl_agent *a, kvl_ep *ep)
{
    if (H.n_accepted == (int)(sizeof H.accepted / sizeof H.accepted[0]))
        return NULL;
    kvl_conn *c = conn_new(a, ep);
    H.accepted[H.n_accepted++] = c;
    return c;
}

uint32_t kvl_proto_max_body(const kvl_conn *c) { return c->max_body; }

static uint8_t answer_src[8192]; /* what the answers' pieces point into */
static kvl_buf frame_bytes(uint8_t type, const void *body, size_t n, uint64_t payload_len);

void kvl_proto_on_frame(kvl_conn *c, const kvl_frame_hdr *h, const uint8_t *body)
{
    c->upcall_in_call |= c->in_call;
    if (c->answer_pieces && h->type == KVL_F_READ_REQ) {
        /* as the core answers a READ_REQ of many pieces: one iovec each */
        int np = c->answer_pieces;
        kvl_tp_frame f = {.head = frame_bytes(KVL_F_READ_RESP, "answer..", 8, (uint64_t)np),
                          .payload = calloc((size_t)np, sizeof(struct iovec)),
                          .n_payload = np,
                          .payload_len = (uint64_t)np};
        for (int k = 0; k < np; k++)
            f.payload[k] = (struct iovec){answer_src + k, 1};
        CHECK(kvl_tcp_stream.send(c->ep, &f) == 0);
    }
    int i = c->n_frames++;
    if (i < MAX_FRAMES) {
        c->hdr[i] = *h;
        c->body[i] = malloc(h->body_len ? h->body_len : 1);
        if (h->body_len)
            memcpy(c->body[i], body, h->body_len);
    }
    if (h->payload_len) {
        uint64_t sum = 0;
        for (int k = 0; k < c->nsink; k++)
            sum += c->sink[k].iov_len;
        if (c->nsink && sum == h->payload_len) {
            memcpy(c->cur, c->sink, sizeof c->cur);
            c->ncur = c->nsink;
        } else { /* nowhere to go: drained, as the core drains a copy it refuses */
            c->cur[0] = (struct iovec){NULL, (size_t)h->payload_len};
            c->ncur = 1;
        }
        c->live = 1;
    }
}

void kvl_proto_on_version(kvl_conn *c, const char *why)
{
    c->n_version++;
    snprintf(c->why, sizeof c->why, "%s", why);
    conn_close(c); /* the core answers why and refuses the connection */
}

const struct iovec *kvl_proto_sink(kvl_conn *c, int *n)
{
    *n = c->ncur;
    return c->cur;
}

int kvl_proto_payload_live(kvl_conn *c)
{
    c->live_calls++;
    return c->live;
}

void kvl_proto_on_payload(kvl_conn *c, uint32_t crc, uint32_t trailer)
{
    c->upcall_in_call |= c->in_call;
    int i = c->n_payloads++;
    if (i < MAX_FRAMES) {
        c->crc[i] = crc;
        c->trailer[i] = trailer;
        c->payload_seq[i] = ++H.seq;
    }
}

void kvl_proto_on_error(kvl_conn *c, kvl_err err, const char *why)
{
    c->upcall_in_call |= c->in_call;
    if (!c->n_errors++) {
        c->err = err;
        snprintf(c->why, sizeof c->why, "%s", why);
    }
    conn_close(c); /* kvl_conn_fail closes the stream at once */
}

/* forward: the test mover's freed count (defined with the movers) */
static int mover_freed(const struct kvl_mover *m);

void kvl_proto_release(kvl_agent *a, kvl_tp_hold *h)
{
    (void)a;
    if (h->xfer) {
        tok *t = (tok *)(void *)h->xfer; /* the test's token, never a real transfer */
        t->released++;
        t->mover_freed_at_release = H.tx_mover ? mover_freed(H.tx_mover) : -1;
    }
    h->xfer = NULL;
}

uint8_t *kvl_engine_scratch(kvl_agent *a, size_t *len)
{
    *len = a->scratch_len;
    return a->scratch;
}

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

/* ---- the engine: an agent as far as the stream reads one, and its loop ---- */

static int wake_tag; /* the event loop's pointer for a->wakefd */

static kvl_agent *agent_new(uint32_t io_threads, int sock_buf)
{
    kvl_agent *a = calloc(1, sizeof *a);
    a->cfg.connect_timeout_ms = 2000;
    a->cfg.sock_buf_bytes = sock_buf;
    a->cfg.stage_pool_bytes = 16u << 20;
    a->stream = ops;
    a->epfd = epoll_create1(EPOLL_CLOEXEC);
    a->wakefd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &wake_tag};
    CHECK(a->epfd >= 0 && a->wakefd >= 0 &&
          epoll_ctl(a->epfd, EPOLL_CTL_ADD, a->wakefd, &ev) == 0);
    pthread_mutex_init(&a->log_mu, NULL);
    kvl_cond_init(&a->log_cv);
    pthread_mutex_init(&a->stage_mu, NULL);
    a->scratch_len = 256u << 10;
    a->scratch = malloc(a->scratch_len);
    CHECK(ops->start(a, io_threads) == KVL_OK);
    memset(&H, 0, sizeof H);
    return a;
}

static void agent_free(kvl_agent *a)
{
    ops->stop(a); /* every endpoint is freed by now */
    kvl_stage_pool_destroy(a);
    close(a->wakefd);
    close(a->epfd);
    free(a->scratch);
    pthread_mutex_destroy(&a->log_mu);
    pthread_cond_destroy(&a->log_cv);
    pthread_mutex_destroy(&a->stage_mu);
    free(a);
}

/* One wakeup of the engine: the events of at most 16 endpoints (only's,
 * when given: the others wait), then what the I/O threads finished. */
static void loop_once(kvl_agent *a, int timeout_ms, const kvl_ep *only)
{
    struct epoll_event ev[16];
    int n = epoll_wait(a->epfd, ev, 16, timeout_ms);
    for (int i = 0; i < n; i++) {
        if (ev[i].data.ptr == &wake_tag) {
            uint64_t v;
            ssize_t rc = read(a->wakefd, &v, sizeof v);
            (void)rc;
            continue;
        }
        kvl_ep *ep = ev[i].data.ptr;
        if (only && ep != only && ep->aux_owner != only)
            continue;
        ops->on_event(ep, ev[i].events);
    }
    ops->progress(a);
}

/* Runs the loop until cond holds or ms passed; evaluates to cond. */
#define RUN_UNTIL_ONLY(a, only, ms, cond)                                                 \
    ({                                                                                    \
        uint64_t d_ = kvl_now_ns() + (uint64_t)(ms) * 1000000ull;                         \
        while (!(cond) && kvl_now_ns() < d_)                                              \
            loop_once((a), 5, (only));                                                    \
        !!(cond);                                                                         \
    })
#define RUN_UNTIL(a, ms, cond) RUN_UNTIL_ONLY(a, NULL, ms, cond)

static void run_for(kvl_agent *a, int ms, const kvl_ep *only)
{
    uint64_t d = kvl_now_ns() + (uint64_t)ms * 1000000ull;
    while (kvl_now_ns() < d)
        loop_once(a, 2, only);
}

static uint64_t deadline(void) { return kvl_now_ns() + (uint64_t)WAIT_MS * 1000000ull; }

/* ---- two ends of one connection ---- */

typedef struct pair {
    kvl_agent *a;
    kvl_ep *l, *tx, *rx; /* listener; the connecting end; the accepted end */
    kvl_conn *ctx, *crx;
    int tx_attached;
} pair;

static int pair_attach_tx(pair *p)
{
    p->ctx = conn_new(p->a, p->tx);
    p->tx_attached = ops->attach(p->tx, p->ctx) == KVL_OK;
    return p->tx_attached;
}

/* Listens on 127.0.0.1, port 0, connects (detached, blocking) and waits for
 * the accept; attaches the connecting end when asked.  1 on success. */
static int pair_open(kvl_agent *a, pair *p, int attach_tx)
{
    memset(p, 0, sizeof *p);
    p->a = a;
    uint16_t port = 0;
    if (!CHECK(ops->listen(a, "127.0.0.1", &port, &p->l) == KVL_OK) || !CHECK(port != 0))
        return 0;
    if (!CHECK(ops->connect(a, "127.0.0.1", "127.0.0.1", port, 2000, &p->tx) == KVL_OK))
        return 0;
    int before = H.n_accepted;
    if (!CHECK(RUN_UNTIL(a, WAIT_MS, H.n_accepted > before)))
        return 0;
    p->crx = H.accepted[before];
    p->rx = p->crx->ep;
    return attach_tx ? CHECK(pair_attach_tx(p)) : 1;
}

static void pair_close(pair *p)
{
    if (p->tx) {
        if (p->tx_attached) {
            if (!p->ctx->closed)
                ops->close(p->tx, 1);
            ops->free(p->tx);
        } else {
            ops->discard(p->tx);
        }
    }
    if (p->rx) {
        if (!p->crx->closed)
            ops->close(p->rx, 1);
        ops->free(p->rx);
    }
    if (p->l) {
        ops->close(p->l, 0);
        ops->free(p->l);
    }
    conn_free(p->ctx);
    conn_free(p->crx);
    H.n_accepted = 0;
    H.tx_mover = NULL;
}

/* ---- frames ---- */

static kvl_buf frame_token(uint8_t type, uint64_t token)
{
    kvl_buf b = {0};
    kvl_frame_start(&b);
    kvl_enc_token(&b, token);
    kvl_frame_finish(&b, type, 0);
    return b;
}

static kvl_buf frame_bytes(uint8_t type, const void *body, size_t n, uint64_t payload_len)
{
    kvl_buf b = {0};
    kvl_frame_start(&b);
    kvl_buf_put(&b, body, n);
    kvl_frame_finish(&b, type, payload_len);
    return b;
}

static kvl_buf frame_chunk(uint8_t type, uint64_t xid, uint32_t chunk, uint64_t payload_len)
{
    kvl_buf b = {0};
    kvl_frame_start(&b);
    kvl_enc_chunk(&b, xid, chunk, 1, 0);
    kvl_frame_finish(&b, type, payload_len);
    return b;
}

static int send_ctrl(kvl_ep *ep, kvl_buf head)
{
    kvl_tp_frame f = {.head = head};
    return ops->send(ep, &f);
}

/* Queues DATA (xid, chunk, attempt 1) over v[0..n) (len bytes), holding t. */
static int send_chunk(kvl_ep *ep, uint64_t xid, uint32_t chunk, const struct iovec *v, int n,
                      uint64_t len, tok *t, int stage)
{
    kvl_tp_frame f = {.head = frame_chunk(KVL_F_DATA, xid, chunk, len)};
    if (n) {
        f.payload = malloc((size_t)n * sizeof *v);
        memcpy(f.payload, v, (size_t)n * sizeof *v);
    }
    f.n_payload = n;
    f.payload_len = len;
    f.is_chunk = 1;
    f.xid = xid;
    f.chunk = chunk;
    f.attempt = 1;
    f.hold.xfer = (struct kvl_xfer *)(void *)t;
    f.stage = stage;
    return ops->send(ep, &f);
}

static uint32_t ld_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t ld_u64(const uint8_t *p) { return ld_u32(p) | (uint64_t)ld_u32(p + 4) << 32; }

static void st_u32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void st_u64(uint8_t *p, uint64_t v)
{
    st_u32(p, (uint32_t)v);
    st_u32(p + 4, (uint32_t)(v >> 32));
}

/* The chunk index of received frame i (a DATA body from frame_chunk). */
static uint32_t frame_chunk_of(const kvl_conn *c, int i)
{
    return c->hdr[i].body_len >= 16 ? ld_u32(c->body[i] + 8) : UINT32_MAX;
}

static int count_type(const kvl_conn *c, uint8_t type)
{
    int n = 0;
    for (int i = 0; i < c->n_frames && i < MAX_FRAMES; i++)
        n += c->hdr[i].type == type;
    return n;
}

/* ---- memory ---- */

/* Cuts [p, p + len) into n pieces of random sizes (each at least 1 byte). */
static void split(uint8_t *p, size_t len, int n, struct iovec *out, test_rng *r)
{
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        size_t rest = len - off, left = (size_t)(n - i - 1);
        size_t take = i == n - 1 ? rest : (size_t)rng_range(r, 1, 2 * rest / (size_t)(n - i));
        if (take > rest - left)
            take = rest - left;
        if (take == 0)
            take = 1;
        out[i] = (struct iovec){p + off, take};
        off += take;
    }
}

/* A sink of n separately allocated pieces summing to len, filled with fill. */
static void sink_alloc(kvl_conn *c, size_t len, int n, uint8_t fill, test_rng *r)
{
    struct iovec v[MAX_SINK];
    split(NULL, len, n, v, r);
    for (int i = 0; i < n; i++) {
        c->sink[i].iov_len = v[i].iov_len;
        c->sink[i].iov_base = malloc(v[i].iov_len);
        memset(c->sink[i].iov_base, fill, v[i].iov_len);
    }
    c->nsink = n;
}

static void sink_free(kvl_conn *c)
{
    for (int i = 0; i < c->nsink; i++)
        free(c->sink[i].iov_base);
    c->nsink = 0;
}

/* The sink's bytes, contiguous (malloc'd). */
static uint8_t *sink_gather(const kvl_conn *c, size_t *len)
{
    size_t n = 0;
    for (int i = 0; i < c->nsink; i++)
        n += c->sink[i].iov_len;
    uint8_t *out = malloc(n ? n : 1), *p = out;
    for (int i = 0; i < c->nsink; i++) {
        memcpy(p, c->sink[i].iov_base, c->sink[i].iov_len);
        p += c->sink[i].iov_len;
    }
    *len = n;
    return out;
}

static int all_bytes(const uint8_t *p, size_t n, uint8_t v)
{
    for (size_t i = 0; i < n; i++)
        if (p[i] != v)
            return 0;
    return 1;
}

static size_t first_diff(const uint8_t *a, const uint8_t *b, size_t n)
{
    size_t i = 0;
    while (i < n && a[i] == b[i])
        i++;
    return i;
}

/* ep's payload bytes in so far: a peek into the stream's state, under jmu
 * (an I/O thread moves them under it). */
static uint64_t rx_got(kvl_ep *ep)
{
    pthread_mutex_lock(&ep->jmu);
    uint64_t v = ep->pay_got;
    pthread_mutex_unlock(&ep->jmu);
    return v;
}

/* ------------------------------------------------------------------ */
/* Test movers                                                         */
/* ------------------------------------------------------------------ */

#define COVER_MAGIC 0x31766f6374736574ull /* "testcov1", little-endian */

struct kvl_mover {
    /* receiver-pulled: the source the pulls copy from (the sender's memory) */
    const uint8_t *src;
    size_t src_len, cur;
    int begins, pulls, skips;
    int fault_at;          /* the pull that fails with EFAULT (1-based), 0: none */
    int send_side;         /* covers the frames sent (pm_post) */
    /* one-sided: the receiver's memory the posts copy into */
    kvl_ep *ep;
    int efd;               /* its event source (watch_fd): the test signals "writes done" */
    uint8_t *dst;
    size_t dst_len;
    int posts;
    uint64_t ticket;       /* the last ticket given */
    uint64_t done_upto;    /* tickets up to this one are complete */
    int wait_ret, wait_calls, fences;
    int freed;
};

static int mover_freed(const struct kvl_mover *m) { return m->freed; }

static void mv_note(const kvl_mover *m, char *out, size_t len)
{
    (void)m;
    snprintf(out, len, "test mover");
}

static kvl_err pm_rx_begin(kvl_mover *m, const uint8_t *cover, size_t len, uint64_t payload_len)
{
    m->begins++;
    if (len == 24 && ld_u64(cover) == COVER_MAGIC && ld_u64(cover + 8) == payload_len) {
        /* a cover from pm_post: the sender's memory is this process's */
        m->src = (const uint8_t *)(uintptr_t)ld_u64(cover + 16);
        m->src_len = (size_t)payload_len;
    } else if (len != 16 || ld_u64(cover) != COVER_MAGIC || ld_u64(cover + 8) != payload_len ||
               payload_len != m->src_len)
        return kvl_fail(KVL_ERR_PROTOCOL, "test mover: cover refused");
    m->cur = 0;
    return KVL_OK;
}

static ssize_t pm_pull(kvl_mover *m, const struct iovec *v, int n)
{
    if (++m->pulls == m->fault_at) {
        errno = EFAULT;
        return -1;
    }
    size_t got = 0;
    for (int i = 0; i < n; i++) {
        size_t take = v[i].iov_len < m->src_len - m->cur ? v[i].iov_len : m->src_len - m->cur;
        memcpy(v[i].iov_base, m->src + m->cur, take);
        m->cur += take;
        got += take;
        if (take < v[i].iov_len)
            break;
    }
    return (ssize_t)got;
}

static void pm_skip(kvl_mover *m, size_t len)
{
    m->skips++;
    m->cur += len;
}

static int pm_covers(const kvl_mover *m, const kvl_tp_frame *f)
{
    (void)f;
    return m->send_side;
}

/* The sending side: the cover names the payload's memory (one piece). */
static kvl_err pm_post(kvl_mover *m, kvl_mv_send *s)
{
    m->posts++;
    if (s->n_src != 1)
        return kvl_fail(KVL_ERR_INVALID_ARG, "test mover: one source piece only");
    s->crc = kvl_crc32c(0, s->src[0].iov_base, s->src[0].iov_len);
    s->cover = malloc(24);
    s->cover_len = 24;
    st_u64(s->cover, COVER_MAGIC);
    st_u64(s->cover + 8, s->src[0].iov_len);
    st_u64(s->cover + 16, (uint64_t)(uintptr_t)s->src[0].iov_base);
    s->ticket = 0;
    return KVL_OK;
}

static int pm_ready(kvl_mover *m, uint64_t ticket, char *why, size_t why_len)
{
    (void)m;
    (void)ticket;
    (void)why;
    (void)why_len;
    return 1; /* nothing to wait for: the receiver copies */
}

static void mv_free(kvl_mover *m, uint32_t timeout_ms)
{
    (void)timeout_ms;
    if (m->efd >= 0) {
        ops->unwatch_fd(m->ep, m->efd);
        close(m->efd);
        m->efd = -1;
    }
    m->freed++;
}

static const kvl_mover_ops pull_mover = {
    .name = "testpull",
    .label = "testpull",
    .what = "test pulls",
    .kind = KVL_MOVER_FAULT,
    .caps = KVL_MV_RECEIVER_PULLED,
    .note = mv_note,
    .covers = pm_covers,
    .post = pm_post,
    .ready = pm_ready,
    .rx_begin = pm_rx_begin,
    .pull = pm_pull,
    .skip = pm_skip,
    .pull_what = "test pull",
    .free = mv_free,
};

static void os_event(void *arg)
{
    kvl_mover *m = arg;
    uint64_t v;
    ssize_t rc = read(m->efd, &v, sizeof v);
    (void)rc;
}

static int os_attach(kvl_mover *m, kvl_ep *ep)
{
    m->ep = ep;
    m->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (m->efd < 0 || ops->watch_fd(ep, m->efd, os_event, m) != 0)
        return -1;
    return 0;
}

static int os_covers(const kvl_mover *m, const kvl_tp_frame *f)
{
    (void)f;
    return m->dst != NULL; /* the sending side's mover */
}

static kvl_err os_post(kvl_mover *m, kvl_mv_send *s)
{
    m->posts++;
    uint32_t crc = 0;
    size_t off = 0;
    for (int i = 0; i < s->n_src; i++) {
        if (off + s->src[i].iov_len <= m->dst_len)
            memcpy(m->dst + off, s->src[i].iov_base, s->src[i].iov_len);
        off += s->src[i].iov_len;
        crc = kvl_crc32c(crc, s->src[i].iov_base, s->src[i].iov_len);
    }
    s->crc = crc;
    s->cover = NULL;
    s->cover_len = 0;
    s->ticket = ++m->ticket;
    return KVL_OK;
}

static int os_ready(kvl_mover *m, uint64_t ticket, char *why, size_t why_len)
{
    (void)why;
    (void)why_len;
    return ticket <= m->done_upto;
}

static int os_wait(kvl_mover *m, uint64_t ticket, uint64_t deadline_ns)
{
    (void)ticket;
    (void)deadline_ns;
    m->wait_calls++;
    return m->wait_ret;
}

static void os_fence(kvl_mover *m, const char *why)
{
    (void)why;
    m->fences++;
}

static const kvl_mover_ops put_mover = {
    .name = "testput",
    .label = "testput",
    .what = "test puts",
    .kind = KVL_MOVER_FAULT,
    .caps = KVL_MV_ONE_SIDED | KVL_MV_NO_HEDGE,
    .note = mv_note,
    .attach = os_attach,
    .covers = os_covers,
    .post = os_post,
    .ready = os_ready,
    .wait = os_wait,
    .fence = os_fence,
    .free = mv_free,
};

/* Tells m its writes up to ticket are complete, through its event source. */
static void os_complete(kvl_mover *m, uint64_t ticket)
{
    m->done_upto = ticket;
    uint64_t one = 1;
    ssize_t rc = write(m->efd, &one, sizeof one);
    (void)rc;
}

/* ------------------------------------------------------------------ */
/* Cases                                                               */
/* ------------------------------------------------------------------ */

/* 1. Handshake helpers, attach, frames without a payload both ways. */
static void case_frames(void)
{
    kvl_agent *a = agent_new(0, 0);
    pair p;
    if (!pair_open(a, &p, 0))
        goto out;
    /* the initiator's blocking helpers on its detached end: a PING out... */
    kvl_buf ping = frame_token(KVL_F_PING, 0x1122334455667788ull);
    CHECK(ops->send_all(p.tx, ping.p, ping.len, deadline()) == KVL_OK);
    CHECK(RUN_UNTIL(a, WAIT_MS, p.crx->n_frames == 1));
    CHECK(p.crx->hdr[0].type == KVL_F_PING && p.crx->hdr[0].body_len == 8 &&
          p.crx->hdr[0].payload_len == 0 && p.crx->hdr[0].flags == 0);
    CHECK(p.crx->n_frames == 1 && memcmp(p.crx->body[0], ping.p + KVL_HDR_BYTES, 8) == 0);
    kvl_buf_free(&ping);
    /* ...and the listener's answer through the stream, read with recv_all */
    CHECK(send_ctrl(p.rx, frame_token(KVL_F_PONG, 42)) == 0);
    size_t qb = 0;
    /* what it holds: the head and the frame's own struct */
    CHECK(ops->queued(p.rx, &qb) == 1 && qb > KVL_HDR_BYTES + 8 + 64 && qb < 4096 &&
          ops->has_output(p.rx));
    CHECK(RUN_UNTIL(a, WAIT_MS, !ops->has_output(p.rx)));
    uint8_t hdr[KVL_HDR_BYTES], body[8];
    kvl_frame_hdr h;
    CHECK(ops->recv_all(p.tx, hdr, sizeof hdr, deadline()) == KVL_OK);
    CHECK(kvl_hdr_decode(hdr, &h) == KVL_OK && h.type == KVL_F_PONG && h.body_len == 8);
    CHECK(ops->recv_all(p.tx, body, sizeof body, deadline()) == KVL_OK && ld_u64(body) == 42);
    /* nothing more is there: recv_all times out at its deadline */
    CHECK(ops->recv_all(p.tx, body, 1, kvl_now_ns() + 20000000ull) == KVL_ERR_TIMEOUT);

    /* attached, both ways: a 3000-byte body, an empty one, and one the other way */
    if (!CHECK(pair_attach_tx(&p)))
        goto out;
    uint8_t big[3000];
    test_rng r = {1};
    rng_fill(&r, big, sizeof big);
    CHECK(send_ctrl(p.tx, frame_bytes(KVL_F_NOTIFY, big, sizeof big, 0)) == 0);
    CHECK(send_ctrl(p.tx, frame_bytes(KVL_F_REGIONS_REQ, NULL, 0, 0)) == 0);
    CHECK(send_ctrl(p.rx, frame_token(KVL_F_PING, 7)) == 0);
    CHECK(RUN_UNTIL(a, WAIT_MS, p.crx->n_frames == 3 && p.ctx->n_frames == 1));
    CHECK(p.crx->hdr[1].type == KVL_F_NOTIFY && p.crx->hdr[1].body_len == sizeof big &&
          memcmp(p.crx->body[1], big, sizeof big) == 0);
    CHECK(p.crx->hdr[2].type == KVL_F_REGIONS_REQ && p.crx->hdr[2].body_len == 0);
    CHECK(p.ctx->hdr[0].type == KVL_F_PING && ld_u64(p.ctx->body[0]) == 7);
    CHECK(p.crx->n_errors == 0 && p.ctx->n_errors == 0 && p.crx->n_payloads == 0);
    struct sockaddr_storage l, pe;
    CHECK(ops->addrs(p.tx, &l, &pe) == 0 && l.ss_family == AF_INET);
    char note[64];
    CHECK(ops->note(p.tx, note, sizeof note) == 0 && note[0] == 0);
    CHECK(ops->mover(p.tx, &(kvl_mover *){0}) == NULL);
    /* the peer goes: the other end hears of it */
    ops->close(p.tx, 0);
    p.ctx->closed = 1;
    CHECK(RUN_UNTIL(a, WAIT_MS, p.crx->n_errors == 1));
    CHECK(p.crx->err == KVL_ERR_CONN_LOST);
out:
    pair_close(&p);
    agent_free(a);
}

/* 2. A large chunk frame over many iovecs into a sink of several pieces. */
static void case_chunk(uint32_t io_threads)
{
    kvl_agent *a = agent_new(io_threads, 0);
    pair p;
    test_rng r = {20 + io_threads};
    size_t len = (6u << 20) + 777;
    uint8_t *src = malloc(len);
    rng_fill(&r, src, len);
    if (!pair_open(a, &p, 1))
        goto out;
    for (int stage = 0; stage <= 1; stage++) {
        struct iovec v[150];
        split(src, len, 150, v, &r);
        sink_alloc(p.crx, len, 5, 0xEE, &r);
        tok t = {0};
        int base = p.crx->n_payloads;
        CHECK(send_chunk(p.tx, 9, (uint32_t)stage, v, 150, len, &t,
                         stage ? KVL_STAGE_MEMCPY : KVL_STAGE_NONE) == 0);
        CHECK(send_ctrl(p.tx, frame_token(KVL_F_PING, 5)) == 0); /* the stream stays in step */
        CHECK(RUN_UNTIL(a, WAIT_MS, p.crx->n_payloads == base + 1 &&
                                        p.crx->n_frames == 2 * base + 2 && t.released));
        size_t got_len;
        uint8_t *got = sink_gather(p.crx, &got_len);
        CHECKF(got_len == len && memcmp(got, src, len) == 0, "stage %d: first difference at %zu",
               stage, first_diff(got, src, len));
        free(got);
        CHECK(p.crx->crc[base] == p.crx->trailer[base]);
        CHECK(p.crx->crc[base] == kvl_crc32c(0, src, len));
        CHECK(p.crx->hdr[2 * base].type == KVL_F_DATA && p.crx->hdr[2 * base].payload_len == len);
        CHECK(p.crx->hdr[2 * base + 1].type == KVL_F_PING);
        CHECK(t.released == 1);
        CHECK_EQ_U64(ops->bytes_sent(p.tx), (uint64_t)len * (stage + 1));
        CHECK_EQ_U64(ops->bytes_recv(p.rx), (uint64_t)len * (stage + 1));
        CHECK(ops->bytes_put(p.tx) == 0 && ops->bytes_put(p.rx) == 0);
        CHECK(p.crx->n_errors == 0 && p.ctx->n_errors == 0);
        sink_free(p.crx);
    }
    kvl_tp_sample s;
    CHECK(ops->sample(p.tx, &s) == 0);
out:
    pair_close(&p);
    free(src);
    agent_free(a);
}

/* 3. Cancel: an unstarted chunk never goes; one part-way out ends as zeros
 * with a trailer that cannot verify; drop_unstarted leaves control frames. */
static void case_cancel(uint32_t io_threads)
{
    /* small socket buffers: an 8 MiB payload is surely part-way out when the
     * receiver does not read */
    kvl_agent *a = agent_new(io_threads, 128 << 10);
    pair p;
    test_rng r = {30 + io_threads};
    size_t len = 8u << 20;
    uint8_t *src = malloc(len), small[4096];
    rng_fill(&r, src, len);
    rng_fill(&r, small, sizeof small);
    if (!pair_open(a, &p, 1))
        goto out;
    struct iovec va[32], vb = {small, sizeof small};
    split(src, len, 32, va, &r);
    sink_alloc(p.crx, len, 4, 0xEE, &r);
    tok ta = {0}, tb = {0};
    CHECK(send_chunk(p.tx, 1, 0, va, 32, len, &ta, 0) == 0);
    CHECK(send_chunk(p.tx, 1, 1, &vb, 1, sizeof small, &tb, 0) == 0);
    CHECK(send_ctrl(p.tx, frame_token(KVL_F_PING, 3)) == 0);
    /* not started: gone at once, released at once; unknown copies: not found */
    CHECK(ops->cancel(p.tx, 1, 1, 1) == 1 && tb.released == 1);
    CHECK(ops->cancel(p.tx, 1, 1, 1) == 0 && ops->cancel(p.tx, 1, 0, 2) == 0);
    size_t qb;
    CHECK(ops->queued(p.tx, &qb) == 2);
    /* A starts; the receiver does not read, so it blocks part-way */
    CHECK(RUN_UNTIL_ONLY(a, p.tx, WAIT_MS, ops->bytes_sent(p.tx) > 0));
    run_for(a, 50, p.tx);
    uint64_t s = ops->bytes_sent(p.tx);
    CHECKF(s > 0 && s < len / 2, "sent %llu of %zu before the cancel", (unsigned long long)s,
           len);
    p.ctx->in_call = 1;
    CHECK(ops->cancel(p.tx, 1, 0, 1) == 1);
    p.ctx->in_call = 0;
    CHECK(ta.released == 1 && !p.ctx->upcall_in_call);
    CHECK(ops->cancel(p.tx, 1, 0, 1) == 1); /* still going out: found, nothing more */
    CHECK(ta.released == 1);
    CHECK(RUN_UNTIL(a, WAIT_MS, p.crx->n_payloads == 1 && p.crx->n_frames == 2 &&
                                    !ops->has_output(p.tx)));
    CHECK(count_type(p.crx, KVL_F_DATA) == 1 && frame_chunk_of(p.crx, 0) == 0);
    CHECK(p.crx->hdr[1].type == KVL_F_PING);
    size_t got_len;
    uint8_t *got = sink_gather(p.crx, &got_len);
    size_t k = first_diff(got, src, len);
    CHECKF(k >= s && k < len && all_bytes(got + k, len - k, 0),
           "cut at %zu (sent %llu before the cancel)", k, (unsigned long long)s);
    if (!io_threads) /* no other thread sent meanwhile: the zeros start exactly there */
        CHECK(all_bytes(got + s, len - s, 0));
    free(got);
    CHECK(p.crx->crc[0] != p.crx->trailer[0]);
    CHECK(ta.released == 1 && tb.released == 1);
    CHECK(p.crx->n_errors == 0 && p.ctx->n_errors == 0);
    sink_free(p.crx);

    /* drop_unstarted (close): chunk frames go, control frames stay */
    tok td = {0}, tf = {0};
    CHECK(send_chunk(p.tx, 2, 0, &vb, 1, sizeof small, &td, 0) == 0);
    CHECK(send_ctrl(p.tx, frame_token(KVL_F_PING, 4)) == 0);
    CHECK(send_chunk(p.tx, 2, 1, &vb, 1, sizeof small, &tf, 0) == 0);
    ops->drop_unstarted(p.tx);
    CHECK(td.released == 1 && tf.released == 1 && ops->queued(p.tx, &qb) == 1);
    CHECK(send_ctrl(p.tx, frame_token(KVL_F_PING, 6)) == 0); /* the queue's tail is right */
    CHECK(RUN_UNTIL(a, WAIT_MS, p.crx->n_frames == 4 && !ops->has_output(p.tx)));
    run_for(a, 20, NULL);
    CHECK(p.crx->n_frames == 4 && p.crx->hdr[2].type == KVL_F_PING &&
          ld_u64(p.crx->body[2]) == 4 && ld_u64(p.crx->body[3]) == 6);
    CHECK(p.crx->n_payloads == 1 && p.crx->n_errors == 0);
out:
    pair_close(&p);
    free(src);
    agent_free(a);
}

/* 4. Revocation mid-payload: drained from there on, the sink untouched. */
static void case_revoke(uint32_t io_threads)
{
    kvl_agent *a = agent_new(io_threads, 0);
    pair p;
    test_rng r = {40 + io_threads};
    size_t len = 4u << 20, first = 1u << 20;
    uint8_t *src = malloc(len);
    rng_fill(&r, src, len);
    if (!pair_open(a, &p, 0)) /* the sender's bytes are the test's own: paced */
        goto out;
    sink_alloc(p.crx, len, 3, 0xEE, &r);
    kvl_buf head = frame_chunk(KVL_F_DATA, 3, 0, len);
    CHECK(ops->send_all(p.tx, head.p, head.len, deadline()) == KVL_OK);
    CHECK(ops->send_all(p.tx, src, first, deadline()) == KVL_OK);
    kvl_buf_free(&head);
    CHECK(RUN_UNTIL(a, WAIT_MS, p.crx->n_frames == 1 && rx_got(p.rx) > 0));
    uint64_t before = rx_got(p.rx); /* all of these landed */
    /* the core revokes: payload_live answers 0 from now on, and revoke()
     * returns once no thread places bytes of it */
    p.crx->live = 0;
    ops->revoke(p.rx);
    uint8_t trailer[4];
    st_u32(trailer, kvl_crc32c(0, src, len));
    kvl_buf ping = frame_token(KVL_F_PING, 8);
    CHECK(ops->send_all(p.tx, src + first, len - first, deadline()) == KVL_OK);
    CHECK(ops->send_all(p.tx, trailer, 4, deadline()) == KVL_OK);
    CHECK(ops->send_all(p.tx, ping.p, ping.len, deadline()) == KVL_OK);
    kvl_buf_free(&ping);
    CHECK(RUN_UNTIL(a, WAIT_MS, p.crx->n_payloads == 1 && p.crx->n_frames == 2));
    CHECK(p.crx->hdr[1].type == KVL_F_PING && p.crx->n_errors == 0);
    size_t got_len;
    uint8_t *got = sink_gather(p.crx, &got_len);
    size_t k = first_diff(got, src, len);
    CHECKF(before > 0 && k >= before && k <= first && all_bytes(got + k, len - k, 0xEE),
           "%llu bytes in before the revocation, the sink differs from %zu on",
           (unsigned long long)before, k);
    free(got);
    CHECK_EQ_U64(ops->bytes_recv(p.rx), len);
    sink_free(p.crx);
out:
    pair_close(&p);
    free(src);
    agent_free(a);
}

/* Writes a raw OOB DATA header (its body from frame_chunk) on tx. */
static void raw_oob_head(pair *p, uint64_t payload_len)
{
    kvl_buf head = frame_chunk(KVL_F_DATA, 5, 0, payload_len);
    head.p[6] |= KVL_HF_OOB;
    CHECK(ops->send_all(p->tx, head.p, head.len, deadline()) == KVL_OK);
    kvl_buf_free(&head);
}

/* 5. Hostile bytes on the receive side; a receiver-pulled mover's frames. */
static void case_hostile(uint32_t io_threads)
{
    kvl_agent *a = agent_new(io_threads, 0);
    pair p;
    test_rng r = {50 + io_threads};
    uint8_t hdr[KVL_HDR_BYTES], body[2048] = {0};

    /* a body at kvl_proto_max_body is taken; one byte more is refused */
    if (pair_open(a, &p, 0)) {
        p.crx->max_body = 1024;
        kvl_frame_hdr h = {.type = KVL_F_NOTIFY, .body_len = 1024};
        kvl_hdr_encode(hdr, &h);
        CHECK(ops->send_all(p.tx, hdr, sizeof hdr, deadline()) == KVL_OK);
        CHECK(ops->send_all(p.tx, body, 1024, deadline()) == KVL_OK);
        h.body_len = 1025;
        kvl_hdr_encode(hdr, &h);
        CHECK(ops->send_all(p.tx, hdr, sizeof hdr, deadline()) == KVL_OK);
        CHECK(ops->send_all(p.tx, body, 1025, deadline()) == KVL_OK);
        CHECK(RUN_UNTIL(a, WAIT_MS, p.crx->n_errors == 1));
        CHECK(p.crx->n_frames == 1 && p.crx->err == KVL_ERR_PROTOCOL &&
              strstr(p.crx->why, "1025") != NULL);
    }
    pair_close(&p);

    /* another protocol version in the first header: on_version, not on_error */
    if (pair_open(a, &p, 0)) {
        kvl_frame_hdr h = {.type = KVL_F_HELLO, .body_len = 8};
        kvl_hdr_encode(hdr, &h);
        hdr[4] = KVL_PROTO_VERSION - 1;
        CHECK(ops->send_all(p.tx, hdr, sizeof hdr, deadline()) == KVL_OK);
        CHECK(RUN_UNTIL(a, WAIT_MS, p.crx->n_version == 1));
        CHECK(p.crx->n_errors == 0 && p.crx->n_frames == 0);
    }
    pair_close(&p);

    /* not a kvlink frame at all */
    if (pair_open(a, &p, 0)) {
        memset(hdr, 0x5a, sizeof hdr);
        CHECK(ops->send_all(p.tx, hdr, sizeof hdr, deadline()) == KVL_OK);
        CHECK(RUN_UNTIL(a, WAIT_MS, p.crx->n_errors == 1));
        CHECK(p.crx->err == KVL_ERR_PROTOCOL && p.crx->n_frames == 0 && p.crx->n_version == 0);
    }
    pair_close(&p);

    /* header flag OOB on a stream without a mover */
    if (pair_open(a, &p, 0)) {
        raw_oob_head(&p, 4096);
        CHECK(RUN_UNTIL(a, WAIT_MS, p.crx->n_errors == 1));
        CHECK(p.crx->err == KVL_ERR_PROTOCOL && p.crx->n_frames == 1 &&
              p.crx->n_payloads == 0);
    }
    pair_close(&p);

    /* a cover longer than any mover's */
    kvl_mover m = {.efd = -1};
    if (pair_open(a, &p, 0)) {
        ops->set_mover(p.rx, &pull_mover, &m, NULL);
        raw_oob_head(&p, 4096);
        uint8_t cl[4];
        st_u32(cl, KVL_MAX_COVER + 1);
        CHECK(ops->send_all(p.tx, cl, 4, deadline()) == KVL_OK);
        CHECK(RUN_UNTIL(a, WAIT_MS, p.crx->n_errors == 1));
        CHECK(p.crx->err == KVL_ERR_PROTOCOL && m.begins == 0 && m.pulls == 0);
        CHECK(m.freed == 1); /* the close freed the mover */
    }
    pair_close(&p);

    /* valid covers: pulled bytes land and verify; a refused cover fails the
     * connection; a gone source (EFAULT) cannot verify */
    size_t len = (3u << 20) + 5;
    uint8_t *src = malloc(len);
    rng_fill(&r, src, len);
    uint8_t cov[4 + 16], trailer[4];
    st_u32(cov, 16);
    st_u64(cov + 4, COVER_MAGIC);
    st_u64(cov + 12, len);
    st_u32(trailer, kvl_crc32c(0, src, len));
    for (int fault = 0; fault <= 1; fault++) {
        m = (kvl_mover){.efd = -1, .src = src, .src_len = len, .fault_at = fault ? 3 : 0};
        if (!pair_open(a, &p, 0))
            break;
        ops->set_mover(p.rx, &pull_mover, &m, NULL);
        char note[64];
        CHECK(ops->note(p.rx, note, sizeof note) == 1 && strcmp(note, "test mover") == 0);
        sink_alloc(p.crx, len, 3, 0xEE, &r);
        raw_oob_head(&p, len);
        CHECK(ops->send_all(p.tx, cov, sizeof cov, deadline()) == KVL_OK);
        CHECK(ops->send_all(p.tx, trailer, 4, deadline()) == KVL_OK);
        CHECK(RUN_UNTIL(a, WAIT_MS, p.crx->n_payloads == 1 || p.crx->n_errors));
        CHECK(p.crx->n_errors == 0 && m.begins == 1);
        if (!fault) {
            size_t got_len;
            uint8_t *got = sink_gather(p.crx, &got_len);
            CHECK(memcmp(got, src, len) == 0);
            free(got);
            CHECK(p.crx->crc[0] == p.crx->trailer[0] && m.pulls >= 6 && m.skips == 0);
        } else {
            CHECK(p.crx->crc[0] != p.crx->trailer[0] && m.pulls == 3 && m.skips >= 1 &&
                  m.cur == len);
        }
        CHECK_EQ_U64(ops->bytes_recv(p.rx), len);
        /* the next cover is one the mover refuses */
        raw_oob_head(&p, len);
        st_u64(cov + 4, COVER_MAGIC + 1);
        CHECK(ops->send_all(p.tx, cov, sizeof cov, deadline()) == KVL_OK);
        st_u64(cov + 4, COVER_MAGIC);
        CHECK(RUN_UNTIL(a, WAIT_MS, p.crx->n_errors == 1));
        CHECK(p.crx->err == KVL_ERR_PROTOCOL && strstr(p.crx->why, "cover refused") &&
              m.begins == 2 && p.crx->n_payloads == 1);
        sink_free(p.crx);
        pair_close(&p);
    }
    free(src);
    agent_free(a);
}

/* 5b. A receiver-pulled mover end to end: the receiver copies from the
 * sender's memory after the frame left, so the sender holds that memory
 * until the chunk's ACK arrives (or the connection closes). */
static void case_pulled_hold(uint32_t io_threads)
{
    kvl_agent *a = agent_new(io_threads, 0);
    pair p;
    test_rng r = {55 + io_threads};
    size_t len = (2u << 20) + 11;
    uint8_t *src = malloc(len);
    rng_fill(&r, src, len);
    kvl_mover mtx = {.efd = -1, .send_side = 1}, mrx = {.efd = -1};
    if (!pair_open(a, &p, 0))
        goto out;
    ops->set_mover(p.tx, &pull_mover, &mtx, NULL);
    if (!CHECK(pair_attach_tx(&p)))
        goto out;
    ops->set_mover(p.rx, &pull_mover, &mrx, NULL);
    tok t[2] = {{0}};
    for (uint32_t i = 0; i < 2; i++) {
        struct iovec v = {src, len};
        sink_alloc(p.crx, len, 3, 0xEE, &r);
        CHECK(send_chunk(p.tx, 8, i, &v, 1, len, &t[i], 0) == 0);
        CHECK(RUN_UNTIL(a, WAIT_MS, p.crx->n_payloads == (int)i + 1 && !ops->has_output(p.tx)));
        size_t got_len;
        uint8_t *got = sink_gather(p.crx, &got_len);
        CHECK(memcmp(got, src, len) == 0 && p.crx->crc[i] == p.crx->trailer[i]);
        CHECK(p.crx->hdr[i].flags & KVL_HF_OOB);
        free(got);
        sink_free(p.crx);
        run_for(a, 20, NULL);
        CHECK(t[i].released == 0); /* left, verified, but not acknowledged */
    }
    CHECK(mtx.posts == 2 && mrx.begins == 2 && mrx.pulls >= 8);
    CHECK_EQ_U64(ops->bytes_sent(p.tx), 2 * (uint64_t)len);
    /* the first chunk's ACK lets go of its memory; the second's never comes */
    kvl_msg_status st = {.xfer = 8, .chunk = 0, .attempt = 1};
    kvl_buf ack = {0};
    kvl_frame_start(&ack);
    kvl_enc_status(&ack, &st);
    kvl_frame_finish(&ack, KVL_F_ACK, 0);
    CHECK(send_ctrl(p.rx, ack) == 0);
    CHECK(RUN_UNTIL(a, WAIT_MS, p.ctx->n_frames == 1));
    CHECK(p.ctx->hdr[0].type == KVL_F_ACK && t[0].released == 1 && t[1].released == 0);
    ops->close(p.tx, 0); /* the peer reads nothing of ours any more */
    p.ctx->closed = 1;
    CHECK(t[0].released == 1 && t[1].released == 1 && mtx.freed == 1);
out:
    pair_close(&p);
    free(src);
    agent_free(a);
}

/* 6. A one-sided mover: trailer after ready(); cancel of posted writes. */
static void case_one_sided(void)
{
    kvl_agent *a = agent_new(0, 0);
    pair p;
    test_rng r = {60};
    size_t len = (1u << 20) + 3;
    uint8_t *src = malloc(len);
    rng_fill(&r, src, len);
    kvl_mover mtx = {.efd = -1, .wait_ret = 1}, mrx = {.efd = -1};
    /* the receiver's memory the puts land in: its sink, two adjacent pieces */
    uint8_t *dst = malloc(len);
    memset(dst, 0xEE, len);
    if (!pair_open(a, &p, 0))
        goto out;
    mtx.dst = dst;
    mtx.dst_len = len;
    ops->set_mover(p.tx, &put_mover, &mtx, NULL); /* detached: before attach */
    H.tx_mover = &mtx;
    if (!CHECK(pair_attach_tx(&p)) || !CHECK(mtx.efd >= 0)) /* attach ran the mover's */
        goto out;
    ops->set_mover(p.rx, &put_mover, &mrx, NULL);
    p.crx->sink[0] = (struct iovec){dst, len / 2};
    p.crx->sink[1] = (struct iovec){dst + len / 2, len - len / 2};
    p.crx->nsink = 2;

    /* the header goes, the writes are posted; the trailer waits for ready() */
    tok t1 = {0};
    struct iovec v[7];
    split(src, len, 7, v, &r);
    CHECK(send_chunk(p.tx, 6, 0, v, 7, len, &t1, 0) == 0);
    CHECK(RUN_UNTIL(a, WAIT_MS, mtx.posts == 1 && p.crx->n_frames == 1));
    run_for(a, 100, NULL);
    CHECK(p.crx->n_payloads == 0 && ops->has_output(p.tx) && t1.released == 0);
    CHECK(p.crx->hdr[0].flags & KVL_HF_OOB);
    CHECK(memcmp(dst, src, len) == 0); /* "put" already */
    uint64_t done_seq = ++H.seq;
    os_complete(&mtx, 1);
    CHECK(RUN_UNTIL(a, WAIT_MS, p.crx->n_payloads == 1 && t1.released));
    CHECK(p.crx->payload_seq[0] > done_seq && p.crx->crc[0] == p.crx->trailer[0]);
    CHECK(p.crx->crc[0] == kvl_crc32c(0, src, len) && t1.released == 1);
    CHECK_EQ_U64(ops->bytes_put(p.tx), len);
    CHECK_EQ_U64(ops->bytes_put(p.rx), len);

    /* cancel posted, unfinished writes that wait() sees complete: the
     * memory is let go of at once, the trailer goes and cannot verify */
    tok t2 = {0};
    CHECK(send_chunk(p.tx, 6, 1, v, 7, len, &t2, 0) == 0);
    CHECK(RUN_UNTIL(a, WAIT_MS, mtx.posts == 2 && p.crx->n_frames == 2));
    run_for(a, 20, NULL);
    CHECK(p.crx->n_payloads == 1);
    p.ctx->in_call = 1;
    CHECK(ops->cancel(p.tx, 6, 1, 1) == 1);
    p.ctx->in_call = 0;
    CHECK(mtx.wait_calls == 1 && t2.released == 1 && !p.ctx->upcall_in_call);
    /* nothing else is queued and the mover's event source stays quiet: the
     * stream itself must send the trailer now */
    CHECK(RUN_UNTIL(a, WAIT_MS, p.crx->n_payloads == 2));
    CHECK(p.crx->crc[1] != p.crx->trailer[1] && p.crx->n_errors == 0 && t2.released == 1);

    /* cancel posted writes that do not complete: the hold stays, the
     * connection fails from the event loop (not inside cancel), the mover is
     * freed, then the hold is released */
    tok t3 = {0};
    mtx.wait_ret = 0;
    CHECK(send_chunk(p.tx, 6, 2, v, 7, len, &t3, 0) == 0);
    CHECK(RUN_UNTIL(a, WAIT_MS, mtx.posts == 3 && p.crx->n_frames == 3));
    p.ctx->in_call = 1;
    CHECK(ops->cancel(p.tx, 6, 2, 1) == 1);
    p.ctx->in_call = 0;
    CHECK(mtx.wait_calls == 2 && !p.ctx->upcall_in_call && p.ctx->n_errors == 0);
    CHECK(t3.released == 0 && mtx.freed == 0);
    CHECK(RUN_UNTIL(a, WAIT_MS, p.ctx->n_errors == 1));
    CHECK(p.ctx->err == KVL_ERR_CONN_LOST && strstr(p.ctx->why, "did not complete"));
    CHECK(t3.released == 1 && t3.mover_freed_at_release == 1 && mtx.freed == 1);
    CHECK(mtx.fences == 0);
out:
    pair_close(&p);
    free(dst);
    free(src);
    agent_free(a);
}

/* 6d. Revocation where the peer puts: the puts cannot be drained, so the
 * receiver's mover is fenced and freed before revoke() returns, and the
 * connection fails from the event loop (not inside revoke). */
static void case_one_sided_revoke(void)
{
    kvl_agent *a = agent_new(0, 0);
    pair p;
    kvl_mover mtx = {.efd = -1}, mrx = {.efd = -1};
    if (!pair_open(a, &p, 0))
        goto out;
    ops->set_mover(p.tx, &put_mover, &mtx, NULL);
    if (!CHECK(pair_attach_tx(&p)))
        goto out;
    ops->set_mover(p.rx, &put_mover, &mrx, NULL);
    p.crx->in_call = 1;
    ops->revoke(p.rx);
    p.crx->in_call = 0;
    kvl_mover *m = NULL;
    CHECK(mrx.fences == 1 && mrx.freed == 1 && ops->mover(p.rx, &m) == NULL && !m);
    CHECK(!p.crx->upcall_in_call && p.crx->n_errors == 0);
    char note[160];
    CHECK(ops->note(p.rx, note, sizeof note) == 0 && strstr(note, "fenced"));
    CHECK(RUN_UNTIL(a, WAIT_MS, p.crx->n_errors == 1));
    CHECK(p.crx->err == KVL_ERR_CONN_LOST && strstr(p.crx->why, "fenced"));
    /* the sender's end hears of the close */
    CHECK(RUN_UNTIL(a, WAIT_MS, p.ctx->n_errors == 1));
    CHECK(mtx.fences == 0);
out:
    pair_close(&p);
    agent_free(a);
}

/* 7. Answers a peer does not read: counted at their true memory, reading
 * paused (never an answer dropped) until they drain; the agent's budget
 * pauses only connections holding ANSWER_FLOOR. */

/* Reads what tx has (it is detached and blocking: MSG_DONTWAIT); 1 once
 * *got reached want. */
static int drain_some(kvl_ep *tx, size_t *got, size_t want)
{
    static uint8_t buf[1 << 16];
    for (;;) {
        ssize_t n = recv(tx->fd, buf, sizeof buf, MSG_DONTWAIT);
        if (n <= 0)
            break;
        *got += (size_t)n;
    }
    return *got >= want;
}

#define ANSWER_WIRE (KVL_HDR_BYTES + 8 + 8192 + 4) /* one READ_RESP of 8192 pieces, as sent */

static int send_reqs(kvl_ep *tx, int n)
{
    kvl_buf one = frame_bytes(KVL_F_READ_REQ, "request.", 8, 0);
    size_t len = one.len * (size_t)n;
    uint8_t *all = malloc(len);
    for (int i = 0; i < n; i++)
        memcpy(all + (size_t)i * one.len, one.p, one.len);
    int ok = ops->send_all(tx, all, len, deadline()) == KVL_OK;
    free(all);
    kvl_buf_free(&one);
    return ok;
}

static void case_answers(uint32_t io_threads)
{
    /* small socket buffers: the kernel holds few answers, the queue the rest */
    kvl_agent *a = agent_new(io_threads, 64 << 10);
    kvl_tcp_budget *g = kvl_tcp_budget_of(a);
    pair p;
    if (!CHECK(g) || !pair_open(a, &p, 0))
        goto out;
    p.crx->answer_pieces = 8192;
    const int n = 400; /* 400 answers: 51 MiB of iovec arrays if none paused */
    CHECK(send_reqs(p.tx, n));
    /* the peer reads nothing: the stream stops reading it once its queue
     * holds 8 MiB (64 such answers), a few hundred KiB in the kernel */
    CHECK(RUN_UNTIL(a, WAIT_MS, p.rx->ans_paused));
    run_for(a, 300, NULL);
    size_t qb = 0;
    size_t qf = ops->queued(p.rx, &qb);
    /* 64 answers read and queued, some gone into the kernel since: still
     * paused above the low mark (2 MiB) */
    CHECK(p.crx->n_frames < 100 && p.crx->n_errors == 0);
    CHECK(qb >= (2u << 20) && qb < (8u << 20) + (256u << 10));
    CHECK(g->answer_bytes == qb && g->pauses == 1);
    /* each queued answer counts its 128 KiB of iovecs */
    CHECK(qb / qf > 8192 * sizeof(struct iovec));
    /* once it reads, everything is answered: nothing was dropped */
    size_t got = 0, want = (size_t)n * ANSWER_WIRE;
    CHECK(RUN_UNTIL(a, 4 * WAIT_MS, drain_some(p.tx, &got, want)));
    CHECK(got == want && p.crx->n_frames == n && p.crx->n_errors == 0);
    CHECK(RUN_UNTIL(a, WAIT_MS, !ops->has_output(p.rx)) && !p.rx->ans_paused);
    CHECK(g->answer_bytes == 0);
    /* queued at the close: their memory is back at once */
    CHECK(send_reqs(p.tx, 100));
    CHECK(RUN_UNTIL(a, WAIT_MS, p.rx->ans_paused));
    CHECK(g->answer_bytes > 0);
    ops->close(p.rx, 1);
    p.crx->closed = 1;
    CHECK(g->answer_bytes == 0 && g->paused == NULL);
out:
    pair_close(&p);
    agent_free(a);
}

/* Over the agent's answer budget: the peer that reads nothing is paused, one
 * that reads its answers goes on (its own answers decide), and the first
 * reads again once it reads. */
static void case_answers_global(void)
{
    kvl_agent *a = agent_new(0, 64 << 10);
    kvl_tcp_budget *g = kvl_tcp_budget_of(a);
    pair p, q;
    memset(&q, 0, sizeof q);
    if (!CHECK(g) || !pair_open(a, &p, 0))
        goto out;
    g->answer_cap = 1u << 20; /* 8 answers: below one connection's own budget */
    p.crx->answer_pieces = 8192;
    const int n = 100;
    CHECK(send_reqs(p.tx, n));
    CHECK(RUN_UNTIL(a, WAIT_MS, p.rx->ans_paused == 2));
    run_for(a, 200, NULL);
    size_t qb = 0;
    ops->queued(p.rx, &qb);
    CHECK(p.crx->n_frames < n && qb < (1u << 20) + (256u << 10) && g->paused == p.rx);
    /* a second peer that reads: every answer comes although the agent is over */
    if (!CHECK(pair_open(a, &q, 0)))
        goto out;
    q.crx->answer_pieces = 8192;
    CHECK(send_reqs(q.tx, n));
    size_t got = 0, want = (size_t)n * ANSWER_WIRE;
    CHECK(RUN_UNTIL(a, 4 * WAIT_MS, drain_some(q.tx, &got, want)));
    CHECK(got == want && q.crx->n_frames == n);
    CHECK(p.crx->n_frames < n && p.rx->ans_paused == 2);
    /* the first reads: it is read again and answered in full */
    got = 0;
    CHECK(RUN_UNTIL(a, 4 * WAIT_MS, drain_some(p.tx, &got, want)));
    CHECK(got == want && p.crx->n_frames == n && p.crx->n_errors == 0);
    CHECK(RUN_UNTIL(a, WAIT_MS, !ops->has_output(p.rx) && !ops->has_output(q.rx)));
    CHECK(g->answer_bytes == 0 && g->paused == NULL);
out:
    if (q.a)
        pair_close(&q);
    pair_close(&p);
    agent_free(a);
}

/* 8. One readiness event: at most 32 frames, the rest at the next. */
static void case_frames_per_event(void)
{
    kvl_agent *a = agent_new(0, 0);
    pair p;
    if (!pair_open(a, &p, 0))
        goto out;
    const int n = 1000;
    kvl_buf one = frame_token(KVL_F_PING, 5);
    size_t len = one.len * (size_t)n;
    uint8_t *all = malloc(len);
    for (int i = 0; i < n; i++)
        memcpy(all + (size_t)i * one.len, one.p, one.len);
    CHECK(ops->send_all(p.tx, all, len, deadline()) == KVL_OK);
    free(all);
    kvl_buf_free(&one);
    int inq = 0;
    uint64_t d = deadline();
    while (kvl_now_ns() < d && (ioctl(p.rx->fd, FIONREAD, &inq) != 0 || (size_t)inq < len))
        usleep(1000);
    CHECK((size_t)inq == len);
    ops->on_event(p.rx, EPOLLIN);
    CHECK(p.crx->n_frames == 32);
    ops->on_event(p.rx, EPOLLIN);
    CHECK(p.crx->n_frames == 64);
    CHECK(RUN_UNTIL(a, WAIT_MS, p.crx->n_frames == n) && p.crx->n_errors == 0);
out:
    pair_close(&p);
    agent_free(a);
}

/* 9. Body buffers: grown as bytes come, a deadline from the header, a pool. */
static void case_bodies(void)
{
    kvl_agent *a = agent_new(0, 0);
    kvl_tcp_budget *g = kvl_tcp_budget_of(a);
    pair p, q;
    memset(&q, 0, sizeof q);
    if (!CHECK(g) || !pair_open(a, &p, 0))
        goto out;
    p.crx->max_body = 1u << 20;
    /* announced 60000 bytes, 100 in: the buffer is small */
    static uint8_t big[600u << 10];
    test_rng r = {9};
    rng_fill(&r, big, sizeof big);
    kvl_buf f = frame_bytes(KVL_F_NOTIFY, big, 60000, 0);
    CHECK(ops->send_all(p.tx, f.p, KVL_HDR_BYTES + 100, deadline()) == KVL_OK);
    CHECK(RUN_UNTIL(a, WAIT_MS, p.rx->rs == RS_BODY && p.rx->body_got == 100));
    CHECK(p.rx->body_cap <= 4096);
    CHECK(ops->rx_partial_since(p.rx, kvl_now_ns()) != 0); /* in time: only a partial frame */
    /* the rest: whole and in order, and the pool lent nothing past the frame */
    CHECK(ops->send_all(p.tx, f.p + KVL_HDR_BYTES + 100, f.len - KVL_HDR_BYTES - 100,
                        deadline()) == KVL_OK);
    CHECK(RUN_UNTIL(a, WAIT_MS, p.crx->n_frames == 1));
    CHECK(p.crx->hdr[0].body_len == 60000 && memcmp(p.crx->body[0], big, 60000) == 0);
    CHECK(g->body_bytes == 0 && p.rx->body_cap <= 16384);
    kvl_buf_free(&f);

    /* trickled: a byte every 100 ms, cut at connect_timeout (2 s) + 60000
     * bytes at 64 KiB/s, not before */
    f = frame_bytes(KVL_F_NOTIFY, big, 60000, 0);
    uint64_t t0 = kvl_now_ns();
    CHECK(ops->send_all(p.tx, f.p, KVL_HDR_BYTES, deadline()) == KVL_OK);
    uint64_t d = deadline(), next = 0;
    size_t sent = KVL_HDR_BYTES;
    while (!p.crx->closed && kvl_now_ns() < d) {
        if (kvl_now_ns() >= next && sent < f.len) {
            CHECK(ops->send_all(p.tx, f.p + sent++, 1, deadline()) == KVL_OK);
            next = kvl_now_ns() + 100000000ull;
        }
        loop_once(a, 5, NULL);
        if (!p.crx->closed)
            ops->rx_partial_since(p.rx, kvl_now_ns());
    }
    uint64_t took = kvl_now_ns() - t0;
    CHECK(p.crx->closed && p.crx->n_errors == 1 && strstr(p.crx->why, "not in within"));
    CHECK(took >= 2000000000ull + 60000ull * 1000000000ull / (64u << 10));
    CHECK(g->body_late == 1 && g->body_bytes == 0);
    kvl_buf_free(&f);
    pair_close(&p);

    /* the pool (1 MiB here): a second body that needs more cuts the one
     * arriving longest; the new one arrives whole */
    if (!pair_open(a, &p, 0) || !pair_open(a, &q, 0))
        goto out;
    g->body_cap = 1u << 20;
    p.crx->max_body = q.crx->max_body = 1u << 20;
    f = frame_bytes(KVL_F_NOTIFY, big, sizeof big, 0);
    CHECK(ops->send_all(p.tx, f.p, KVL_HDR_BYTES + (520u << 10), deadline()) == KVL_OK);
    CHECK(RUN_UNTIL(a, WAIT_MS, p.rx->body_got == (520u << 10)));
    CHECK(g->body_bytes == sizeof big && p.rx->body_listed);
    CHECK(ops->send_all(q.tx, f.p, f.len, deadline()) == KVL_OK);
    CHECK(RUN_UNTIL(a, WAIT_MS, q.crx->n_frames == 1));
    CHECK(p.crx->closed && p.crx->n_errors == 1 && strstr(p.crx->why, "arriving longest"));
    CHECK(q.crx->n_errors == 0 && q.crx->hdr[0].body_len == sizeof big &&
          memcmp(q.crx->body[0], big, sizeof big) == 0);
    CHECK(g->body_cut == 1 && g->body_bytes == 0 && g->body_head == NULL);
    kvl_buf_free(&f);
out:
    if (q.a)
        pair_close(&q);
    pair_close(&p);
    agent_free(a);
}

/* 10. DATA with zero-length pieces: no payload, no trailer, yet its end. */
static void case_empty_data(uint32_t io_threads)
{
    kvl_agent *a = agent_new(io_threads, 0);
    pair p;
    if (!pair_open(a, &p, 0))
        goto out;
    kvl_buf f = frame_chunk(KVL_F_DATA, 3, 0, 0);
    CHECK(ops->send_all(p.tx, f.p, f.len, deadline()) == KVL_OK);
    kvl_buf_free(&f);
    CHECK(RUN_UNTIL(a, WAIT_MS, p.crx->n_payloads == 1));
    CHECK(p.crx->n_frames == 1 && p.crx->crc[0] == 0 && p.crx->trailer[0] == 0);
    /* the stream is in step: the next frame arrives */
    f = frame_token(KVL_F_PING, 1);
    CHECK(ops->send_all(p.tx, f.p, f.len, deadline()) == KVL_OK);
    kvl_buf_free(&f);
    CHECK(RUN_UNTIL(a, WAIT_MS, p.crx->n_frames == 2) && p.crx->n_payloads == 1);
out:
    pair_close(&p);
    agent_free(a);
}

int main(void)
{
    double t0 = test_now_s();
    case_frames();
    for (uint32_t io = 0; io <= 2; io += 2) {
        case_chunk(io);
        case_cancel(io);
        case_revoke(io);
        case_hostile(io);
        case_pulled_hold(io);
    }
    case_one_sided();
    case_one_sided_revoke();
    for (uint32_t io = 0; io <= 2; io += 2) {
        case_answers(io);
        case_empty_data(io);
    }
    case_answers_global();
    case_frames_per_event();
    case_bodies();
    return test_report("test_tcp_stream", t0);
}
