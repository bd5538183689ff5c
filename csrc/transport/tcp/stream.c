/* stream.c: one TCP connection as a kvlink endpoint (kvl_ep).
 *
 * Send side: a queue of frames; a frame's payload is an iovec over the
 * sender's registered memory, so the only copy is the kernel's.  The crc32c
 * of the payload is folded in right after each sendmsg, while those bytes
 * are still in cache, and goes out as the 4-byte trailer.
 *
 * Receive side: a state machine (header -> body -> payload -> trailer).
 * Header and body go to the core (kvl_proto_on_frame), which says where the
 * payload goes (kvl_proto_sink); the payload is read straight into that
 * memory, checked again before every batch (kvl_proto_payload_live), folded
 * into the crc32c while in cache, and the result handed back with the
 * trailer (kvl_proto_on_payload).
 *
 * A mover (transport.h) may carry a chunk frame's payload out of band:
 * the frame then has header flag OOB, and the stream carries header, body,
 * the mover's cover (u32 length + bytes) and the trailer.  For a one-sided
 * mover the cover and trailer go once its writes are complete, and the
 * receiver's crc runs over its memory after the trailer; for a
 * receiver-pulled one the receiver copies the bytes in batches (pull),
 * exactly where an in-stream payload would be read, and the sender holds
 * the memory until the chunk's ACK.  This file knows no mover by name.
 *
 * Engine thread only, but for the blocking helpers of a detached endpoint
 * (tcp.c) and, with I/O threads (iopool.c), the payload of one frame at a
 * time each way: kvl_tcp_tx_step and kvl_tcp_rx_step run there under
 * ep->jmu, and the engine collects their results in tcp_progress.
 */
#include <errno.h>
#include <fcntl.h>
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include "../../internal.h"
#include "tcp.h"

#define IO_BATCH (2u << 20)  /* bytes per receive wakeup (SO_RCVLOWAT): fewer wakeups */
#define IO_BUDGET (8u << 20) /* bytes per readiness event before serving others */
#define MAX_IOV 64
#define SEND_IOV 1024 /* IOV_MAX: a READ_RESP of 8192 one-byte pieces is 8 sendmsg calls, not 128 */
#define PULL_BATCH (512u << 10) /* bytes per mover pull (a same-host copy): crc from L2 */
/* Frames per readiness event, each way: epoll is level-triggered, so a
 * connection with more comes back in the next loop iteration, after every
 * other ready one had its turn (one flooding peer cannot hold back the
 * others' handshakes and PINGs for more than 32 of its frames). */
#define READ_FRAMES 32
#define FRAME_BODY_UNIT (4u << 10) /* ...where every 4 KiB of a body counts as one more frame */
#define WRITE_FRAMES 256

/* Stream budgets (docs/security.md, "Stream budgets").
 * Answers: what frames queued on an accepted connection really hold (out_cost).
 * A connection over its budget is not read until its queue drains (the
 * peer's own answers are what it waits for): an answer is never dropped. */
#define ANSWER_CONN_HIGH (8u << 20) /* 64 READ_RESPs of 8192 pieces: many chunks of window */
#define ANSWER_CONN_LOW (2u << 20)  /* ...read again below this (hysteresis) */
#define ANSWER_FRAMES_HIGH 1024 /* small answers: paused well before the core's close (4096) */
#define ANSWER_FRAMES_LOW 256
#define ANSWER_GLOBAL (64u << 20) /* all accepted connections: issue 22's RSS target per peer */
/* Over ANSWER_GLOBAL only connections holding this much pause: one holding
 * less reads on, so whether a peer is read depends on its own answers, not
 * on what another peer leaves unread. */
#define ANSWER_FLOOR (256u << 10)
/* Bodies: a buffer starts at BODY_START and doubles as bytes arrive (it
 * never holds more than twice what came); up to BODY_FREE per connection is
 * its own (handshakes, ACKs, NOTIFY tags, DATA of some 600 pieces) and kept
 * between frames, anything larger is lent by the agent's pool of BODY_POOL
 * bytes and freed once its frame's body is in. */
/* Closed connections that let go of this many bytes of answers: the
 * memory goes back to the kernel (malloc_trim, at most once a second). */
#define TRIM_AFTER_BYTES (8u << 20)
#define TRIM_EVERY_NS (1000ull * 1000000ull)
#define BODY_START (4u << 10)
#define BODY_FREE (16u << 10)
#define BODY_POOL (32u << 20)
/* A body is in by connect_timeout + body_len at this rate after its header,
 * or its connection is cut (a byte every few seconds holds nothing long):
 * 64 KiB/s is far below any data path, a 1 MiB body gets 16 s more. */
#define BODY_MIN_RATE (64u << 10)

typedef struct kvl_out kvl_out;
struct kvl_out {
    kvl_out *next;
    kvl_tp_frame f;        /* head, payload iovec, chunk identity, what it holds */
    size_t head_sent;
    int iov_idx;
    size_t iov_off;
    uint64_t payload_sent;
    uint32_t crc;
    uint8_t trailer[4];
    size_t trailer_sent;
    int cancelled;         /* the rest of the payload comes from zeros, not our memory */
    int in_job;            /* engine: handed to the I/O thread (started, whatever head_sent says) */
    int oob;               /* the payload goes by ep's mover: header flag OOB, a cover */
    uint32_t mv_caps;      /* oob: the mover's KVL_MV_* when the frame was queued */
    int posted;            /* oob: the mover's post() ran: crc, cover and ticket are known */
    int ready;             /* oob: the mover's writes are complete: cover and trailer may go */
    int zeroed;            /* oob, cancelled before its cover went: the cover names zeros */
    uint64_t ticket;       /* oob: the mover's name for its writes */
    int dst_req;           /* a READ_REQ with DST: once sent, counts in ep->oob_reads */
    int acked;             /* engine: its ACK came while it was still going out */
    uint8_t *cov;          /* oob: u32 cover length + the cover, as it goes out */
    size_t cov_len, cov_sent;
    kvl_stage_buf *slot;   /* f.stage: the host slot the payload was gathered into (stage_out) */
    size_t cost;           /* what it holds in memory (out_cost), counted in ep->sq_bytes */
};

/* Payload bytes per send or read syscall: one L2 cache's worth, so the crc32c
 * pass right after the syscall finds them there (256 KiB..IO_BATCH).  On AMD
 * Zen 3 (512 KiB L2) a 2 MiB batch was crc'd from L3, ~25% slower in perf;
 * where L2 is 2 MiB, 2 MiB batches measured faster than 512 KiB
 * (docs/BENCHMARKS.md, docs/data/tcp-limit.md). */
static size_t crc_batch(void)
{
    static size_t batch; /* every thread computes the same value */
    size_t b = __atomic_load_n(&batch, __ATOMIC_RELAXED);
    if (!b) {
        long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
        if (l2 <= 0 || l2 > (long)IO_BATCH) /* 0 or -1: not known */
            b = IO_BATCH;
        else
            b = l2 < (256l << 10) ? 256u << 10 : (size_t)l2;
        __atomic_store_n(&batch, b, __ATOMIC_RELAXED);
    }
    return b;
}

/* A cancelled DATA frame's remaining payload is sent from here, and a
 * receiver-pulled one's cover names it instead of memory that may be let go
 * of: the stream must stay whole, and the receiver drains the bytes (its
 * chunk is settled). */
static const uint8_t zeros[256u << 10];

static void tcp_mover_failed(kvl_ep *ep, const char *why);
static void tcp_set_mover(kvl_ep *ep, const kvl_mover_ops *ops, kvl_mover *m,
                          const char *why_not);

/* ---- send queue ---- */

/* A receiver-pulled DATA frame that has left: the receiver reads its source
 * after that, so its hold (the transfer's io_ref) lasts until the frame's
 * ACK. */
struct kvl_oob_held {
    uint64_t xid;
    uint32_t chunk, attempt;
    kvl_tp_hold hold;
};

/* Keeps o's hold until its ACK (held_acked) or the close; 0 if it cannot. */
static int hold_until_ack(kvl_ep *ep, kvl_out *o)
{
    if (ep->nheld == ep->capheld) {
        size_t cap = ep->capheld ? 2 * ep->capheld : 8;
        struct kvl_oob_held *n = realloc(ep->held, cap * sizeof *n);
        if (!n)
            return 0;
        ep->held = n;
        ep->capheld = cap;
    }
    ep->held[ep->nheld++] = (struct kvl_oob_held){
        .xid = o->f.xid, .chunk = o->f.chunk, .attempt = o->f.attempt, .hold = o->f.hold};
    memset(&o->f.hold, 0, sizeof o->f.hold);
    return 1;
}

/* An ACK arrived (body: its status message): the copy it answers is over. */
static void held_acked(kvl_ep *ep, const uint8_t *body, size_t len)
{
    kvl_msg_status m;
    if (kvl_dec_status(body, len, &m))
        return; /* the core refuses it */
    for (size_t i = 0; i < ep->nheld; i++) {
        struct kvl_oob_held *h = &ep->held[i];
        if (h->xid == m.xfer && h->chunk == m.chunk && h->attempt == m.attempt) {
            kvl_proto_release(ep->a, &h->hold);
            *h = ep->held[--ep->nheld];
            return;
        }
    }
    /* the receiver may answer before the I/O thread has reported the frame
     * out: then it is still queued, and lets go of its hold when it leaves */
    for (kvl_out *o = ep->sq; o; o = o->next)
        if (o->oob && o->f.is_chunk && o->f.xid == m.xfer && o->f.chunk == m.chunk &&
            o->f.attempt == m.attempt)
            o->acked = 1;
}

void kvl_tcp_budget_init(kvl_tcp_budget *b)
{
    memset(b, 0, sizeof *b);
    b->answer_cap = ANSWER_GLOBAL;
    b->body_cap = BODY_POOL;
}

/* The memory a queued frame holds until it has left: its struct, head
 * buffer, payload and destination arrays (a READ_RESP of 8192 pieces: 128
 * KiB of iovecs), region references and, by a receiver-pulled mover, the
 * cover it will get (at most 16 + 16 bytes a piece; made on the I/O
 * thread, so counted here).  Not the payload: registered memory. */
static size_t out_cost(const kvl_out *o)
{
    size_t head = o->f.head.cap > o->f.head.len ? o->f.head.cap : o->f.head.len;
    size_t c = sizeof *o + head + (size_t)o->f.n_payload * sizeof *o->f.payload +
               (size_t)o->f.n_dst * sizeof *o->f.dst +
               (size_t)o->f.hold.nrefs * sizeof *o->f.hold.refs;
    if (o->oob)
        c += 4 + 16 + 16 * (size_t)o->f.n_payload;
    return c;
}

static void paused_unlist(kvl_tcp_budget *g, kvl_ep *ep)
{
    if (ep->ans_paused != 2)
        return;
    if (ep->pz_prev)
        ep->pz_prev->pz_next = ep->pz_next;
    else
        g->paused = ep->pz_next;
    if (ep->pz_next)
        ep->pz_next->pz_prev = ep->pz_prev;
    ep->pz_prev = ep->pz_next = NULL;
}

static void watch_update(kvl_ep *ep);

/* Whether accepted ep is read, from what it and all connections hold in
 * queued answers: 0 read; 1 not, its own queue is over its budget (until
 * below the low mark); 2 not, the agent's is over and ep holds
 * ANSWER_FLOOR (in g->paused: looked at again once the agent's drains).
 * Only at a frame's end does the read stop (rx_gated). */
static void answers_check(kvl_ep *ep)
{
    kvl_tcp_budget *g = kvl_tcp_budget_of(ep->a);
    if (!ep->acct || ep->dead || !g)
        return;
    size_t own = ep->sq_bytes;
    int was = ep->ans_paused;
    int over_own = was == 1 ? own >= ANSWER_CONN_LOW || ep->sq_len >= ANSWER_FRAMES_LOW
                            : own >= ANSWER_CONN_HIGH || ep->sq_len >= ANSWER_FRAMES_HIGH;
    size_t gmark = was == 2 ? g->answer_cap - g->answer_cap / 4 : g->answer_cap;
    int over_all = own >= ANSWER_FLOOR && g->answer_bytes >= gmark;
    int now = over_own ? 1 : over_all ? 2 : 0;
    if (now == was)
        return;
    paused_unlist(g, ep);
    ep->ans_paused = now;
    if (now == 2) {
        ep->pz_prev = NULL;
        ep->pz_next = g->paused;
        if (g->paused)
            g->paused->pz_prev = ep;
        g->paused = ep;
    }
    if (now && !was) {
        g->pauses++;
        kvl_log_limited(ep->a, KVL_LOG_INFO, NULL,
                        "a peer does not read its answers (%zu bytes in %zu frames queued to it, "
                        "%zu on all connections): its connection is not read until they drain",
                        own, ep->sq_len, g->answer_bytes);
    }
    if (!now != !was)
        watch_update(ep);
}

/* o joins ep's queue: its cost counts for ep (and the agent's budget). */
static void out_count(kvl_ep *ep, kvl_out *o)
{
    o->cost = out_cost(o);
    ep->sq_bytes += o->cost;
    kvl_tcp_budget *g = ep->acct ? kvl_tcp_budget_of(ep->a) : NULL;
    if (g)
        g->answer_bytes += o->cost;
}

static void out_uncount(kvl_ep *ep, kvl_out *o)
{
    ep->sq_bytes -= o->cost;
    kvl_tcp_budget *g = ep->acct ? kvl_tcp_budget_of(ep->a) : NULL;
    if (!g)
        return;
    g->answer_bytes -= o->cost;
    answers_check(ep);
    /* the agent's queue drained: connections paused for it alone read again */
    while (g->paused && g->answer_bytes < g->answer_cap - g->answer_cap / 4) {
        kvl_ep *p = g->paused;
        answers_check(p);
        if (g->paused == p) /* cannot: it holds the floor and the agent is below its mark */
            break;
    }
}

static void out_free(kvl_ep *ep, kvl_out *o)
{
    out_uncount(ep, o);
    int held = o->oob && (o->mv_caps & KVL_MV_RECEIVER_PULLED) && o->f.is_chunk &&
               !ep->dead && !o->acked && o->cov && o->cov_sent == o->cov_len &&
               (o->f.hold.xfer || o->f.hold.nrefs) && hold_until_ack(ep, o);
    if (!held)
        kvl_proto_release(ep->a, &o->f.hold);
    kvl_stage_give(ep->a, o->slot); /* the payload has left (or never will) */
    free(o->f.payload);
    free(o->f.dst);
    free(o->cov);
    kvl_buf_free(&o->f.head);
    free(o);
}

/* What the engine's epoll watches: reading unless refused (only its answer
 * goes out then) or a payload is coming in on the I/O thread; writing while
 * frames wait, unless one is going out on the I/O thread. */
/* Not read for its queued answers, and between two frames (a frame is
 * read whole first, so the partial-frame cut never sees a pause). */
static int rx_gated(const kvl_ep *ep)
{
    return ep->ans_paused && ep->rs == RS_HDR && ep->hdr_got == 0;
}

static void watch_update(kvl_ep *ep)
{
    uint32_t ev = (ep->refused || ep->rx_busy || rx_gated(ep) ? 0 : EPOLLIN) |
                  (ep->epout && !ep->tx_busy ? EPOLLOUT : 0);
    if (ev != ep->ev_mask && kvl_engine_rewatch(ep->a, ep->fd, ep, ev) == 0)
        ep->ev_mask = ev;
}

static void watch(kvl_ep *ep, int out)
{
    ep->epout = out;
    watch_update(ep);
}

static int tcp_send(kvl_ep *ep, kvl_tp_frame *f)
{
    kvl_out *o = ep->dead || f->head.oom ? NULL : calloc(1, sizeof *o);
    if (!o) {
        kvl_proto_release(ep->a, &f->hold);
        free(f->payload);
        free(f->dst);
        kvl_buf_free(&f->head);
        return -1;
    }
    o->f = *f;
    memset(f, 0, sizeof *f);
    /* a staged payload is gathered into a host slot before it starts
     * (stage_out), and the slot is given back once the frame has left: a
     * one-sided mover puts from it (its trailer waits for the writes), a
     * receiver-pulled one would read it too late */
    uint32_t mcaps = ep->mv ? ep->mv_ops->caps : 0;
    if (ep->mv && o->f.payload_len &&
        (!o->f.stage || (mcaps & (KVL_MV_ONE_SIDED | KVL_MV_GPU_MEM))) &&
        ep->mv_ops->covers(ep->mv, &o->f)) {
        o->oob = 1; /* header flag OOB: the stream carries the cover, not the bytes */
        o->mv_caps = ep->mv_ops->caps;
        o->f.head.p[6] |= KVL_HF_OOB;
    }
    o->dst_req = o->f.head.len >= KVL_HDR_BYTES && o->f.head.p[5] == KVL_F_READ_REQ &&
                 (o->f.head.p[6] & KVL_HF_DST);
    out_count(ep, o);
    if (ep->sq_tail)
        ep->sq_tail->next = o;
    else
        ep->sq = o;
    ep->sq_tail = o;
    ep->sq_len++;
    watch(ep, 1);
    answers_check(ep);
    return 0;
}

static int tcp_has_output(const kvl_ep *ep) { return !ep->dead && ep->sq != NULL; }

static size_t tcp_queued(const kvl_ep *ep, size_t *bytes)
{
    *bytes = ep->sq_bytes;
    return ep->sq_len;
}

static int body_late(kvl_ep *ep, uint64_t now);

static uint64_t tcp_rx_partial_since(kvl_ep *ep, uint64_t now)
{
    int partial = ep->rx_busy || ep->rs != RS_HDR || ep->hdr_got > 0;
    if (!partial || ep->dead || ep->refused)
        return 0;
    if (!ep->rx_busy && body_late(ep, now)) /* a body arriving too slowly: ep is closed */
        return 0;
    /* SO_RCVLOWAT holds our wakeup back while a slow sender's bytes gather
     * in the kernel: those bytes are progress too */
    int inq = 0;
    if (ioctl(ep->fd, FIONREAD, &inq) == 0 && inq > ep->inq_seen)
        __atomic_store_n(&ep->t_rx_ns, now, __ATOMIC_RELAXED);
    ep->inq_seen = inq > 0 ? inq : 0;
    /* an I/O thread may have stamped a byte after the caller read its clock */
    uint64_t t = __atomic_load_n(&ep->t_rx_ns, __ATOMIC_RELAXED);
    return t < now ? t : now;
}

static void tcp_drop_unstarted(kvl_ep *ep)
{
    kvl_out **pp = &ep->sq;
    ep->sq_tail = NULL;
    while (*pp) {
        kvl_out *o = *pp;
        if (o->f.is_chunk && !o->in_job && o->head_sent == 0) {
            *pp = o->next;
            ep->sq_len--;
            out_free(ep, o);
        } else {
            ep->sq_tail = o;
            pp = &o->next;
        }
    }
}

/* A pull over a one-sided mover: a READ_REQ sent with DST lets the peer put
 * into our memory until its READ_RESP has ended, and a put cannot be called
 * back.  So a cancelled copy that may be such a read fences the mover at
 * once (it destroys its end: once this returns nothing lands; docs/ucx.md,
 * "Cancel and duplicate copies").  The connection is failed from the event
 * loop, not from inside the core's cancel. */
static void mover_fence(kvl_ep *ep, const char *why)
{
    char msg[160];
    snprintf(msg, sizeof msg, "%s fenced: %s", ep->mv_ops->label, why);
    char reads[32] = "";
    if (ep->oob_reads)
        snprintf(reads, sizeof reads, " (%u reads outstanding)", ep->oob_reads);
    kvl_log(ep->a, KVL_LOG_WARNING, NULL, -1,
            "%s%s: the path's %s end is destroyed, its connection closes and reconnects", msg,
            reads, ep->mv_ops->label);
    if (ep->mv_ops->fence)
        ep->mv_ops->fence(ep->mv, why);
    ep->mv_ops->free(ep->mv, ep->a->cfg.connect_timeout_ms);
    ep->mv = NULL; /* ops stay: what carried the path, for the note */
    snprintf(ep->mv_note, sizeof ep->mv_note, "%s", msg);
    tcp_mover_failed(ep, msg);
}

static int tcp_cancel(kvl_ep *ep, uint64_t xid, uint32_t chunk, uint32_t attempt)
{
    if (ep->dead)
        return 0;
    int found = 0;
    for (kvl_out **pp = &ep->sq, *prev = NULL; *pp; prev = *pp, pp = &(*pp)->next) {
        kvl_out *o = *pp;
        if (!o->f.is_chunk || o->f.xid != xid || o->f.chunk != chunk || o->f.attempt != attempt)
            continue;
        if (!o->in_job && o->head_sent == 0) {
            /* not started: it simply never goes out */
            *pp = o->next;
            ep->sq_len--;
            if (ep->sq_tail == o)
                ep->sq_tail = prev;
            out_free(ep, o);
            if (!ep->sq)
                watch(ep, 0);
            return 1;
        }
        if (o->dst_req) { /* part-way out: the peer will read it and may put */
            if (ep->mv)
                mover_fence(ep, "a pull the peer may be putting was cancelled");
            return 1;
        }
        if (o->oob && (o->mv_caps & KVL_MV_ONE_SIDED) && o->posted && !o->ready) {
            /* writes cannot be called back: the memory is let go of only
             * once they are complete (docs/ucx.md, cancel on a UCX path) */
            uint64_t until = kvl_now_ns() + (uint64_t)ep->a->cfg.connect_timeout_ms * 1000000ull;
            int r = ep->mv ? ep->mv_ops->wait(ep->mv, o->ticket, until) : -1;
            if (r != 1) {
                /* the writes may still read our memory: the frame keeps its
                 * hold, goes out cancelled, and the connection is failed
                 * from the event loop (not from inside the core's cancel),
                 * which frees the mover before the memory is let go of */
                o->cancelled = 1;
                tcp_mover_failed(ep, "the writes of a cancelled copy did not complete: path "
                                     "closed");
                return 1;
            }
            o->ready = 1;
            ep->put_tx += o->f.payload_len;
            /* its trailer may go now: the socket was not watched while the
             * frame waited for its writes (OUT_WAIT), and the mover's event
             * that would resume it may have been spent inside wait(), so
             * without this the frame (and every one behind it) stalled until
             * something else was queued (test_tcp_stream, case 6) */
            watch(ep, 1);
        }
        if (o->in_job)
            pthread_mutex_lock(&ep->jmu); /* the I/O thread is between two sends */
        if (o->f.payload_len && !o->cancelled) {
            /* mid-frame: the rest goes out as zeros with a trailer that
             * cannot match, and our memory is let go of right now */
            o->cancelled = 1;
            kvl_proto_release(ep->a, &o->f.hold);
            memset(&o->f.hold, 0, sizeof o->f.hold);
        }
        if (o->in_job)
            pthread_mutex_unlock(&ep->jmu);
        found = 1;
        break;
    }
    /* a copy no longer queued here may be a pull read whose answer is still
     * to come: while any is (conservatively: not only this copy), fence */
    if (!found && ep->mv && ep->oob_reads)
        mover_fence(ep, "a pull the peer may be putting was cancelled");
    return found;
}

/* Advances o over n payload bytes just sent, folding them into the crc. */
static void out_advance_payload(kvl_out *o, size_t n)
{
    if (o->cancelled) { /* the zeros count too: the trailer is then surely wrong */
        o->crc = kvl_crc32c(o->crc, zeros, n);
        o->payload_sent += n;
        return;
    }
    while (n) {
        struct iovec *v = &o->f.payload[o->iov_idx];
        size_t take = v->iov_len - o->iov_off;
        if (take > n)
            take = n;
        o->crc = kvl_crc32c(o->crc, (uint8_t *)v->iov_base + o->iov_off, take);
        o->iov_off += take;
        o->payload_sent += take;
        n -= take;
        if (o->iov_off == v->iov_len) {
            o->iov_idx++;
            o->iov_off = 0;
        }
    }
}

/* o's trailer: its crc, inverted for a cancelled copy (it never verifies). */
static void trailer_fill(kvl_out *o)
{
    uint32_t t = o->cancelled ? ~o->crc : o->crc;
    for (int i = 0; i < 4; i++)
        o->trailer[i] = (uint8_t)(t >> (8 * i));
}

/* The next piece of o to write: head, payload batch, or (OOB) cover, and
 * trailer. */
static int out_iov(kvl_out *o, struct iovec *v)
{
    int n = 0;
    size_t want = 0;
    if (o->head_sent < o->f.head.len) {
        v[n].iov_base = o->f.head.p + o->head_sent;
        v[n++].iov_len = o->f.head.len - o->head_sent;
        want += o->f.head.len - o->head_sent;
    }
    if (o->oob) {
        /* cover and trailer in one go, once the mover's writes are
         * complete: the receiver has all it needs and copies (or checks)
         * while we go on.  The stream's shape does not change when
         * cancelled: the trailer goes out inverted then, never verifying */
        if (!o->ready)
            return n;
        if (o->cov_sent < o->cov_len) {
            v[n].iov_base = o->cov + o->cov_sent;
            v[n++].iov_len = o->cov_len - o->cov_sent;
        }
        if (o->trailer_sent == 0)
            trailer_fill(o);
        v[n].iov_base = o->trailer + o->trailer_sent;
        v[n++].iov_len = 4 - o->trailer_sent;
    } else if (o->payload_sent < o->f.payload_len && o->cancelled) {
        uint64_t rest = o->f.payload_len - o->payload_sent;
        v[n].iov_base = (void *)zeros;
        v[n++].iov_len = rest < sizeof zeros ? (size_t)rest : sizeof zeros;
    } else if (o->payload_sent < o->f.payload_len) {
        int idx = o->iov_idx;
        size_t off = o->iov_off;
        size_t batch = crc_batch();
        while (n < SEND_IOV && idx < o->f.n_payload && want < batch) {
            size_t len = o->f.payload[idx].iov_len - off;
            if (len > batch - want)
                len = batch - want;
            v[n].iov_base = (uint8_t *)o->f.payload[idx].iov_base + off;
            v[n++].iov_len = len;
            want += len;
            idx++;
            off = 0;
        }
    } else if (o->f.payload_len && o->trailer_sent < 4) {
        if (o->trailer_sent == 0)
            trailer_fill(o);
        v[n].iov_base = o->trailer + o->trailer_sent;
        v[n++].iov_len = 4 - o->trailer_sent;
    }
    return n;
}

/* What a receive error came from, for its message. */
static const char *rx_what(const kvl_ep *ep)
{
    return ep->rx_pull && ep->mv_ops && ep->mv_ops->pull_what ? ep->mv_ops->pull_what : "recv";
}

static void fail(kvl_ep *ep, kvl_err err, const char *what, int errnum)
{
    char why[160];
    snprintf(why, sizeof why, "%s: %s", what, strerror(errnum));
    kvl_proto_on_error(ep->c, err, why);
}

enum { OUT_DONE = 1, OUT_MORE = 0, OUT_BLOCKED = -1, OUT_ERROR = -2, OUT_WAIT = -3,
       OUT_FAILED = -4 };

/* The zeros a cancelled copy's mover places or names instead of memory that
 * may be let go of: *n pieces (malloc'd) covering len bytes. */
static struct iovec *zeros_iov(uint64_t len, int *n)
{
    uint64_t k = (len + sizeof zeros - 1) / sizeof zeros;
    struct iovec *v = k <= KVL_MAX_PIECES ? calloc(k, sizeof *v) : NULL;
    if (!v)
        return NULL; /* cannot happen for a chunk (<= KVL_MAX_CHUNK) */
    for (uint64_t i = 0; i < k; i++) {
        v[i].iov_base = (void *)zeros;
        v[i].iov_len = i + 1 < k ? sizeof zeros : (size_t)(len - i * sizeof zeros);
    }
    *n = (int)k;
    return v;
}

/* Hands o's payload to ep's mover (its source, or zeros once cancelled): the
 * crc for the trailer, the cover, the ticket.  0, or -1 when the mover
 * failed (the core was told). */
static int oob_post(kvl_ep *ep, kvl_out *o)
{
    struct iovec *zv = NULL;
    kvl_mv_send ms = {.f = &o->f, .src = o->f.payload, .n_src = o->f.n_payload};
    if (o->cancelled) {
        if (!(o->mv_caps & KVL_MV_RECEIVER_PULLED)) {
            /* cancelled before its writes: none is posted (its memory is let
             * go of) and the trailer goes out inverted: it never verifies */
            o->posted = o->ready = 1;
            o->payload_sent = o->f.payload_len;
            free(o->cov);
            o->cov = calloc(1, 4);
            o->cov_len = o->cov ? 4 : 0;
            return 0;
        }
        /* the cover names the static zeros instead (as a cancelled in-stream
         * frame sends zeros); the trailer stays inverted */
        if ((zv = zeros_iov(o->f.payload_len, &ms.n_src)))
            ms.src = zv;
        o->zeroed = 1;
    }
    kvl_err e = ep->mv ? ep->mv_ops->post(ep->mv, &ms) : KVL_ERR_CONN_LOST;
    free(zv);
    if (e) {
        char why[200];
        snprintf(why, sizeof why, "%s: %s", ep->mv_ops->name,
                 ep->mv ? kvl_last_error() : "the mover is gone");
        free(ms.cover);
        kvl_proto_on_error(ep->c, KVL_ERR_CONN_LOST, why);
        return -1;
    }
    free(o->cov);
    o->cov_len = 4 + ms.cover_len;
    o->cov = malloc(o->cov_len);
    if (!o->cov) {
        free(ms.cover);
        kvl_proto_on_error(ep->c, KVL_ERR_NOMEM, "out of memory for a mover's cover");
        return -1;
    }
    uint32_t cl = (uint32_t)ms.cover_len;
    for (int i = 0; i < 4; i++)
        o->cov[i] = (uint8_t)(cl >> (8 * i));
    if (ms.cover_len)
        memcpy(o->cov + 4, ms.cover, ms.cover_len);
    free(ms.cover);
    o->crc = ms.crc;
    o->ticket = ms.ticket;
    if (!o->posted) {
        o->posted = 1;
        o->payload_sent = o->f.payload_len;
        __atomic_fetch_add(&ep->tx_payload, o->f.payload_len, __ATOMIC_RELAXED);
    }
    return 0;
}

/* An OOB frame not ready to close: posts it once (a one-sided mover's
 * writes after the header went, a receiver-pulled one's cover before
 * anything goes), then OUT_MORE once its writes are complete, OUT_WAIT while
 * not (the mover's event goes on: kvl_tcp_mover_progressed), OUT_FAILED
 * when the mover failed (the core was told). */
/* A receiver-pulled copy cancelled before its cover went: the memory its
 * cover would name may be let go of, so it is posted again over zeros. */
static int needs_zero_cover(const kvl_out *o)
{
    return (o->mv_caps & KVL_MV_RECEIVER_PULLED) && o->cancelled && !o->zeroed &&
           o->cov_sent == 0;
}

static int oob_step(kvl_ep *ep, kvl_out *o)
{
    if (!o->posted || needs_zero_cover(o)) {
        if (oob_post(ep, o))
            return OUT_FAILED;
        if (o->ready)
            return OUT_MORE;
    }
    char why[160] = "";
    int r = ep->mv ? ep->mv_ops->ready(ep->mv, o->ticket, why, sizeof why) : -1;
    if (r < 0) {
        kvl_proto_on_error(ep->c, KVL_ERR_CONN_LOST,
                           why[0] ? why : "the path's mover is gone with a frame in flight");
        return OUT_FAILED;
    }
    if (!r)
        return OUT_WAIT;
    o->ready = 1;
    if (o->mv_caps & KVL_MV_ONE_SIDED)
        ep->put_tx += o->f.payload_len;
    return OUT_MORE;
}

/* One sendmsg of o (ep's head frame): OUT_DONE once all of it is out,
 * OUT_MORE, OUT_BLOCKED (the socket is full) or OUT_ERROR (errno); an OOB
 * frame also OUT_WAIT and OUT_FAILED (oob_step). */
static int out_step(kvl_ep *ep, kvl_out *o, size_t *budget)
{
    if (o->oob && (!o->ready || needs_zero_cover(o)) &&
        (o->head_sent == o->f.head.len || (o->mv_caps & KVL_MV_RECEIVER_PULLED))) {
        int r = oob_step(ep, o);
        if (r != OUT_MORE)
            return r;
    }
    struct iovec v[SEND_IOV + 2];
    int n = out_iov(o, v);
    if (n == 0)
        return o->oob && !o->ready ? OUT_MORE : OUT_DONE;
    struct msghdr mh = {.msg_iov = v, .msg_iovlen = (size_t)n};
    ssize_t got = sendmsg(ep->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (got < 0)
        return errno == EAGAIN || errno == EINTR ? OUT_BLOCKED : OUT_ERROR;
    size_t left = (size_t)got;
    *budget = left >= *budget ? 0 : *budget - left;
    if (o->head_sent < o->f.head.len) {
        size_t h = o->f.head.len - o->head_sent;
        if (h > left)
            h = left;
        o->head_sent += h;
        left -= h;
    }
    if (left && o->oob && o->cov_sent < o->cov_len) {
        size_t d = o->cov_len - o->cov_sent;
        if (d > left)
            d = left;
        o->cov_sent += d;
        left -= d;
    }
    if (left && !o->oob && o->payload_sent < o->f.payload_len) {
        out_advance_payload(o, left);
        __atomic_fetch_add(&ep->tx_payload, left, __ATOMIC_RELAXED);
        left = 0;
    }
    if (left)
        o->trailer_sent += left;
    if (o->head_sent < o->f.head.len || o->payload_sent < o->f.payload_len ||
        (o->oob && (!o->ready || o->cov_sent < o->cov_len)) ||
        (o->f.payload_len && o->trailer_sent < 4))
        return OUT_MORE;
    return OUT_DONE;
}

int kvl_tcp_tx_step(kvl_ep *ep)
{
    size_t budget = IO_BUDGET;
    while (budget) {
        int r = out_step(ep, ep->sq, &budget);
        if (r == OUT_DONE)
            return 1;
        if (r == OUT_ERROR) {
            ep->tx_err = errno ? errno : EIO;
            return 1;
        }
        if (r == OUT_BLOCKED)
            return 0;
    }
    return 0; /* its turn is over: the others on this thread go next */
}

/* o (ep's head frame, not started) has a payload of memory the socket
 * cannot read (f.stage): gathered into a host slot now, so the payload and
 * its crc32c go from there like any other (staging.c).  Only the head frame
 * is staged, so a connection holds one send slot at a time.  When the copy
 * fails (a CUDA error, no memory for a slot) the frame goes out cancelled,
 * as a hedge's loser does: zeros and a trailer that cannot verify, so its
 * receiver refuses it and the chunk is retried, up to max_attempts; the
 * connection stays up and the log says why. */
static void stage_out(kvl_ep *ep, kvl_out *o)
{
    size_t len = (size_t)o->f.payload_len;
    kvl_err e = kvl_stage_take(ep->a, o->f.stage, len, &o->slot);
    if (!e)
        e = kvl_stage_gather(o->slot, o->f.stage, o->f.payload, o->f.n_payload, len);
    if (e) {
        if (o->f.is_chunk)
            kvl_log_limited(ep->a, KVL_LOG_ERROR, NULL,
                            "chunk %u of transfer %llu could not be staged for sending (%s); "
                            "it goes out cancelled and is retried",
                            o->f.chunk, (unsigned long long)o->f.xid, kvl_last_error());
        else
            kvl_log_limited(ep->a, KVL_LOG_ERROR, NULL,
                            "a pulled chunk could not be staged for sending (%s); it goes out "
                            "cancelled and its puller retries it",
                            kvl_last_error());
        o->cancelled = 1;
        kvl_proto_release(ep->a, &o->f.hold); /* its memory is not read any more */
        memset(&o->f.hold, 0, sizeof o->f.hold);
        kvl_stage_give(ep->a, o->slot);
        o->slot = NULL;
        return;
    }
    o->f.payload[0].iov_base = o->slot->p;
    o->f.payload[0].iov_len = len;
    o->f.n_payload = 1;
    o->iov_idx = 0;
    o->iov_off = 0;
}

static void ep_write(kvl_ep *ep)
{
    size_t budget = IO_BUDGET;
    int frames = 0;
    if (ep->mv_broken) {
        kvl_proto_on_error(ep->c, KVL_ERR_CONN_LOST, ep->mv_broken_why);
        return;
    }
    while (ep->sq && budget && frames < WRITE_FRAMES && !ep->dead && !ep->tx_busy) {
        kvl_out *o = ep->sq;
        if (o->f.stage && !o->slot && !o->cancelled && o->f.payload_len && o->head_sent == 0)
            stage_out(ep, o);
        if (ep->io && o->f.payload_len && !(o->oob && (o->mv_caps & KVL_MV_ONE_SIDED))) {
            /* the payload goes out on the I/O thread; tcp_progress goes on */
            o->in_job = 1;
            ep->tx_busy = 1;
            watch_update(ep);
            kvl_tcp_job_start(ep, 1);
            return;
        }
        int r = out_step(ep, o, &budget);
        if (r == OUT_ERROR)
            fail(ep, KVL_ERR_CONN_LOST, "send", errno);
        if (r == OUT_WAIT) /* the mover's event goes on (kvl_tcp_mover_progressed) */
            watch(ep, 0);
        if (r == OUT_BLOCKED && !ep->epout)
            watch(ep, 1); /* resumed by a mover event after OUT_WAIT: the socket's turn now */
        if (r == OUT_ERROR || r == OUT_BLOCKED || r == OUT_WAIT || r == OUT_FAILED)
            return;
        if (r == OUT_MORE)
            continue;
        ep->sq = o->next;
        ep->sq_len--;
        if (!ep->sq)
            ep->sq_tail = NULL;
        if (o->dst_req)
            ep->oob_reads++;
        out_free(ep, o);
        frames++;
    }
    if (ep->sq && !ep->dead && !ep->tx_busy && !ep->epout)
        watch(ep, 1); /* out of budget after a mover resume: go on when writable */
    if (!ep->sq && !ep->dead) {
        watch(ep, 0);
        if (ep->refused)
            kvl_proto_on_error(ep->c, KVL_OK, "closed after refusing the handshake");
    }
}

static void tcp_refuse(kvl_ep *ep)
{
    ep->refused = 1;
    watch(ep, 1);
}

/* ---- receive ---- */

/* The next batch of the sink from its cursor (dst_idx, dst_off): up to limit
 * bytes in at most MAX_IOV pieces, stopping at a drained piece.  Returns the
 * number of pieces in v. */
static int sink_batch(const kvl_ep *ep, const struct iovec *dst, int ndst, size_t limit,
                      struct iovec *v)
{
    int n = 0;
    size_t want = 0;
    int idx = ep->dst_idx;
    size_t off = ep->dst_off;
    while (n < MAX_IOV && idx < ndst && want < limit && dst[idx].iov_base) {
        size_t len = dst[idx].iov_len - off;
        if (len > limit - want)
            len = limit - want;
        v[n].iov_base = (uint8_t *)dst[idx].iov_base + off;
        v[n++].iov_len = len;
        want += len;
        idx++;
        off = 0;
    }
    return n;
}

/* got bytes landed in v[0..n) (from the sink's cursor on): their crc32c,
 * taken while they are in cache, and the cursor moves past them. */
static void sink_landed(kvl_ep *ep, const struct iovec *dst, const struct iovec *v, int n,
                        size_t got)
{
    size_t left = got;
    for (int i = 0; i < n && left; i++) {
        size_t take = v[i].iov_len < left ? v[i].iov_len : left;
        ep->crc = kvl_crc32c(ep->crc, v[i].iov_base, take);
        left -= take;
        ep->dst_off += take;
        if (ep->dst_off == dst[ep->dst_idx].iov_len) {
            ep->dst_idx++;
            ep->dst_off = 0;
        }
    }
    ep->pay_got += (uint64_t)got;
}

/* read_payload for a receiver-pulled OOB frame: the mover copies the next
 * batch from the sender's memory into the sink, and its crc32c is taken
 * while the bytes are in cache.  A drained copy, or one whose source is gone
 * (EFAULT: the sender cancelled it and let the memory go), places nothing
 * and cannot verify.  Returns bytes handled, or -1 with errno (EPERM, ESRCH:
 * this process may not read the peer's: the connection fails). */
static ssize_t pull_payload(kvl_ep *ep, const struct iovec *dst, int ndst, int live)
{
    struct iovec v[MAX_IOV] = {{0}};
    if (!live || ep->rx_fault || dst[ep->dst_idx].iov_base == NULL || !ep->mv) {
        size_t len = dst[ep->dst_idx].iov_len - ep->dst_off;
        if (ep->mv)
            ep->mv_ops->skip(ep->mv, len);
        ep->rx_fault |= !ep->mv;
        ep->dst_idx++;
        ep->dst_off = 0;
        ep->pay_got += len;
        return (ssize_t)len;
    }
    int n = sink_batch(ep, dst, ndst, PULL_BATCH, v);
    ssize_t got = ep->mv_ops->pull(ep->mv, v, n);
    if (got < 0) {
        if (errno != EFAULT)
            return -1;
        ep->rx_fault = 1; /* the rest is skipped: this copy never verifies */
        return pull_payload(ep, dst, ndst, live);
    }
    sink_landed(ep, dst, v, n, (size_t)got);
    return got;
}

/* Reads payload bytes into the sink.  Returns bytes read, 0 on EOF, -1 with
 * errno on error. */
static ssize_t read_payload(kvl_ep *ep, const struct iovec *dst, int ndst, int live,
                            uint8_t *scratch, size_t scratch_len)
{
    if (ep->rx_pull)
        return pull_payload(ep, dst, ndst, live);
    struct iovec v[MAX_IOV];
    int n;
    if (!live || dst[ep->dst_idx].iov_base == NULL) {
        /* drained: the destination must not change through this copy */
        size_t len = dst[ep->dst_idx].iov_len - ep->dst_off;
        v[0].iov_base = scratch;
        v[0].iov_len = len < scratch_len ? len : scratch_len;
        n = 1;
    } else {
        n = sink_batch(ep, dst, ndst, crc_batch(), v);
    }
    ssize_t got = readv(ep->fd, v, n);
    if (got <= 0)
        return got;
    sink_landed(ep, dst, v, n, (size_t)got);
    return got;
}

/* While a payload is arriving, asks the kernel to wake us only once a whole
 * batch (or the rest of the frame, which the peer must send) is queued: one
 * large readv per wakeup instead of many small ones.  Between frames the
 * default of one byte applies, so headers and ACKs are seen at once. */
static void set_lowat(kvl_ep *ep, int in_payload)
{
    int want = 0;
    if (in_payload && !ep->rx_pull) { /* a pulled payload is not in the stream */
        uint64_t rest = ep->h.payload_len - ep->pay_got + 4; /* + the crc trailer */
        want = rest > (uint64_t)ep->lowat_max ? ep->lowat_max : (int)rest;
    }
    if (want == ep->lowat)
        return;
    int v = want ? want : 1;
    if (setsockopt(ep->fd, SOL_SOCKET, SO_RCVLOWAT, &v, sizeof v) == 0)
        ep->lowat = want;
}

/* The payload that starts now comes in on ep's I/O thread, into a copy of
 * the core's sink; the engine reads ep no more until it is in. */
static void rx_job_start(kvl_ep *ep)
{
    int ndst;
    const struct iovec *dst = kvl_proto_sink(ep->c, &ndst);
    if (ndst > ep->sink_cap) {
        struct iovec *ns = realloc(ep->sink, (size_t)ndst * sizeof *ns);
        if (!ns) {
            kvl_proto_on_error(ep->c, KVL_ERR_NOMEM, "out of memory for a payload's sink");
            return;
        }
        ep->sink = ns;
        ep->sink_cap = ndst;
    }
    memcpy(ep->sink, dst, (size_t)ndst * sizeof *dst);
    ep->nsink = ndst;
    ep->live = kvl_proto_payload_live(ep->c);
    ep->rx_busy = 1;
    watch_update(ep);
    kvl_tcp_job_start(ep, 0);
}

int kvl_tcp_rx_step(kvl_ep *ep, uint8_t *scratch, size_t scratch_len)
{
    size_t budget = IO_BUDGET;
    while (budget) {
        int in_payload = ep->pay_got < ep->h.payload_len;
        ssize_t n = in_payload ? read_payload(ep, ep->sink, ep->nsink, ep->live, scratch,
                                              scratch_len)
                               : recv(ep->fd, ep->trailer + ep->trailer_got,
                                      4 - ep->trailer_got, MSG_DONTWAIT);
        if (n == 0) {
            ep->rx_err = -1;
            return 1;
        }
        if (n < 0) {
            if (errno != EAGAIN && errno != EINTR) {
                ep->rx_err = errno;
                return 1;
            }
            set_lowat(ep, in_payload);
            return 0;
        }
        budget = (size_t)n >= budget ? 0 : budget - (size_t)n;
        __atomic_store_n(&ep->t_rx_ns, kvl_now_ns(), __ATOMIC_RELAXED);
        if (!in_payload && (ep->trailer_got += (size_t)n) == 4) {
            set_lowat(ep, 0); /* headers are seen at once again */
            return 1;
        }
    }
    return 0; /* its turn is over: the others on this thread go next */
}

/* A one-sided OOB frame's trailer is in: the crc32c over the bytes placed
 * in the sink (what the trailer vouches for, checked at the destination).  A
 * copy that may not place (drained) cannot verify. */
static uint32_t placed_crc(kvl_ep *ep, uint32_t want)
{
    int n;
    const struct iovec *dst = kvl_proto_sink(ep->c, &n);
    if (!kvl_proto_payload_live(ep->c))
        return ~want;
    uint32_t crc = 0;
    for (int i = 0; i < n; i++) {
        if (!dst[i].iov_base)
            return ~want;
        crc = kvl_crc32c(crc, dst[i].iov_base, dst[i].iov_len);
    }
    return crc;
}

/* A payload starts: in-stream bytes, or (rx_pull) a copy by the mover. */
static void payload_begin(kvl_ep *ep)
{
    ep->rs = RS_PAYLOAD;
    ep->dst_idx = 0;
    ep->dst_off = 0;
    ep->pay_got = 0;
    ep->crc = 0;
    ep->trailer_got = 0;
    /* never more than a quarter of the receive buffer: above what the
     * buffer holds the kernel would grow it and clamp the TCP window to
     * the low-water mark, capping the path's throughput.  Read once per
     * frame; autotuning may grow the buffer between frames. */
    int rcvbuf = 0;
    socklen_t len = sizeof rcvbuf;
    if (getsockopt(ep->fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, &len) < 0)
        rcvbuf = 0;
    ep->lowat_max = rcvbuf / 4 < (int)IO_BATCH ? rcvbuf / 4 : (int)IO_BATCH;
    if (ep->io)
        rx_job_start(ep);
}

/* The cover's bytes so far are in (ep->cov_got == ep->cov_need): first its
 * u32 length, then the cover, which the mover checks before one byte is
 * placed.  A one-sided mover's bytes are placed already: only the trailer
 * follows.  Returns -1 when the core was told of a broken peer. */
static int on_cover(kvl_ep *ep)
{
    if (ep->cov_need == 4) {
        uint32_t len = (uint32_t)ep->cov[0] | (uint32_t)ep->cov[1] << 8 |
                       (uint32_t)ep->cov[2] << 16 | (uint32_t)ep->cov[3] << 24;
        if (len > KVL_MAX_COVER) {
            char why[96];
            snprintf(why, sizeof why, "a cover of %u bytes where at most %u are taken", len,
                     KVL_MAX_COVER);
            kvl_proto_on_error(ep->c, KVL_ERR_PROTOCOL, why);
            return -1;
        }
        if (len) {
            if (4 + (size_t)len > ep->cov_cap) {
                uint8_t *nb = realloc(ep->cov, 4 + (size_t)len);
                if (!nb) {
                    kvl_proto_on_error(ep->c, KVL_ERR_NOMEM, "out of memory for a cover");
                    return -1;
                }
                ep->cov = nb;
                ep->cov_cap = 4 + (size_t)len;
            }
            ep->cov_need = 4 + (size_t)len;
            return 0;
        }
    }
    size_t len = ep->cov_need - 4;
    uint32_t caps = ep->mv_ops->caps;
    if (caps & KVL_MV_ONE_SIDED) {
        if (len) {
            kvl_proto_on_error(ep->c, KVL_ERR_PROTOCOL,
                               "a cover on a frame whose bytes were put (covers are empty)");
            return -1;
        }
        /* the bytes were put into the sink already (the core allowed OOB
         * on this path only): the trailer, sent after the writes, says so */
        ep->rs = RS_TRAILER;
        ep->rx_put = 1;
        ep->pay_got = ep->h.payload_len;
        ep->crc = 0;
        ep->trailer_got = 0;
        return 0;
    }
    if (ep->mv_ops->rx_begin(ep->mv, ep->cov + 4, len, ep->h.payload_len)) {
        kvl_proto_on_error(ep->c, KVL_ERR_PROTOCOL, kvl_last_error());
        return -1;
    }
    ep->rx_pull = 1;
    ep->rx_fault = 0;
    set_lowat(ep, 0); /* only the 4-byte trailer comes in-stream: wake for it at once */
    payload_begin(ep);
    return 0;
}

/* ---- body buffers ---- */

static void body_unlist(kvl_ep *ep)
{
    kvl_tcp_budget *g = kvl_tcp_budget_of(ep->a);
    if (!ep->body_listed || !g)
        return;
    if (ep->bl_prev)
        ep->bl_prev->bl_next = ep->bl_next;
    else
        g->body_head = ep->bl_next;
    if (ep->bl_next)
        ep->bl_next->bl_prev = ep->bl_prev;
    else
        g->body_tail = ep->bl_prev;
    ep->bl_prev = ep->bl_next = NULL;
    ep->body_listed = 0;
}

/* Gives a pooled body buffer back (the frame's body is in, or the
 * connection closed). */
static void body_release(kvl_ep *ep)
{
    body_unlist(ep);
    if (!ep->body_pooled)
        return;
    kvl_tcp_budget *g = kvl_tcp_budget_of(ep->a);
    if (g)
        g->body_bytes -= ep->body_pooled;
    munmap(ep->body, ep->body_cap); /* lent by the pool: mapped (body_map) */
    ep->body_pooled = 0;
    ep->body = NULL;
    ep->body_cap = 0;
}

/* Cuts ep's frame whose body is arriving (why: the pool or its deadline). */
static void body_cut(kvl_ep *ep, const char *why)
{
    char msg[256];
    snprintf(msg, sizeof msg, "a frame body of %u bytes (%zu in so far): %s; connection closed",
             ep->h.body_len, ep->body_got, why);
    kvl_log_limited(ep->a, KVL_LOG_WARNING, NULL, "%s", msg);
    kvl_proto_on_error(ep->c, KVL_ERR_PROTOCOL, msg);
    body_release(ep); /* the core closed ep (on_error): its pool bytes are back anyway */
}

/* ep's body buffer is full and more of the body is to come: twice as large
 * (at most the body).  Above BODY_FREE an accepted connection's buffer is
 * lent by the agent's pool; a full pool cuts the body that has been
 * arriving longest (possibly ep's own), so a peer must keep sending to hold
 * pool memory, and a body sent at any data-path rate is never the oldest
 * for long.  0, or -1 when ep was failed. */
/* A buffer the pool lends is mapped, not malloc'ed: when it goes back its
 * pages go back to the kernel at once (malloc keeps what frees of this size
 * leave: a trickle's 64 MiB of cut bodies stayed in RSS after it left).
 * ep's body (body_got bytes) in `want` bytes, or NULL. */
static uint8_t *body_map(kvl_ep *ep, size_t want)
{
    if (ep->body_pooled) {
        void *p = mremap(ep->body, ep->body_cap, want, MREMAP_MAYMOVE);
        return p == MAP_FAILED ? NULL : p;
    }
    void *p = mmap(NULL, want, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return NULL;
    if (ep->body_got)
        memcpy(p, ep->body, ep->body_got);
    free(ep->body);
    return p;
}

static int body_grow(kvl_ep *ep)
{
    size_t want = ep->body_cap ? 2 * ep->body_cap : BODY_START;
    if (want > ep->h.body_len)
        want = ep->h.body_len;
    kvl_tcp_budget *g = ep->acct ? kvl_tcp_budget_of(ep->a) : NULL;
    size_t pooled = g && want > BODY_FREE ? want : 0;
    while (pooled && g->body_bytes - ep->body_pooled + pooled > g->body_cap && g->body_head) {
        kvl_ep *old = g->body_head;
        char why[160];
        snprintf(why, sizeof why,
                 "bodies arriving on all connections hold %zu bytes (the pool is %zu) and this "
                 "one has been arriving longest",
                 g->body_bytes, g->body_cap);
        g->body_cut++;
        body_cut(old, why);
        if (old == ep)
            return -1;
    }
    uint8_t *nb = pooled ? body_map(ep, want) : realloc(ep->body, want);
    if (!nb) {
        kvl_proto_on_error(ep->c, KVL_ERR_NOMEM, "out of memory for a frame body");
        return -1;
    }
    ep->body = nb;
    ep->body_cap = want;
    if (g) {
        g->body_bytes = g->body_bytes - ep->body_pooled + pooled;
        ep->body_pooled = pooled;
        if (pooled && !ep->body_listed) { /* the newest: at the tail */
            ep->bl_next = NULL;
            ep->bl_prev = g->body_tail;
            if (g->body_tail)
                g->body_tail->bl_next = ep;
            else
                g->body_head = ep;
            g->body_tail = ep;
            ep->body_listed = 1;
        }
    }
    return 0;
}

/* A body still arriving past its deadline (set from its header) is cut. */
static int body_late(kvl_ep *ep, uint64_t now)
{
    if (ep->rs != RS_BODY || now <= ep->body_deadline_ns || ep->dead)
        return 0;
    char why[160];
    snprintf(why, sizeof why,
             "not in within connect_timeout + its length at %u KiB/s of its header",
             BODY_MIN_RATE >> 10);
    kvl_tcp_budget *g = kvl_tcp_budget_of(ep->a);
    if (g)
        g->body_late++;
    body_cut(ep, why);
    return 1;
}

/* Header and body are in: the core routes the frame; a payload follows. */
static void on_body(kvl_ep *ep)
{
    /* before the core sees the ACK: the chunk it settles must not wait on
     * its own copy's hold (a forged ACK lets go early of memory only the
     * peer itself reads) */
    if (ep->h.type == KVL_F_ACK && (ep->nheld || (ep->mv_ops && ep->sq)))
        held_acked(ep, ep->body, ep->h.body_len);
    kvl_proto_on_frame(ep->c, &ep->h, ep->body);
    if (ep->dead || ep->refused)
        return;
    if (ep->body_cap > BODY_FREE)
        body_release(ep); /* the core is done with it: a large body does not stay held */
    int oob = ep->h.payload_len && (ep->h.flags & KVL_HF_OOB);
    if (ep->h.type == KVL_F_READ_RESP && !oob && ep->oob_reads)
        ep->oob_reads--; /* in-stream or a refusal: the peer puts nothing for it */
    if (oob) {
        /* the core allowed OOB on this connection only (its mover is set up) */
        if (!ep->mv) {
            kvl_proto_on_error(ep->c, KVL_ERR_PROTOCOL,
                               "a frame with header flag OOB on a path whose mover is gone");
            return;
        }
        if (ep->cov_cap < 4) {
            uint8_t *nb = realloc(ep->cov, 4);
            if (!nb) {
                kvl_proto_on_error(ep->c, KVL_ERR_NOMEM, "out of memory for a cover");
                return;
            }
            ep->cov = nb;
            ep->cov_cap = 4;
        }
        ep->rs = RS_COVER;
        ep->cov_got = 0;
        ep->cov_need = 4;
    } else if (ep->h.payload_len) {
        ep->rx_pull = 0;
        payload_begin(ep);
    } else {
        ep->rs = RS_HDR;
        ep->hdr_got = 0;
        /* a DATA frame of zero-length pieces: its payload (none, and no
         * trailer) is over, and the core answers it (an ACK refusing the
         * pieces, wire-protocol.md) as it answers every DATA at its end */
        if (ep->h.type == KVL_F_DATA)
            kvl_proto_on_payload(ep->c, 0, 0);
    }
}

static int on_header(kvl_ep *ep)
{
    kvl_err de = kvl_hdr_decode(ep->hdr, &ep->h);
    if (de == KVL_ERR_HANDSHAKE && !ep->got_frame) {
        /* another protocol version: the core tells the initiator why
         * (HandshakeError there, not a bare reset) and refuses us */
        char why[256];
        snprintf(why, sizeof why, "%s", kvl_last_error());
        kvl_proto_on_version(ep->c, why);
        return -1;
    }
    if (de) {
        kvl_proto_on_error(ep->c, KVL_ERR_PROTOCOL, kvl_last_error());
        return -1;
    }
    ep->got_frame = 1;
    if (ep->h.body_len > kvl_proto_max_body(ep->c)) {
        char why[96];
        snprintf(why, sizeof why, "a frame body of %u bytes where at most %u are taken",
                 ep->h.body_len, kvl_proto_max_body(ep->c));
        kvl_proto_on_error(ep->c, KVL_ERR_PROTOCOL, why);
        return -1;
    }
    /* the buffer grows as the body arrives (body_grow), within a deadline */
    ep->body_got = 0;
    ep->body_deadline_ns = kvl_now_ns() +
                           (uint64_t)ep->a->cfg.connect_timeout_ms * 1000000ull +
                           (uint64_t)ep->h.body_len * 1000000000ull / BODY_MIN_RATE;
    ep->rs = RS_BODY;
    if (ep->h.body_len == 0)
        on_body(ep);
    return 0;
}

static void ep_read(kvl_ep *ep)
{
    size_t budget = IO_BUDGET;
    int frames = 0;
    while (!ep->dead && budget && !ep->refused && !ep->rx_busy) {
        if (ep->rs == RS_HDR && ep->hdr_got == 0 && (rx_gated(ep) || frames >= READ_FRAMES)) {
            /* between frames: paused, or the others' turn (level-triggered,
             * ep comes back); woken by the next header's first byte */
            set_lowat(ep, 0);
            break;
        }
        ssize_t n;
        switch (ep->rs) {
        case RS_HDR:
            n = recv(ep->fd, ep->hdr + ep->hdr_got, KVL_HDR_BYTES - ep->hdr_got, MSG_DONTWAIT);
            break;
        case RS_BODY: {
            if (ep->body_got == ep->body_cap && body_grow(ep))
                return;
            size_t room = (ep->body_cap < ep->h.body_len ? ep->body_cap : ep->h.body_len) -
                          ep->body_got;
            n = recv(ep->fd, ep->body + ep->body_got, room, MSG_DONTWAIT);
            break;
        }
        case RS_COVER:
            n = recv(ep->fd, ep->cov + ep->cov_got, ep->cov_need - ep->cov_got, MSG_DONTWAIT);
            break;
        case RS_PAYLOAD: {
            int ndst;
            const struct iovec *dst = kvl_proto_sink(ep->c, &ndst);
            size_t scratch_len;
            uint8_t *scratch = kvl_engine_scratch(ep->a, &scratch_len);
            n = read_payload(ep, dst, ndst, kvl_proto_payload_live(ep->c), scratch, scratch_len);
            break;
        }
        default:
            n = recv(ep->fd, ep->trailer + ep->trailer_got, 4 - ep->trailer_got, MSG_DONTWAIT);
            break;
        }
        if (n == 0) {
            kvl_proto_on_error(ep->c, KVL_ERR_CONN_LOST,
                               ep->rs == RS_HDR && ep->hdr_got == 0
                                   ? "connection closed by the peer"
                                   : "connection closed mid-frame");
            return;
        }
        if (n < 0) {
            if (errno == EAGAIN || errno == EINTR)
                set_lowat(ep, ep->rs == RS_PAYLOAD);
            else
                fail(ep, KVL_ERR_CONN_LOST, rx_what(ep), errno);
            return;
        }
        budget = (size_t)n >= budget ? 0 : budget - (size_t)n;
        uint64_t now = kvl_now_ns();
        __atomic_store_n(&ep->t_rx_ns, now, __ATOMIC_RELAXED);
        switch (ep->rs) {
        case RS_HDR:
            ep->hdr_got += (size_t)n;
            if (ep->hdr_got < KVL_HDR_BYTES)
                break;
            if (on_header(ep))
                return;
            /* a frame costs the core by its body (a READ_REQ of 8192 pieces
             * is 8192 lookups): one large body is many small frames' turn */
            frames += 1 + (int)(ep->h.body_len / FRAME_BODY_UNIT);
            break;
        case RS_BODY:
            ep->body_got += (size_t)n;
            if (ep->body_got == ep->h.body_len)
                on_body(ep);
            else if (body_late(ep, now))
                return;
            break;
        case RS_COVER:
            ep->cov_got += (size_t)n;
            if (ep->cov_got == ep->cov_need && on_cover(ep))
                return;
            break;
        case RS_PAYLOAD:
            if (ep->pay_got == ep->h.payload_len)
                ep->rs = RS_TRAILER;
            break;
        default:
            ep->trailer_got += (size_t)n;
            if (ep->trailer_got == 4) {
                uint32_t want = (uint32_t)ep->trailer[0] | (uint32_t)ep->trailer[1] << 8 |
                                (uint32_t)ep->trailer[2] << 16 | (uint32_t)ep->trailer[3] << 24;
                if (!ep->dead)
                    ep->rx_payload += ep->h.payload_len;
                ep->rs = RS_HDR;
                ep->hdr_got = 0;
                if (ep->rx_pull && ep->rx_fault)
                    ep->crc = ~want;
                ep->rx_pull = 0;
                if (ep->rx_put) {
                    ep->rx_put = 0;
                    ep->crc = placed_crc(ep, want);
                    ep->put_rx += ep->h.payload_len;
                    if (ep->h.type == KVL_F_READ_RESP && ep->oob_reads)
                        ep->oob_reads--; /* written before its trailer: placed */
                }
                kvl_proto_on_payload(ep->c, ep->crc, want);
            }
            break;
        }
    }
}

/* ---- results of the I/O threads (engine) ---- */

static void tx_finished(kvl_ep *ep, int err)
{
    kvl_out *o = ep->sq;
    ep->tx_busy = 0;
    o->in_job = 0;
    if (err) {
        fail(ep, KVL_ERR_CONN_LOST, "send", err);
        return;
    }
    ep->sq = o->next;
    ep->sq_len--;
    if (!ep->sq)
        ep->sq_tail = NULL;
    out_free(ep, o);
    ep_write(ep); /* the next frame, or stop watching for room */
    if (!ep->dead)
        watch_update(ep);
}

static void rx_finished(kvl_ep *ep, int err)
{
    ep->rx_busy = 0;
    if (err == -1) {
        kvl_proto_on_error(ep->c, KVL_ERR_CONN_LOST, "connection closed mid-frame");
        return;
    }
    if (err) {
        fail(ep, KVL_ERR_CONN_LOST, rx_what(ep), err);
        return;
    }
    uint32_t want = (uint32_t)ep->trailer[0] | (uint32_t)ep->trailer[1] << 8 |
                    (uint32_t)ep->trailer[2] << 16 | (uint32_t)ep->trailer[3] << 24;
    ep->rx_payload += ep->h.payload_len;
    ep->rs = RS_HDR;
    ep->hdr_got = 0;
    if (ep->rx_pull && ep->rx_fault)
        ep->crc = ~want;
    ep->rx_pull = 0;
    kvl_proto_on_payload(ep->c, ep->crc, want);
    if (!ep->dead)
        watch_update(ep); /* reading again: the next header */
}

static void tcp_progress(kvl_agent *a)
{
    kvl_ep *ep;
    while ((ep = kvl_tcp_pool_next_done(a))) {
        pthread_mutex_lock(&ep->jmu);
        int tx = ep->tx_fin, rx = ep->rx_fin, txe = ep->tx_err, rxe = ep->rx_err;
        ep->tx_fin = ep->rx_fin = ep->tx_err = ep->rx_err = 0;
        pthread_mutex_unlock(&ep->jmu);
        if (tx && !ep->dead)
            tx_finished(ep, txe);
        if (rx && !ep->dead)
            rx_finished(ep, rxe);
    }
}

static void tcp_revoke(kvl_ep *ep)
{
    if (ep->mv && (ep->mv_ops->caps & KVL_MV_ONE_SIDED) && !ep->dead) {
        /* the peer's puts land without us and cannot be drained: our end
         * is destroyed, so nothing lands once this returns (docs/ucx.md,
         * "Fence = the receiver destroys its end"); the path reconnects */
        mover_fence(ep, "a push its peer may still be putting was revoked here");
        return;
    }
    if (!ep->rx_busy)
        return; /* on the engine thread, payload_live is asked before every batch */
    pthread_mutex_lock(&ep->jmu); /* waits out a batch being placed */
    ep->live = 0;
    pthread_mutex_unlock(&ep->jmu);
}

/* ---- lifecycle ---- */

kvl_ep *kvl_tcp_ep_new(kvl_agent *a, int fd, int listener)
{
    kvl_ep *ep = calloc(1, sizeof *ep);
    if (!ep)
        return NULL;
    ep->a = a;
    ep->fd = fd;
    ep->listener = listener;
    ep->spare = listener ? open("/dev/null", O_RDONLY | O_CLOEXEC) : -1;
    pthread_mutex_init(&ep->jmu, NULL);
    return ep;
}

static kvl_err tcp_attach(kvl_ep *ep, kvl_conn *c)
{
    ep->c = c;
    if (kvl_sock_nonblock(ep->fd, 1) != KVL_OK)
        return KVL_ERR_SYSTEM;
    if (kvl_engine_watch(ep->a, ep->fd, ep, EPOLLIN) != 0)
        return kvl_fail_errno("epoll_ctl");
    ep->watched = 1;
    ep->ev_mask = EPOLLIN;
    ep->io = kvl_tcp_pool_pick(ep->a);
    if (ep->mv && ep->mv_ops->attach && ep->mv_ops->attach(ep->mv, ep)) {
        /* the mover cannot run in the event loop: the path runs in-stream */
        char note[sizeof ep->mv_note];
        snprintf(note, sizeof note, "%s cannot run in the event loop (%s): in-stream",
                 ep->mv_ops->name, kvl_last_error());
        tcp_set_mover(ep, ep->mv_ops, NULL, note);
    }
    return KVL_OK;
}

/* Out of descriptors, accept() fails and the connection stays queued, so
 * the (level-triggered) listener would fire again at once, for ever.  The
 * listener holds one spare descriptor: it gives it up to take that
 * connection and close it (the client sees it end instead of hanging),
 * then takes it back.  Returns 0 when nothing could be shed. */
static int shed_one(kvl_ep *l, int err)
{
    if (l->spare < 0)
        return 0;
    close(l->spare);
    int fd = accept4(l->fd, NULL, NULL, SOCK_CLOEXEC);
    if (fd >= 0)
        close(fd);
    l->spare = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    l->shed++;
    uint64_t now = kvl_now_ns();
    if (now - l->t_shed_log_ns > 1000000000ull) { /* at most one record a second */
        l->t_shed_log_ns = now;
        kvl_log(l->a, KVL_LOG_ERROR, NULL, -1,
                "out of file descriptors (%s): incoming connections are closed unserved "
                "(%llu so far); raise the limit (ulimit -n) or find what holds them",
                strerror(err), (unsigned long long)l->shed);
    }
    return 1;
}

#define LISTEN_PAUSE_NS (100ull * 1000000ull)

/* accept() failed for a reason retrying at once would not cure (out of
 * kernel memory, a descriptor the spare could not free, ...): stop
 * listening until tcp_tick resumes it, instead of firing again at once. */
static void pause_listener(kvl_ep *l, int err)
{
    uint64_t now = kvl_now_ns();
    if (kvl_engine_rewatch(l->a, l->fd, l, 0) == 0)
        l->paused_until_ns = now + LISTEN_PAUSE_NS;
    if (now - l->t_shed_log_ns > 1000000000ull) {
        l->t_shed_log_ns = now;
        kvl_log(l->a, KVL_LOG_ERROR, NULL, -1,
                "accepting a connection failed (%s): not accepting for 100 ms", strerror(err));
    }
}

static void tcp_tick(kvl_ep *ep, uint64_t now)
{
    kvl_tcp_budget *g = ep ? kvl_tcp_budget_of(ep->a) : NULL;
    if (g && g->released >= TRIM_AFTER_BYTES && now - g->t_trim_ns >= TRIM_EVERY_NS) {
        /* connections that left megabytes of unread answers behind: malloc
         * keeps freed blocks of their sizes, so the memory would stay ours */
        malloc_trim(0);
        g->released = 0;
        g->t_trim_ns = now;
    }
    if (ep && ep->listener && !ep->dead && ep->paused_until_ns && now >= ep->paused_until_ns &&
        kvl_engine_rewatch(ep->a, ep->fd, ep, EPOLLIN) == 0)
        ep->paused_until_ns = 0;
}

static void take_accepted(kvl_agent *a, int fd, const kvl_tp_wrap *w);

static void accept_all(kvl_ep *l)
{
    kvl_agent *a = l->a;
    for (;;) {
        int fd = accept4(l->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0 && (errno == EINTR || errno == ECONNABORTED))
            continue;
        if (fd < 0 && (errno == EMFILE || errno == ENFILE) && shed_one(l, errno))
            continue;
        if (fd < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
            pause_listener(l, errno); /* the connection stays queued: no busy loop on it */
            return;
        }
        if (fd < 0)
            return; /* EAGAIN: all taken */
        if (kvl_tcp_tune(fd, a->cfg.sock_buf_bytes) != KVL_OK) {
            close(fd);
            continue;
        }
        take_accepted(a, fd, NULL);
    }
}

/* An accepted connection joins the event loop and the core (w: handed over
 * by another transport, else NULL). */
static void take_accepted(kvl_agent *a, int fd, const kvl_tp_wrap *w)
{
    kvl_ep *ep = kvl_tcp_ep_new(a, fd, 0);
    if (!ep) {
        close(fd);
        if (w && w->release)
            w->release(w->arg);
        return;
    }
    if (w) {
        ep->wrapped = 1;
        ep->wrap = *w;
    }
    if (kvl_engine_watch(a, fd, ep, EPOLLIN) != 0) {
        kvl_tcp_ep_free(ep);
        return;
    }
    ep->watched = 1;
    ep->ev_mask = EPOLLIN;
    ep->io = kvl_tcp_pool_pick(a);
    ep->acct = 1; /* a peer's answers and bodies: in the agent's budgets */
    if (!(ep->c = kvl_proto_accepted(a, ep))) {
        kvl_engine_unwatch(a, fd);
        kvl_tcp_ep_free(ep);
    }
}

static void tcp_accept_fd(kvl_agent *a, int fd, const kvl_tp_wrap *w)
{
    if (kvl_sock_nonblock(fd, 1) != KVL_OK) {
        close(fd);
        if (w->release)
            w->release(w->arg);
        return;
    }
    take_accepted(a, fd, w);
}

static kvl_err tcp_adopt(kvl_agent *a, int fd, const kvl_tp_wrap *w, kvl_ep **out)
{
    kvl_ep *ep = kvl_sock_nonblock(fd, 0) == KVL_OK ? kvl_tcp_ep_new(a, fd, 0) : NULL;
    if (!ep) {
        close(fd);
        if (w->release)
            w->release(w->arg);
        return kvl_fail(KVL_ERR_NOMEM, "adopting a connection: out of memory");
    }
    ep->wrapped = 1;
    ep->wrap = *w;
    *out = ep;
    return KVL_OK;
}

/* The mover of ep made progress: a frame waiting for its writes may go on. */
static void mover_progressed(kvl_ep *ep)
{
    if (!ep->dead && ep->sq && !ep->tx_busy)
        ep_write(ep);
}

/* A mover's event source (watch_fd): a pseudo endpoint in the event loop. */
static int tcp_watch_fd(kvl_ep *ep, int fd, void (*fn)(void *arg), void *arg)
{
    kvl_ep *aux = calloc(1, sizeof *aux);
    if (!aux)
        return -1;
    aux->a = ep->a;
    aux->fd = fd;
    aux->spare = -1;
    aux->aux_owner = ep;
    aux->aux_fn = fn;
    aux->aux_arg = arg;
    pthread_mutex_init(&aux->jmu, NULL);
    if (kvl_engine_watch(ep->a, fd, aux, EPOLLIN) != 0) {
        pthread_mutex_destroy(&aux->jmu);
        free(aux);
        return -1;
    }
    aux->aux_next = ep->aux;
    ep->aux = aux;
    return 0;
}

/* Stops watching fd; its pseudo endpoint stays allocated until ep is freed
 * (an event for it may be pending in this loop iteration). */
static void tcp_unwatch_fd(kvl_ep *ep, int fd)
{
    for (kvl_ep *x = ep->aux; x; x = x->aux_next)
        if (x->fd == fd && x->aux_fn) {
            kvl_engine_unwatch(ep->a, fd);
            x->aux_fn = NULL;
            x->fd = -1;
        }
}

static void tcp_mover_failed(kvl_ep *ep, const char *why)
{
    snprintf(ep->mv_broken_why, sizeof ep->mv_broken_why, "%s", why);
    ep->mv_broken = 1;
    watch(ep, 1); /* ep_write fails the connection from the event loop */
}

static void tcp_set_mover(kvl_ep *ep, const kvl_mover_ops *ops, kvl_mover *m,
                          const char *why_not)
{
    if (ep->mv && ep->mv != m)
        ep->mv_ops->free(ep->mv, ep->a->cfg.connect_timeout_ms);
    ep->mv_ops = ops;
    ep->mv = m;
    snprintf(ep->mv_note, sizeof ep->mv_note, "%s", why_not ? why_not : "");
}

static int tcp_note(const kvl_ep *ep, char *out, size_t len)
{
    if (ep->mv) {
        ep->mv_ops->note(ep->mv, out, len);
        return 1;
    }
    snprintf(out, len, "%s", ep->mv_note[0] || !ep->wrapped ? ep->mv_note : ep->wrap.note);
    return 0;
}

static const kvl_mover_ops *tcp_mover(const kvl_ep *ep, kvl_mover **m)
{
    *m = ep->mv;
    return ep->mv ? ep->mv_ops : NULL;
}

static int tcp_addrs(const kvl_ep *ep, struct sockaddr_storage *local,
                     struct sockaddr_storage *peer)
{
    socklen_t ll = sizeof *local, pl = sizeof *peer;
    if (ep->wrapped) {
        *local = ep->wrap.local;
        *peer = ep->wrap.peer;
        return 0;
    }
    if (ep->fd < 0 || getsockname(ep->fd, (struct sockaddr *)local, &ll) < 0 ||
        getpeername(ep->fd, (struct sockaddr *)peer, &pl) < 0)
        return -1;
    return 0;
}

static void tcp_on_event(kvl_ep *ep, uint32_t events)
{
    if (ep->aux_owner) { /* a mover's event source */
        if (ep->aux_fn) {
            ep->aux_fn(ep->aux_arg);
            mover_progressed(ep->aux_owner);
        }
        return;
    }
    if (ep->dead)
        return;
    if (ep->listener) {
        accept_all(ep);
        return;
    }
    if (events & (EPOLLIN | EPOLLHUP | EPOLLERR)) {
        ep_read(ep);
        if (!ep->dead)
            watch_update(ep); /* a pause for its answers starts at the frame's end */
    }
    if (!ep->dead && (events & EPOLLOUT))
        ep_write(ep);
    if (!ep->dead && (events & EPOLLERR)) {
        int soerr = 0;
        socklen_t sl = sizeof soerr;
        getsockopt(ep->fd, SOL_SOCKET, SO_ERROR, &soerr, &sl);
        fail(ep, KVL_ERR_CONN_LOST, "socket error", soerr);
    }
}

static void tcp_close(kvl_ep *ep, int abortive)
{
    if (ep->dead)
        return;
    ep->dead = 1;
    kvl_tcp_budget *g = kvl_tcp_budget_of(ep->a);
    if (g)
        paused_unlist(g, ep);
    ep->ans_paused = 0;
    body_release(ep); /* the pool's bytes are back at once (the buffer is not read again) */
    kvl_tcp_job_kill(ep); /* before the descriptor goes: its I/O thread lets go of it */
    if (abortive)
        kvl_tcp_abort(ep->fd);
    if (ep->watched)
        kvl_engine_unwatch(ep->a, ep->fd);
    close(ep->fd);
    ep->fd = -1;
    if (ep->spare >= 0)
        close(ep->spare);
    ep->spare = -1;
    /* before the frames let go of the memory a mover's writes read */
    if (ep->mv) {
        ep->mv_ops->free(ep->mv, ep->a->cfg.connect_timeout_ms);
        ep->mv = NULL;
    }
    size_t held = ep->sq_bytes;
    while (ep->sq) {
        kvl_out *o = ep->sq;
        ep->sq = o->next;
        out_free(ep, o);
    }
    ep->sq_tail = NULL;
    ep->sq_len = 0;
    if (g && ep->acct)
        g->released += held;
    /* the peer reads nothing of ours any more */
    for (size_t i = 0; i < ep->nheld; i++)
        kvl_proto_release(ep->a, &ep->held[i].hold);
    ep->nheld = 0;
}

void kvl_tcp_ep_free(kvl_ep *ep)
{
    if (!ep)
        return;
    kvl_tcp_budget *g = kvl_tcp_budget_of(ep->a);
    if (g)
        paused_unlist(g, ep);
    ep->ans_paused = 0;
    ep->dead = 1; /* its frames' budget goes back, nothing looks at ep again */
    kvl_tcp_job_forget(ep);
    if (ep->mv) /* a detached endpoint's: no engine watch, nothing in flight */
        ep->mv_ops->free(ep->mv, 0);
    while (ep->aux) {
        kvl_ep *x = ep->aux;
        ep->aux = x->aux_next;
        if (x->aux_fn)
            kvl_engine_unwatch(ep->a, x->fd);
        pthread_mutex_destroy(&x->jmu);
        free(x);
    }
    if (ep->fd >= 0)
        close(ep->fd);
    if (ep->spare >= 0)
        close(ep->spare);
    while (ep->sq) { /* teardown: the agent releases what frames held */
        kvl_out *o = ep->sq;
        ep->sq = o->next;
        memset(&o->f.hold, 0, sizeof o->f.hold);
        out_free(ep, o);
    }
    body_release(ep);
    free(ep->body);
    free(ep->sink);
    free(ep->cov);
    free(ep->held); /* teardown: the agent releases what they held */
    pthread_mutex_destroy(&ep->jmu);
    if (ep->wrapped && ep->wrap.release)
        ep->wrap.release(ep->wrap.arg);
    free(ep);
}

static int tcp_sample_ep(const kvl_ep *ep, kvl_tp_sample *out)
{
    if (ep->dead || kvl_tcp_sample(ep->wrapped ? ep->wrap.sample_fd : ep->fd, out) != 0)
        return -1;
    if (ep->mv && ep->mv_ops->sample) { /* writes the socket does not see */
        out->bytes_acked += ep->put_tx;
        ep->mv_ops->sample(ep->mv, out);
    }
    return 0;
}

static uint64_t tcp_bytes_sent(const kvl_ep *ep)
{
    return __atomic_load_n(&ep->tx_payload, __ATOMIC_RELAXED);
}
static uint64_t tcp_bytes_recv(const kvl_ep *ep) { return ep->rx_payload; }
static uint64_t tcp_bytes_put(const kvl_ep *ep) { return ep->put_tx + ep->put_rx; }

const kvl_stream_ops kvl_tcp_stream = {
    .name = "tcp",
    .listen = kvl_tcp_listen,
    .connect = kvl_tcp_connect,
    .send_all = kvl_tcp_send_all,
    .recv_all = kvl_tcp_recv_all,
    .discard = kvl_tcp_ep_free,
    .adopt = tcp_adopt,
    .accept_fd = tcp_accept_fd,
    .attach = tcp_attach,
    .on_event = tcp_on_event,
    .send = tcp_send,
    .cancel = tcp_cancel,
    .drop_unstarted = tcp_drop_unstarted,
    .has_output = tcp_has_output,
    .queued = tcp_queued,
    .rx_partial_since = tcp_rx_partial_since,
    .refuse = tcp_refuse,
    .tick = tcp_tick,
    .sample = tcp_sample_ep,
    .bytes_sent = tcp_bytes_sent,
    .bytes_recv = tcp_bytes_recv,
    .bytes_put = tcp_bytes_put,
    .close = tcp_close,
    .free = kvl_tcp_ep_free,
    .start = kvl_tcp_pool_start,
    .stop = kvl_tcp_pool_stop,
    .progress = tcp_progress,
    .revoke = tcp_revoke,
    .set_mover = tcp_set_mover,
    .mover = tcp_mover,
    .note = tcp_note,
    .addrs = tcp_addrs,
    .watch_fd = tcp_watch_fd,
    .unwatch_fd = tcp_unwatch_fd,
    .mover_failed = tcp_mover_failed,
};
