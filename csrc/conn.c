/* conn.c: one TCP connection as seen by the engine thread.
 *
 * Receive side: a state machine (header -> body -> payload -> trailer) that
 * reads payload bytes straight into their destination (a registered region,
 * or a scratch sink when the bytes must be drained), folding them into the
 * crc32c while they are still in cache.  Every header is checked against the
 * regions this agent exposes before one payload byte is placed.
 *
 * Send side: a queue of frames; a frame's payload is an iovec over the
 * sender's registered memory, so the only copy is the kernel's.
 *
 * Everything here runs on the engine thread only.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "internal.h"

#define IO_BATCH (2u << 20)  /* bytes per syscall: fewer wakeups, and the crc pass still hits L2 */
#define IO_BUDGET (8u << 20) /* bytes per readiness event before serving others */
#define MAX_IOV 64

enum { RS_HDR, RS_BODY, RS_PAYLOAD, RS_TRAILER };

struct kvl_out {
    kvl_out *next;
    kvl_buf head;          /* header + body */
    size_t head_sent;
    struct iovec *iov;     /* payload over registered memory (borrowed) */
    int iovcnt, iov_idx;
    size_t iov_off;
    uint64_t payload_len, payload_sent;
    uint32_t crc;
    uint8_t trailer[4];
    size_t trailer_sent;
    kvl_xfer *xfer;        /* DATA frames: holds an io_ref */
    kvl_region **refs;     /* READ_RESP frames: regions held until sent */
    int nrefs;
    int chunk_frame;       /* DATA or READ_REQ: belongs to a transfer's chunk */
    uint64_t xid;          /* chunk frames: transfer id, chunk and attempt */
    uint32_t chunk, attempt;
    int cancelled;         /* the rest of the payload comes from zeros, not our memory */
};

/* A cancelled DATA frame's remaining payload is sent from here: the stream
 * must stay whole, and the receiver drains the bytes (its chunk is settled). */
static const uint8_t zeros[256u << 10];

struct kvl_conn {
    kvl_agent *a;
    int fd;
    int listener;
    int kind;              /* kvl_conn_kind, once known */
    int handshaken;
    int outbound;
    kvl_peer *peer;        /* outbound: the peer and path this serves */
    int path;
    char peer_name[KVL_NAME_MAX]; /* inbound: from HELLO */
    kvl_inbound *ib;
    int rx_path;           /* inbound data: the sender's path index (HELLO) */
    uint64_t serial;       /* unique per agent: tells a reconnected path's connection apart */
    uint64_t t_open_ns;
    int dead;
    int close_after_flush;
    /* receive */
    int rs;
    uint8_t hdr[KVL_HDR_BYTES];
    size_t hdr_got;
    kvl_frame_hdr h;
    uint8_t *body;
    size_t body_cap, body_got;
    struct iovec *dst;     /* iov_base NULL = drain into scratch */
    int ndst, dst_cap, dst_idx;
    size_t dst_off;
    uint64_t pay_got;
    uint32_t crc;
    uint8_t trailer[4];
    size_t trailer_got;
    /* what the payload in progress belongs to */
    kvl_msg_status pst;    /* DATA: the ACK we will send */
    kvl_rx_xfer *rx;       /* DATA: ownership entry while this copy places bytes */
    int drained;           /* DATA: this copy is not placed; answer pst.status as is */
    kvl_xfer *px;          /* READ_RESP: the transfer being filled (io_ref held) */
    kvl_region **prefs;
    int nprefs, prefs_cap;
    /* send */
    kvl_out *sq, *sq_tail;
    int epout;
    int lowat;             /* SO_RCVLOWAT in force (0 = the kernel's default of 1) */
    int lowat_max;         /* its ceiling for the payload in progress (set_lowat) */
    uint64_t tx_payload, rx_payload;
    kvl_conn *next, *prev;
};

static void ep_set(kvl_conn *c, int out)
{
    /* a refused connection is read no more: only its answer goes out */
    uint32_t in = c->close_after_flush ? 0 : EPOLLIN;
    struct epoll_event ev = {.events = in | (out ? EPOLLOUT : 0), .data.ptr = c};
    if (c->epout != out && epoll_ctl(c->a->epfd, EPOLL_CTL_MOD, c->fd, &ev) == 0)
        c->epout = out;
}

/* Refuses the connection: nothing it sends from now on is read (a refused
 * HELLO must not let the frames behind it through); it closes once its
 * answer is out. */
static void refuse(kvl_conn *c)
{
    c->close_after_flush = 1;
    c->epout = -1; /* force the epoll update without EPOLLIN */
    ep_set(c, 1);
}

kvl_conn *kvl_conn_new(kvl_agent *a, int fd, int listener)
{
    kvl_conn *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    c->a = a;
    c->fd = fd;
    c->listener = listener;
    c->path = -1;
    c->serial = ++a->next_conn_serial;
    c->t_open_ns = kvl_now_ns();
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
    if (epoll_ctl(a->epfd, EPOLL_CTL_ADD, fd, &ev) < 0) {
        free(c);
        return NULL;
    }
    c->next = a->conns;
    if (a->conns)
        a->conns->prev = c;
    a->conns = c;
    return c;
}

void kvl_conn_bind_outbound(kvl_conn *c, kvl_peer *p, int path)
{
    c->outbound = 1;
    c->handshaken = 1;
    c->peer = p;
    c->path = path;
    c->kind = path < 0 ? KVL_CONN_CONTROL : KVL_CONN_DATA;
    strcpy(c->peer_name, p->name);
}

int kvl_conn_is_dead(const kvl_conn *c) { return c->dead; }
uint64_t kvl_conn_serial(const kvl_conn *c) { return c->serial; }
int kvl_conn_sample(const kvl_conn *c, kvl_tcp_sample *out)
{
    return c->dead ? -1 : c->a->tp->sample(c->fd, out);
}

void kvl_conn_abort(kvl_conn *c, const char *why)
{
    if (c->dead)
        return;
    c->a->tp->abort(c->fd);
    kvl_conn_fail(c, KVL_ERR_CONN_LOST, why);
}
uint64_t kvl_conn_bytes_sent(const kvl_conn *c) { return c->tx_payload; }
uint64_t kvl_conn_bytes_recv(const kvl_conn *c) { return c->rx_payload; }

/* ---- send queue ---- */

static void out_free(kvl_agent *a, kvl_out *o)
{
    if (o->xfer) {
        o->xfer->io_refs--;
    }
    for (int i = 0; i < o->nrefs; i++)
        kvl_regions_release(&a->regions, o->refs[i]);
    free(o->refs);
    free(o->iov);
    kvl_buf_free(&o->head);
    free(o);
}

static void enqueue(kvl_conn *c, kvl_out *o)
{
    if (c->sq_tail)
        c->sq_tail->next = o;
    else
        c->sq = o;
    c->sq_tail = o;
    ep_set(c, 1);
}

int kvl_conn_send_frame(kvl_conn *c, kvl_buf *buf)
{
    kvl_out *o = c->dead || buf->oom ? NULL : calloc(1, sizeof *o);
    if (!o) {
        kvl_buf_free(buf);
        return -1;
    }
    o->head = *buf;
    memset(buf, 0, sizeof *buf);
    enqueue(c, o);
    return 0;
}

/* Adds [p, p+len) to an iovec array, merging with the previous entry when
 * contiguous (paged KV blocks often are). */
static void iov_add(struct iovec *v, int *n, void *p, size_t len)
{
    if (*n && (uint8_t *)v[*n - 1].iov_base + v[*n - 1].iov_len == (uint8_t *)p) {
        v[*n - 1].iov_len += len;
        return;
    }
    v[*n].iov_base = p;
    v[*n].iov_len = len;
    (*n)++;
}

int kvl_conn_send_chunk(kvl_conn *c, kvl_xfer *x, uint32_t ci)
{
    if (c->dead)
        return -1;
    const kvl_chunk *ch = &x->plan.chunks[ci];
    const kvl_piece *pc = &x->plan.pieces[ch->first_piece];
    int push = x->op == KVL_OP_PUSH;
    kvl_out *o = calloc(1, sizeof *o);
    if (!o)
        return -1;
    kvl_frame_start(&o->head);
    kvl_enc_chunk(&o->head, x->id, ci, x->attempt[ci], ch->n_pieces);
    for (uint32_t i = 0; i < ch->n_pieces; i++) {
        const kvl_segment *s = &x->segs[pc[i].seg];
        kvl_wire_piece wp = {
            .region = push ? s->dst_region : s->src_region,
            .offset = (push ? s->dst_offset : s->src_offset) + pc[i].seg_offset,
            .len = pc[i].len,
        };
        kvl_enc_piece(&o->head, &wp);
    }
    if (push) {
        o->iov = malloc(ch->n_pieces * sizeof *o->iov);
        if (!o->iov)
            o->head.oom = 1;
        else
            for (uint32_t i = 0; i < ch->n_pieces; i++)
                iov_add(o->iov, &o->iovcnt, x->local_ptr[pc[i].seg] + pc[i].seg_offset,
                        pc[i].len);
        o->payload_len = ch->bytes;
        o->xfer = x;
        x->io_refs++;
    }
    o->chunk_frame = 1;
    o->xid = x->id;
    o->chunk = ci;
    o->attempt = x->attempt[ci];
    kvl_frame_finish(&o->head, push ? KVL_F_DATA : KVL_F_READ_REQ, o->payload_len);
    if (o->head.oom) {
        out_free(c->a, o);
        return -1;
    }
    enqueue(c, o);
    return 0;
}

kvl_conn *kvl_conn_next(const kvl_conn *c) { return c->next; }
int kvl_conn_has_output(const kvl_conn *c) { return !c->dead && c->sq != NULL; }

void kvl_conn_drop_unstarted(kvl_conn *c)
{
    kvl_out **pp = &c->sq;
    c->sq_tail = NULL;
    while (*pp) {
        kvl_out *o = *pp;
        if (o->chunk_frame && o->head_sent == 0) {
            *pp = o->next;
            out_free(c->a, o);
        } else {
            c->sq_tail = o;
            pp = &o->next;
        }
    }
}

int kvl_conn_cancel_chunk(kvl_conn *c, uint64_t xid, uint32_t ci, uint32_t attempt)
{
    if (c->dead)
        return 0;
    for (kvl_out **pp = &c->sq, *prev = NULL; *pp; prev = *pp, pp = &(*pp)->next) {
        kvl_out *o = *pp;
        if (!o->chunk_frame || o->xid != xid || o->chunk != ci || o->attempt != attempt)
            continue;
        if (o->head_sent == 0) { /* not started: it simply never goes out */
            *pp = o->next;
            if (c->sq_tail == o)
                c->sq_tail = prev;
            out_free(c->a, o);
            if (!c->sq)
                ep_set(c, 0);
            return 1;
        }
        if (o->payload_len && !o->cancelled) {
            /* mid-frame: the rest goes out as zeros with a trailer that
             * cannot match, and our memory is let go of right now */
            o->cancelled = 1;
            if (o->xfer) {
                o->xfer->io_refs--;
                o->xfer = NULL;
            }
        }
        return 1;
    }
    return 0;
}

/* Advances o over n payload bytes just sent, folding them into the crc. */
static void out_advance_payload(kvl_out *o, size_t n)
{
    if (o->cancelled) {
        o->payload_sent += n;
        return;
    }
    while (n) {
        struct iovec *v = &o->iov[o->iov_idx];
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

static void conn_write(kvl_conn *c)
{
    size_t budget = IO_BUDGET;
    while (c->sq && budget && !c->dead) {
        kvl_out *o = c->sq;
        struct iovec v[MAX_IOV];
        int n = 0;
        size_t want = 0;
        if (o->head_sent < o->head.len) {
            v[n].iov_base = o->head.p + o->head_sent;
            v[n++].iov_len = o->head.len - o->head_sent;
            want += o->head.len - o->head_sent;
        }
        if (o->payload_sent < o->payload_len && o->cancelled) {
            uint64_t rest = o->payload_len - o->payload_sent;
            v[n].iov_base = (void *)zeros;
            v[n++].iov_len = rest < sizeof zeros ? (size_t)rest : sizeof zeros;
        } else if (o->payload_sent < o->payload_len) {
            int idx = o->iov_idx;
            size_t off = o->iov_off;
            while (n < MAX_IOV && idx < o->iovcnt && want < IO_BATCH) {
                size_t len = o->iov[idx].iov_len - off;
                if (len > IO_BATCH - want)
                    len = IO_BATCH - want;
                v[n].iov_base = (uint8_t *)o->iov[idx].iov_base + off;
                v[n++].iov_len = len;
                want += len;
                idx++;
                off = 0;
            }
        } else if (o->payload_len && o->trailer_sent < 4) {
            if (o->trailer_sent == 0) {
                uint32_t t = o->cancelled ? ~o->crc : o->crc; /* a cancelled copy never verifies */
                for (int i = 0; i < 4; i++)
                    o->trailer[i] = (uint8_t)(t >> (8 * i));
            }
            v[n].iov_base = o->trailer + o->trailer_sent;
            v[n++].iov_len = 4 - o->trailer_sent;
        }
        if (n == 0)
            goto frame_done;
        struct msghdr mh = {.msg_iov = v, .msg_iovlen = (size_t)n};
        ssize_t got = sendmsg(c->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (got < 0) {
            if (errno == EAGAIN || errno == EINTR)
                return;
            char why[160];
            snprintf(why, sizeof why, "send: %s", strerror(errno));
            kvl_conn_fail(c, KVL_ERR_CONN_LOST, why);
            return;
        }
        size_t left = (size_t)got;
        budget = left >= budget ? 0 : budget - left;
        if (o->head_sent < o->head.len) {
            size_t h = o->head.len - o->head_sent;
            if (h > left)
                h = left;
            o->head_sent += h;
            left -= h;
        }
        if (left && o->payload_sent < o->payload_len) {
            out_advance_payload(o, left);
            c->tx_payload += left;
            left = 0;
        }
        if (left)
            o->trailer_sent += left;
        if (o->head_sent < o->head.len || o->payload_sent < o->payload_len ||
            (o->payload_len && o->trailer_sent < 4))
            continue;
    frame_done:
        c->sq = o->next;
        if (!c->sq)
            c->sq_tail = NULL;
        out_free(c->a, o);
    }
    if (!c->sq) {
        ep_set(c, 0);
        if (c->close_after_flush)
            kvl_conn_fail(c, KVL_OK, "closed after refusing the handshake");
    }
}

/* ---- receive helpers ---- */

static int dst_reserve(kvl_conn *c, int n)
{
    if (n <= c->dst_cap)
        return 0;
    struct iovec *nd = realloc(c->dst, (size_t)n * sizeof *nd);
    if (!nd)
        return -1;
    c->dst = nd;
    c->dst_cap = n;
    return 0;
}

static void drain_all(kvl_conn *c)
{
    c->ndst = 0;
    dst_reserve(c, 1);
    c->dst[0].iov_base = NULL;
    c->dst[0].iov_len = c->h.payload_len;
    c->ndst = 1;
}

static void release_prefs(kvl_conn *c)
{
    for (int i = 0; i < c->nprefs; i++)
        kvl_regions_release(&c->a->regions, c->prefs[i]);
    c->nprefs = 0;
}

static int prefs_push(kvl_conn *c, kvl_region *r)
{
    if (c->nprefs == c->prefs_cap) {
        int ncap = c->prefs_cap ? c->prefs_cap * 2 : 8;
        kvl_region **nr = realloc(c->prefs, (size_t)ncap * sizeof *nr);
        if (!nr)
            return -1;
        c->prefs = nr;
        c->prefs_cap = ncap;
    }
    c->prefs[c->nprefs++] = r;
    return 0;
}

/* Checks every piece of a DATA/READ_REQ body against our regions with the
 * rights `need`; on success the regions are referenced in c->prefs and the
 * pieces' addresses are in c->dst.  On failure *st carries the reason. */
static int resolve_pieces(kvl_conn *c, const kvl_msg_chunk *m, uint32_t need,
                          kvl_msg_status *st, uint64_t *total)
{
    kvl_region *last = NULL;
    *total = 0;
    c->ndst = 0;
    if (dst_reserve(c, (int)m->n_pieces)) {
        st->status = KVL_ERR_NOMEM;
        snprintf(st->msg, sizeof st->msg, "receiver out of memory");
        return -1;
    }
    for (uint32_t i = 0; i < m->n_pieces; i++) {
        kvl_wire_piece p;
        kvl_dec_piece(m, i, &p);
        if (!last || last->id != p.region || p.offset > last->size ||
            p.len > last->size - p.offset) {
            char what[96];
            snprintf(what, sizeof what, "chunk %u piece %u on agent '%s'", m->chunk, i,
                     c->a->name);
            kvl_region *r;
            kvl_err e = kvl_regions_acquire(&c->a->regions, p.region, p.offset, p.len, need,
                                            what, &r);
            if (e || prefs_push(c, r)) {
                if (!e)
                    kvl_regions_release(&c->a->regions, r);
                st->status = e ? e : KVL_ERR_NOMEM;
                snprintf(st->msg, sizeof st->msg, "%s", e ? kvl_last_error() : "out of memory");
                release_prefs(c);
                return -1;
            }
            last = r;
        }
        if (p.len == 0 || *total + p.len > KVL_MAX_CHUNK) {
            st->status = KVL_ERR_PROTOCOL;
            snprintf(st->msg, sizeof st->msg, "chunk %u piece %u has a bad length", m->chunk, i);
            release_prefs(c);
            return -1;
        }
        *total += p.len;
        iov_add(c->dst, &c->ndst, last->base + p.offset, p.len);
    }
    return 0;
}

static void send_status(kvl_conn *c, uint8_t type, const kvl_msg_status *st, kvl_out *o)
{
    kvl_buf b = {0};
    kvl_frame_start(&b);
    kvl_enc_status(&b, st);
    kvl_frame_finish(&b, type, o ? o->payload_len : 0);
    if (!o) {
        kvl_conn_send_frame(c, &b);
        return;
    }
    o->head = b;
    if (b.oom) {
        out_free(c->a, o);
        return;
    }
    enqueue(c, o);
}

static void send_region_table(kvl_conn *c, uint8_t type, uint32_t status, const char *msg)
{
    kvl_region_info *tab = NULL;
    size_t n = 0;
    if (status == KVL_OK && c->kind == KVL_CONN_CONTROL &&
        kvl_regions_snapshot(&c->a->regions, &tab, &n) != KVL_OK) {
        kvl_conn_fail(c, KVL_ERR_NOMEM, "out of memory for the region table");
        return;
    }
    kvl_buf b = {0};
    kvl_frame_start(&b);
    kvl_enc_hello_ack(&b, status, c->a->instance, c->a->name, msg, tab, n);
    kvl_frame_finish(&b, type, 0);
    free(tab);
    kvl_conn_send_frame(c, &b);
}

/* ---- frame handlers ---- */

static void on_hello(kvl_conn *c)
{
    kvl_msg_hello m;
    if (kvl_dec_hello(c->body, c->h.body_len, &m)) {
        kvl_conn_fail(c, KVL_ERR_PROTOCOL, kvl_last_error());
        return;
    }
    c->kind = m.kind;
    c->rx_path = m.path;
    c->handshaken = 1;
    strcpy(c->peer_name, m.name);
    kvl_agent *a = c->a;
    char msg[256] = "";
    uint32_t status = KVL_OK;
    kvl_inbound *ib;
    for (ib = a->inbound; ib; ib = ib->next)
        if (strcmp(ib->name, m.name) == 0)
            break;
    if (strcmp(m.name, a->name) == 0) {
        status = KVL_ERR_DUPLICATE_NAME;
        snprintf(msg, sizeof msg,
                 "agent '%s' refused a connection from an agent with its own name; every "
                 "agent needs a unique name",
                 a->name);
    } else if (ib && ib->conns > 0 && ib->instance != m.instance) {
        status = KVL_ERR_DUPLICATE_NAME;
        snprintf(msg, sizeof msg,
                 "agent '%s' already has a live peer named '%s' (instance %016llx); agent "
                 "names must be unique: rename one of them",
                 a->name, m.name, (unsigned long long)ib->instance);
    } else {
        if (!ib) {
            ib = calloc(1, sizeof *ib);
            if (!ib) {
                kvl_conn_fail(c, KVL_ERR_NOMEM, "out of memory");
                return;
            }
            strcpy(ib->name, m.name);
            ib->next = a->inbound;
            a->inbound = ib;
        }
        ib->instance = m.instance;
        ib->conns++;
        c->ib = ib;
    }
    send_region_table(c, KVL_F_HELLO_ACK, status, msg);
    if (status != KVL_OK)
        refuse(c);
}

static void on_data(kvl_conn *c)
{
    kvl_msg_chunk m;
    if (kvl_dec_chunk(c->body, c->h.body_len, &m)) {
        kvl_conn_fail(c, KVL_ERR_PROTOCOL, kvl_last_error());
        return;
    }
    memset(&c->pst, 0, sizeof c->pst);
    c->pst.xfer = m.xfer;
    c->pst.chunk = m.chunk;
    c->pst.attempt = m.attempt;
    c->drained = 0;
    uint64_t declared = 0, total;
    for (uint32_t i = 0; i < m.n_pieces; i++) {
        kvl_wire_piece p;
        kvl_dec_piece(&m, i, &p);
        declared += p.len > KVL_MAX_CHUNK ? KVL_MAX_CHUNK + 1 : p.len;
    }
    if (declared != c->h.payload_len) {
        kvl_conn_fail(c, KVL_ERR_PROTOCOL, "DATA frame: pieces and payload length disagree");
        return;
    }
    if (resolve_pieces(c, &m, KVL_REMOTE_WRITE, &c->pst, &total) == 0) {
        uint32_t drain_status = KVL_OK;
        uint64_t instance = c->ib ? c->ib->instance : 0;
        if (!kvl_rx_claim(c->a, instance, m.xfer, m.chunk, m.attempt, &c->rx, &drain_status)) {
            /* another copy owns or already verified this chunk: drain ours */
            release_prefs(c);
            c->pst.status = drain_status;
            if (drain_status == KVL_ERR_PROTOCOL)
                snprintf(c->pst.msg, sizeof c->pst.msg,
                         "agent '%s': push %llu was not announced, or has no chunk %u (out of "
                         "room for inbound transfers?)",
                         c->a->name, (unsigned long long)m.xfer, m.chunk);
            c->rx = NULL;
            drain_all(c);
            c->drained = 1;
        }
    }
    if (c->pst.status != KVL_OK)
        drain_all(c);
}

static void on_read_req(kvl_conn *c)
{
    kvl_msg_chunk m;
    if (kvl_dec_chunk(c->body, c->h.body_len, &m)) {
        kvl_conn_fail(c, KVL_ERR_PROTOCOL, kvl_last_error());
        return;
    }
    kvl_msg_status st = {.xfer = m.xfer, .chunk = m.chunk, .attempt = m.attempt};
    uint64_t total = 0;
    kvl_out *o = NULL;
    if (resolve_pieces(c, &m, KVL_REMOTE_READ, &st, &total) == 0) {
        o = calloc(1, sizeof *o);
        struct iovec *iov = o ? malloc((size_t)c->ndst * sizeof *iov) : NULL;
        if (!iov) {
            free(o);
            release_prefs(c);
            kvl_conn_fail(c, KVL_ERR_NOMEM, "out of memory for a READ_RESP");
            return;
        }
        memcpy(iov, c->dst, (size_t)c->ndst * sizeof *iov);
        o->iov = iov;
        o->iovcnt = c->ndst;
        o->payload_len = total;
        /* the frame now owns the region references */
        o->refs = c->prefs;
        o->nrefs = c->nprefs;
        c->prefs = NULL;
        c->nprefs = c->prefs_cap = 0;
    }
    send_status(c, KVL_F_READ_RESP, &st, o);
}

/* The chunk a status frame names, if it is still in flight on this path
 * with the same attempt; anything else is a stale answer and is ignored. */
static kvl_xfer *match_chunk(kvl_conn *c, const kvl_msg_status *st)
{
    kvl_xfer *x = kvl_sched_find_xfer(c->peer, st->xfer);
    if (!x || !kvl_xfer_running(x) || st->chunk >= x->plan.n_chunks)
        return NULL;
    uint32_t ci = st->chunk;
    if (x->cstate[ci] != KVL_CHUNK_INFLIGHT)
        return NULL;
    int primary = x->cpath[ci] == (uint8_t)c->path && x->pattempt[ci] == st->attempt;
    int hedged = x->hpath[ci] == (uint8_t)c->path && x->hattempt[ci] == st->attempt;
    return primary || hedged ? x : NULL;
}

static void on_status_error(kvl_conn *c, kvl_xfer *x, const kvl_msg_status *st)
{
    if (st->status == KVL_RX_SUPERSEDED)
        return; /* a newer copy of this chunk is the one that counts */
    if (st->status == KVL_ERR_CHECKSUM) {
        kvl_sched_requeue(c->peer, x, st->chunk, KVL_ERR_CHECKSUM, st->msg);
        return;
    }
    kvl_err e = st->status > 0 && st->status <= KVL_ERR_DEADLINE ? st->status : KVL_ERR_PROTOCOL;
    kvl_sched_fail(x, e, "peer '%s' refused chunk %u: %s", c->peer->name, st->chunk, st->msg);
}

static void on_ack(kvl_conn *c)
{
    kvl_msg_status st;
    if (kvl_dec_status(c->body, c->h.body_len, &st)) {
        kvl_conn_fail(c, KVL_ERR_PROTOCOL, kvl_last_error());
        return;
    }
    kvl_xfer *x = match_chunk(c, &st);
    if (!x)
        return;
    if (st.status == KVL_OK)
        kvl_sched_on_chunk_done(c->peer, x, st.chunk, (uint32_t)c->path, kvl_now_ns());
    else
        on_status_error(c, x, &st);
}

static void on_read_resp(kvl_conn *c)
{
    kvl_msg_status st;
    if (kvl_dec_status(c->body, c->h.body_len, &st)) {
        kvl_conn_fail(c, KVL_ERR_PROTOCOL, kvl_last_error());
        return;
    }
    memset(&c->pst, 0, sizeof c->pst);
    c->pst = st;
    kvl_xfer *x = match_chunk(c, &st);
    if (x && st.status != KVL_OK) {
        on_status_error(c, x, &st);
        x = NULL;
    }
    if (!x) {
        drain_all(c);
        return;
    }
    const kvl_chunk *ch = &x->plan.chunks[st.chunk];
    if (c->h.payload_len != ch->bytes) {
        kvl_conn_fail(c, KVL_ERR_PROTOCOL, "READ_RESP payload length differs from the request");
        return;
    }
    c->ndst = 0;
    if (dst_reserve(c, (int)ch->n_pieces)) {
        kvl_conn_fail(c, KVL_ERR_NOMEM, "out of memory");
        return;
    }
    const kvl_piece *pc = &x->plan.pieces[ch->first_piece];
    for (uint32_t i = 0; i < ch->n_pieces; i++)
        iov_add(c->dst, &c->ndst, x->local_ptr[pc[i].seg] + pc[i].seg_offset, pc[i].len);
    if (st.attempt < x->powner[st.chunk]) {
        drain_all(c); /* a newer copy of this chunk is already being placed */
        return;
    }
    x->powner[st.chunk] = st.attempt;
    c->px = x;
    x->io_refs++;
}

static void on_notify(kvl_conn *c)
{
    kvl_msg_notify m;
    if (kvl_dec_notify(c->body, c->h.body_len, &m)) {
        kvl_conn_fail(c, KVL_ERR_PROTOCOL, kvl_last_error());
        return;
    }
    if (kvl_notify_inbound(c->a, c->peer_name, c->ib ? c->ib->instance : 0, &m) && m.xfer) {
        kvl_buf b = {0};
        kvl_frame_start(&b);
        kvl_enc_token(&b, m.xfer);
        kvl_frame_finish(&b, KVL_F_NOTIFY_ACK, 0);
        kvl_conn_send_frame(c, &b);
    }
}

static void on_notify_ack(kvl_conn *c)
{
    uint64_t xfer;
    if (kvl_dec_token(c->body, c->h.body_len, &xfer)) {
        kvl_conn_fail(c, KVL_ERR_PROTOCOL, kvl_last_error());
        return;
    }
    kvl_notify_acked(c->peer, xfer);
}

static void on_regions(kvl_conn *c)
{
    kvl_msg_hello_ack m;
    if (kvl_dec_hello_ack(c->body, c->h.body_len, &m)) {
        kvl_conn_fail(c, KVL_ERR_PROTOCOL, kvl_last_error());
        return;
    }
    kvl_peer *p = c->peer;
    kvl_region_info *tab = calloc(m.n_regions ? m.n_regions : 1, sizeof *tab);
    if (!tab) {
        kvl_conn_fail(c, KVL_ERR_NOMEM, "out of memory");
        return;
    }
    for (uint32_t i = 0; i < m.n_regions; i++)
        kvl_dec_region(m.regions, i, &tab[i]);
    pthread_mutex_lock(&p->mu);
    free(p->regions);
    p->regions = tab;
    p->n_regions = m.n_regions;
    p->regions_gen++;
    p->refresh_pending = 0;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

static void on_ping(kvl_conn *c)
{
    uint64_t token;
    if (kvl_dec_token(c->body, c->h.body_len, &token)) {
        kvl_conn_fail(c, KVL_ERR_PROTOCOL, kvl_last_error());
        return;
    }
    kvl_buf b = {0};
    kvl_frame_start(&b);
    kvl_enc_token(&b, token);
    kvl_frame_finish(&b, KVL_F_PONG, 0);
    kvl_conn_send_frame(c, &b);
}

static void on_end(kvl_conn *c)
{
    kvl_msg_status m;
    if (kvl_dec_status(c->body, c->h.body_len, &m)) {
        kvl_conn_fail(c, KVL_ERR_PROTOCOL, kvl_last_error());
        return;
    }
    kvl_rx_end(c->a, c->ib ? c->ib->instance : 0, &m);
}

static void on_announce(kvl_conn *c)
{
    kvl_msg_announce m;
    if (kvl_dec_announce(c->body, c->h.body_len, &m)) {
        kvl_conn_fail(c, KVL_ERR_PROTOCOL, kvl_last_error());
        return;
    }
    /* out of room: its DATA frames are then refused, which fails the push
     * on the sender with that reason */
    kvl_rx_announce(c->a, c->ib ? c->ib->instance : 0, c->peer_name, &m);
}

static void on_pong(kvl_conn *c)
{
    uint64_t token;
    if (kvl_dec_token(c->body, c->h.body_len, &token)) {
        kvl_conn_fail(c, KVL_ERR_PROTOCOL, kvl_last_error());
        return;
    }
    kvl_monitor_on_pong(c->peer, c->path, token, kvl_now_ns());
}

/* A whole body has arrived: route it by type and by what this connection is. */
static void on_body(kvl_conn *c)
{
    uint8_t t = c->h.type;
    if (kvl_crc32c(0, c->body, c->h.body_len) != c->h.body_crc) {
        kvl_conn_fail(c, KVL_ERR_PROTOCOL, "frame body failed its crc32c check");
        return;
    }
    int in_data = !c->outbound && c->kind == KVL_CONN_DATA;
    int in_ctrl = !c->outbound && c->kind == KVL_CONN_CONTROL;
    int out_data = c->outbound && c->kind == KVL_CONN_DATA;
    int out_ctrl = c->outbound && c->kind == KVL_CONN_CONTROL;
    if (!c->handshaken) {
        if (t != KVL_F_HELLO)
            kvl_conn_fail(c, KVL_ERR_PROTOCOL, "first frame is not a HELLO");
        else
            on_hello(c);
    } else if (t == KVL_F_DATA && in_data)
        on_data(c);
    else if (t == KVL_F_READ_REQ && in_data)
        on_read_req(c);
    else if (t == KVL_F_ACK && out_data)
        on_ack(c);
    else if (t == KVL_F_READ_RESP && out_data)
        on_read_resp(c);
    else if (t == KVL_F_NOTIFY && !c->outbound)
        on_notify(c);
    else if (t == KVL_F_REGIONS_REQ && in_ctrl)
        send_region_table(c, KVL_F_REGIONS, KVL_OK, "");
    else if (t == KVL_F_REGIONS && out_ctrl)
        on_regions(c);
    else if (t == KVL_F_PING && !c->outbound)
        on_ping(c);
    else if (t == KVL_F_END && !c->outbound)
        on_end(c);
    else if (t == KVL_F_PONG && out_data)
        on_pong(c);
    else if (t == KVL_F_NOTIFY_ACK && c->outbound)
        on_notify_ack(c);
    else if (t == KVL_F_ANNOUNCE && in_data)
        on_announce(c);
    else {
        char why[96];
        snprintf(why, sizeof why, "unexpected frame type %u on this connection", t);
        kvl_conn_fail(c, KVL_ERR_PROTOCOL, why);
        return;
    }
    if (c->dead)
        return;
    if (c->h.payload_len) {
        c->rs = RS_PAYLOAD;
        c->dst_idx = 0;
        c->dst_off = 0;
        c->pay_got = 0;
        c->crc = 0;
        c->trailer_got = 0;
        /* never more than a quarter of the receive buffer: above what the
         * buffer holds the kernel would grow it and clamp the TCP window to
         * the low-water mark, capping the path's throughput.  Read once per
         * frame; autotuning may grow the buffer between frames. */
        int rcvbuf = 0;
        socklen_t len = sizeof rcvbuf;
        if (getsockopt(c->fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, &len) < 0)
            rcvbuf = 0;
        c->lowat_max = rcvbuf / 4 < (int)IO_BATCH ? rcvbuf / 4 : (int)IO_BATCH;
    } else {
        c->rs = RS_HDR;
        c->hdr_got = 0;
    }
}

static void on_payload_done(kvl_conn *c)
{
    uint32_t want = (uint32_t)c->trailer[0] | (uint32_t)c->trailer[1] << 8 |
                    (uint32_t)c->trailer[2] << 16 | (uint32_t)c->trailer[3] << 24;
    int crc_ok = want == c->crc;
    if (c->h.type == KVL_F_DATA) {
        release_prefs(c);
        if (c->rx) {
            kvl_rx_xfer *r = c->rx;
            c->rx = NULL;
            int owner = kvl_rx_owns(r, c->pst.chunk, c->pst.attempt);
            int settled_elsewhere = !owner && !r->ended && c->pst.chunk < r->n &&
                                    r->chunks[c->pst.chunk].settled;
            kvl_rx_done(r, c->pst.chunk, c->pst.attempt, owner && crc_ok, (uint32_t)c->rx_path,
                        c->h.payload_len);
            if (!owner) { /* lost the chunk to another copy mid-way */
                c->pst.status = settled_elsewhere ? KVL_OK : KVL_RX_SUPERSEDED;
                c->drained = 1;
            }
        }
        if (c->pst.status == KVL_OK && !crc_ok && !c->drained) {
            c->pst.status = KVL_ERR_CHECKSUM;
            snprintf(c->pst.msg, sizeof c->pst.msg,
                     "payload crc32c mismatch on '%s' (computed %08x, sender %08x)", c->a->name,
                     c->crc, want);
        }
        if (c->pst.status == KVL_OK && !c->drained)
            c->rx_payload += c->h.payload_len;
        send_status(c, KVL_F_ACK, &c->pst, NULL);
        return;
    }
    /* READ_RESP */
    kvl_xfer *x = c->px;
    c->px = NULL;
    if (!x)
        return;
    x->io_refs--;
    if (match_chunk(c, &c->pst) == x && x->powner[c->pst.chunk] == c->pst.attempt) {
        if (crc_ok) {
            c->rx_payload += c->h.payload_len;
            kvl_sched_on_chunk_done(c->peer, x, c->pst.chunk, (uint32_t)c->path, kvl_now_ns());
        } else {
            char why[128];
            snprintf(why, sizeof why, "payload crc32c mismatch (computed %08x, sender %08x)",
                     c->crc, want);
            kvl_sched_requeue(c->peer, x, c->pst.chunk, KVL_ERR_CHECKSUM, why);
        }
    }
}

/* Reads payload bytes into the destination cursor.  Returns bytes read,
 * 0 on EOF, -1 with errno on error. */
static ssize_t read_payload(kvl_conn *c)
{
    int lost = c->px && (!kvl_xfer_running(c->px) ||
                         c->px->cstate[c->pst.chunk] == KVL_CHUNK_DONE ||
                         c->px->powner[c->pst.chunk] != c->pst.attempt);
    if (c->rx && !kvl_rx_owns(c->rx, c->pst.chunk, c->pst.attempt))
        lost = 1;
    if (lost) {
        /* the transfer failed, or another copy of this chunk owns it or was
         * verified: the destination must not change through this copy */
        for (int i = c->dst_idx; i < c->ndst; i++)
            c->dst[i].iov_base = NULL;
    }
    struct iovec v[MAX_IOV];
    int n = 0;
    size_t want = 0;
    int idx = c->dst_idx;
    size_t off = c->dst_off;
    if (c->dst[idx].iov_base == NULL) {
        size_t len = c->dst[idx].iov_len - off;
        v[n].iov_base = c->a->scratch;
        v[n++].iov_len = len < c->a->scratch_len ? len : c->a->scratch_len;
    } else {
        while (n < MAX_IOV && idx < c->ndst && want < IO_BATCH && c->dst[idx].iov_base) {
            size_t len = c->dst[idx].iov_len - off;
            if (len > IO_BATCH - want)
                len = IO_BATCH - want;
            v[n].iov_base = (uint8_t *)c->dst[idx].iov_base + off;
            v[n++].iov_len = len;
            want += len;
            idx++;
            off = 0;
        }
    }
    ssize_t got = readv(c->fd, v, n);
    if (got <= 0)
        return got;
    size_t left = (size_t)got;
    for (int i = 0; i < n && left; i++) {
        size_t take = v[i].iov_len < left ? v[i].iov_len : left;
        c->crc = kvl_crc32c(c->crc, v[i].iov_base, take);
        left -= take;
        c->dst_off += take;
        if (c->dst_off == c->dst[c->dst_idx].iov_len) {
            c->dst_idx++;
            c->dst_off = 0;
        }
    }
    c->pay_got += (uint64_t)got;
    return got;
}

/* While a payload is arriving, asks the kernel to wake us only once a whole
 * batch (or the rest of the frame, which the peer must send) is queued: one
 * large readv per wakeup instead of many small ones.  Between frames the
 * default of one byte applies, so headers and ACKs are seen at once. */
static void set_lowat(kvl_conn *c)
{
    int want = 0;
    if (c->rs == RS_PAYLOAD) {
        uint64_t rest = c->h.payload_len - c->pay_got + 4; /* + the crc trailer */
        want = rest > (uint64_t)c->lowat_max ? c->lowat_max : (int)rest;
    }
    if (want == c->lowat)
        return;
    int v = want ? want : 1;
    if (setsockopt(c->fd, SOL_SOCKET, SO_RCVLOWAT, &v, sizeof v) == 0)
        c->lowat = want;
}

static void conn_read(kvl_conn *c)
{
    size_t budget = IO_BUDGET;
    while (!c->dead && budget && !c->close_after_flush) {
        ssize_t n;
        switch (c->rs) {
        case RS_HDR:
            n = recv(c->fd, c->hdr + c->hdr_got, KVL_HDR_BYTES - c->hdr_got, MSG_DONTWAIT);
            break;
        case RS_BODY:
            n = recv(c->fd, c->body + c->body_got, c->h.body_len - c->body_got, MSG_DONTWAIT);
            break;
        case RS_PAYLOAD:
            n = read_payload(c);
            break;
        default:
            n = recv(c->fd, c->trailer + c->trailer_got, 4 - c->trailer_got, MSG_DONTWAIT);
            break;
        }
        if (n == 0) {
            kvl_conn_fail(c, KVL_ERR_CONN_LOST, c->rs == RS_HDR && c->hdr_got == 0
                                                    ? "connection closed by the peer"
                                                    : "connection closed mid-frame");
            return;
        }
        if (n < 0) {
            if (errno == EAGAIN || errno == EINTR) {
                set_lowat(c);
                return;
            }
            char why[160];
            snprintf(why, sizeof why, "recv: %s", strerror(errno));
            kvl_conn_fail(c, KVL_ERR_CONN_LOST, why);
            return;
        }
        budget = (size_t)n >= budget ? 0 : budget - (size_t)n;
        switch (c->rs) {
        case RS_HDR:
            c->hdr_got += (size_t)n;
            if (c->hdr_got < KVL_HDR_BYTES)
                break;
            kvl_err de = kvl_hdr_decode(c->hdr, &c->h);
            if (de == KVL_ERR_HANDSHAKE && !c->handshaken) {
                /* tell the initiator why before hanging up: HandshakeError
                 * there, not a bare connection reset */
                char why[256];
                snprintf(why, sizeof why, "%s", kvl_last_error());
                c->handshaken = 1; /* nothing more is read from it */
                c->kind = KVL_CONN_DATA;
                send_region_table(c, KVL_F_HELLO_ACK, KVL_ERR_HANDSHAKE, why);
                refuse(c);
                conn_write(c);
                return;
            }
            if (de) {
                kvl_conn_fail(c, KVL_ERR_PROTOCOL, kvl_last_error());
                return;
            }
            if (c->h.body_len > c->body_cap) {
                uint8_t *nb = realloc(c->body, c->h.body_len);
                if (!nb) {
                    kvl_conn_fail(c, KVL_ERR_NOMEM, "out of memory for a frame body");
                    return;
                }
                c->body = nb;
                c->body_cap = c->h.body_len;
            }
            c->body_got = 0;
            c->rs = RS_BODY;
            if (c->h.body_len == 0)
                on_body(c);
            break;
        case RS_BODY:
            c->body_got += (size_t)n;
            if (c->body_got == c->h.body_len)
                on_body(c);
            break;
        case RS_PAYLOAD:
            if (c->pay_got == c->h.payload_len)
                c->rs = RS_TRAILER;
            break;
        default:
            c->trailer_got += (size_t)n;
            if (c->trailer_got == 4) {
                on_payload_done(c);
                c->rs = RS_HDR;
                c->hdr_got = 0;
            }
            break;
        }
    }
}

static void accept_all(kvl_conn *l)
{
    kvl_agent *a = l->a;
    for (;;) {
        int fd = accept4(l->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0)
            return; /* EAGAIN, or a transient error such as EMFILE: retried on next event */
        if (a->tp->tune(fd, a->cfg.sock_buf_bytes) != KVL_OK || !kvl_conn_new(a, fd, 0))
            close(fd);
    }
}

void kvl_conn_on_event(kvl_conn *c, uint32_t events)
{
    if (c->dead)
        return;
    if (c->listener) {
        accept_all(c);
        return;
    }
    if (events & (EPOLLIN | EPOLLHUP | EPOLLERR))
        conn_read(c);
    if (!c->dead && (events & EPOLLOUT))
        conn_write(c);
    if (!c->dead && (events & EPOLLERR)) {
        int soerr = 0;
        socklen_t sl = sizeof soerr;
        getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &soerr, &sl);
        char why[160];
        snprintf(why, sizeof why, "socket error: %s", strerror(soerr));
        kvl_conn_fail(c, KVL_ERR_CONN_LOST, why);
    }
}

void kvl_conn_fail(kvl_conn *c, kvl_err err, const char *why)
{
    (void)err;
    if (c->dead)
        return;
    c->dead = 1;
    kvl_agent *a = c->a;
    epoll_ctl(a->epfd, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    c->fd = -1;
    release_prefs(c);
    if (c->rx) {
        kvl_rx_done(c->rx, c->pst.chunk, c->pst.attempt, 0, 0, 0);
        c->rx = NULL;
    }
    if (c->px) {
        c->px->io_refs--;
        c->px = NULL;
    }
    while (c->sq) {
        kvl_out *o = c->sq;
        c->sq = o->next;
        out_free(a, o);
    }
    c->sq_tail = NULL;
    if (c->ib)
        c->ib->conns--;
    if (c->outbound) {
        kvl_notify_conn_lost(c->peer, c);
        if (c->path >= 0) {
            kvl_path *pa = &c->peer->paths[c->path];
            pa->bytes_sent_prev += c->tx_payload;
            pa->bytes_recv_prev += c->rx_payload;
            kvl_sched_path_down(c->peer, (uint32_t)c->path, why);
        } else if (c->peer->ctrl == c) {
            c->peer->ctrl = NULL;
            kvl_monitor_probe_failed(c->peer, &c->peer->ctrl_path, kvl_now_ns(), why);
        }
    }
    /* unlink now, free at the end of the engine iteration */
    if (c->prev)
        c->prev->next = c->next;
    else
        a->conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    c->next = a->dead;
    c->prev = NULL;
    a->dead = c;
}

void kvl_conn_free(kvl_conn *c)
{
    if (c->fd >= 0)
        close(c->fd);
    while (c->sq) {
        kvl_out *o = c->sq;
        c->sq = o->next;
        o->xfer = NULL; /* teardown: transfers are released by the agent */
        o->nrefs = 0;
        out_free(c->a, o);
    }
    free(c->prefs);
    free(c->body);
    free(c->dst);
    free(c);
}

void kvl_conn_expire(kvl_agent *a, uint64_t now)
{
    uint64_t limit = (uint64_t)a->cfg.connect_timeout_ms * 1000000ull;
    for (kvl_conn *c = a->conns, *next; c; c = next) {
        next = c->next;
        if (!c->listener && !c->handshaken && now - c->t_open_ns > limit)
            kvl_conn_fail(c, KVL_ERR_TIMEOUT, "no HELLO within the handshake timeout");
    }
}

void kvl_conn_reap(kvl_agent *a)
{
    while (a->dead) {
        kvl_conn *c = a->dead;
        a->dead = c->next;
        kvl_conn_free(c);
    }
}

void kvl_conn_close_all(kvl_agent *a)
{
    kvl_conn_reap(a);
    while (a->conns) {
        kvl_conn *c = a->conns;
        a->conns = c->next;
        kvl_conn_free(c);
    }
}
