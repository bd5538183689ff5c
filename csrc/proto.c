/* proto.c: the kvlink protocol over a transport's endpoints.
 *
 * One kvl_conn per connection: what it is (control or data, inbound or
 * outbound, which peer and path), and the protocol state of the frame in
 * progress.  Frames arrive from the transport (kvl_proto_on_frame) and are
 * checked and routed here; every header is checked against the regions
 * this agent exposes before one payload byte is placed (kvl_proto_sink).
 * Frames go out through the transport's send(); the bytes themselves never
 * pass through this file.
 *
 * Everything here runs on the engine thread only.
 */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

struct kvl_conn {
    kvl_agent *a;
    kvl_ep *ep;            /* the transport's side */
    int kind;              /* kvl_conn_kind, once known */
    int handshaken;
    int auth_wait;         /* inbound: CHALLENGE sent, the AUTH is due */
    kvl_msg_hello hello;   /* inbound, while auth_wait: the HELLO to admit once proven */
    uint8_t nonce_s[KVL_NONCE_BYTES]; /* inbound, while auth_wait: our challenge */
    int outbound;
    int accepted;          /* counted in a->n_conns_in */
    kvl_peer *peer;        /* outbound: the peer and path this serves */
    int path;
    char peer_name[KVL_NAME_MAX]; /* inbound: from HELLO */
    kvl_inbound *ib;
    int rx_path;           /* inbound data: the sender's path index (HELLO) */
    /* inbound data: the HELLO named this mover, whose MOVER_OFFER follows */
    const kvl_mover_ops *mover_due;
    uint64_t serial;       /* unique per agent: tells a reconnected path's connection apart */
    uint64_t t_open_ns;
    int dead;
    /* the payload in progress: where it goes, and what it belongs to */
    const kvl_frame_hdr *h; /* the frame being handled (the transport's) */
    const uint8_t *body;
    struct iovec *dst;     /* iov_base NULL = drain into scratch */
    int ndst, dst_cap;
    /* a staged payload (staging.c): dst is srx, its real pieces are sdst,
     * copied there once verified and before it counts (on_payload) */
    int stage;             /* KVL_STAGE_*; NONE: dst is where the bytes go */
    kvl_stage_buf *srx;    /* the slot, from the agent's pool while stage is set */
    struct iovec *sdst;
    int nsdst, sdst_cap;
    kvl_msg_status pst;    /* DATA: the ACK we will send */
    kvl_rx_xfer *rx;       /* DATA: ownership entry while this copy places bytes */
    int drained;           /* DATA: this copy is not placed; answer pst.status as is */
    kvl_xfer *px;          /* READ_RESP: the transfer being filled (io_ref held) */
    kvl_region **prefs;
    int nprefs, prefs_cap;
    kvl_conn *next, *prev;
};

static const kvl_stream_ops *tp(const kvl_conn *c) { return c->a->stream; }

/* c's mover (NULL: payloads in-stream), as the stream has it now: a mover
 * may drop itself (a fence, keys that disagree with the region table). */
static const kvl_mover_ops *mover_of(const kvl_conn *c, kvl_mover **m)
{
    kvl_mover *dummy;
    return tp(c)->mover(c->ep, m ? m : &dummy);
}

static uint32_t mover_caps(const kvl_conn *c)
{
    const kvl_mover_ops *ops = mover_of(c, NULL);
    return ops ? ops->caps : 0;
}

kvl_conn *kvl_conn_new(kvl_agent *a, kvl_ep *ep)
{
    kvl_conn *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    c->a = a;
    c->ep = ep;
    c->path = -1;
    c->serial = ++a->next_conn_serial;
    c->t_open_ns = kvl_now_ns();
    c->next = a->conns;
    if (a->conns)
        a->conns->prev = c;
    a->conns = c;
    return c;
}

/* An accepted connection answered its HELLO (admitted or refused): it no
 * longer counts among those still in their handshake. */
static void handshake_over(kvl_conn *c)
{
    if (c->accepted && !c->handshaken)
        c->a->n_preauth--;
    c->handshaken = 1;
}

/* The connection that has been in its handshake longest, if any. */
static kvl_conn *oldest_preauth(kvl_agent *a)
{
    kvl_conn *old = NULL;
    for (kvl_conn *c = a->conns; c; c = c->next)
        if (c->accepted && !c->handshaken && !c->dead && (!old || c->t_open_ns < old->t_open_ns))
            old = c;
    return old;
}

kvl_conn *kvl_proto_accepted(kvl_agent *a, kvl_ep *ep)
{
    /* connections that never finish a handshake cost anyone nothing to open:
     * past a small share (or the total), the oldest of them makes room, so
     * they cannot keep a legitimate peer out */
    if (a->n_preauth >= KVL_MAX_PREAUTH || a->n_conns_in >= a->cfg.max_connections) {
        kvl_conn *old = oldest_preauth(a);
        if (old)
            kvl_conn_fail(old, KVL_ERR_TIMEOUT,
                          "closed before its handshake ended: too many connections in theirs");
    }
    if (a->n_conns_in >= a->cfg.max_connections) {
        uint64_t now = kvl_now_ns();
        if (now - a->t_refused_log_ns > 1000000000ull) { /* one record a second at most */
            a->t_refused_log_ns = now;
            kvl_log(a, KVL_LOG_WARNING, NULL, -1,
                    "agent '%s' holds %u accepted connections (max_connections): new ones are "
                    "closed at once",
                    a->name, a->n_conns_in);
        }
        return NULL;
    }
    kvl_conn *c = kvl_conn_new(a, ep);
    if (c) {
        c->accepted = 1;
        a->n_conns_in++;
        a->n_preauth++;
    }
    return c;
}

uint32_t kvl_proto_max_body(const kvl_conn *c)
{
    return c->handshaken ? KVL_MAX_BODY : KVL_PREAUTH_BODY_MAX;
}

kvl_conn *kvl_conn_adopt(kvl_agent *a, kvl_ep *ep)
{
    kvl_conn *c = kvl_conn_new(a, ep);
    if (c && a->stream->attach(ep, c) == KVL_OK)
        return c;
    if (c) { /* unlink the half-made connection */
        a->conns = c->next;
        if (a->conns)
            a->conns->prev = NULL;
        free(c);
    }
    a->stream->discard(ep);
    return NULL;
}

void kvl_conn_bind_outbound(kvl_conn *c, kvl_peer *p, int path)
{
    c->outbound = 1;
    c->handshaken = 1;
    c->peer = p;
    c->path = path;
    c->kind = path < 0 ? KVL_CONN_CONTROL : KVL_CONN_DATA;
    strcpy(c->peer_name, p->name);
    if (path >= 0) { /* what carries this path's payloads from now on, and why */
        kvl_path *pa = &p->paths[path];
        kvl_mover *m;
        const kvl_mover_ops *mv = mover_of(c, &m);
        if (mv && mv->check) {
            char why[sizeof pa->tnote];
            pthread_mutex_lock(&p->mu); /* what it learnt must agree with the region table */
            int bad = mv->check(m, p->regions, p->n_regions, why, sizeof why);
            pthread_mutex_unlock(&p->mu);
            if (bad) {
                tp(c)->set_mover(c->ep, mv, NULL, why);
                mv = NULL;
            }
        }
        tp(c)->note(c->ep, pa->tnote, sizeof pa->tnote);
        pa->mover_kind = mv ? mv->kind : 0;
        pa->mover_caps = mv ? mv->caps : 0;
        uint64_t off = __atomic_load_n(&pa->mover_off_until_ns, __ATOMIC_RELAXED);
        uint64_t now = kvl_now_ns();
        const kvl_mover_ops *gone = kvl_mover_by_kind(pa->mover_died_kind);
        if (!mv && gone && now < off) {
            char died[sizeof pa->mover_died];
            memcpy(died, pa->mover_died, sizeof died);
            char stream[16];
            size_t i = 0;
            for (; tp(c)->name[i] && i + 1 < sizeof stream; i++)
                stream[i] = (char)toupper((unsigned char)tp(c)->name[i]);
            stream[i] = 0;
            snprintf(pa->tnote, sizeof pa->tnote,
                     "%s path died (%.60s): %s on the same NIC; %s again in %llu s", gone->label,
                     died, stream, gone->label, (unsigned long long)((off - now) / 1000000000ull));
        }
    }
}

int kvl_conn_is_dead(const kvl_conn *c) { return c->dead; }
uint64_t kvl_conn_serial(const kvl_conn *c) { return c->serial; }
int kvl_conn_sample(const kvl_conn *c, kvl_tp_sample *out)
{
    return c->dead ? -1 : tp(c)->sample(c->ep, out);
}

static void conn_close(kvl_conn *c, int abortive, kvl_err err, const char *why);

void kvl_conn_abort(kvl_conn *c, const char *why)
{
    if (!c->dead)
        conn_close(c, 1, KVL_ERR_CONN_LOST, why);
}

uint64_t kvl_conn_bytes_sent(const kvl_conn *c) { return tp(c)->bytes_sent(c->ep); }
uint64_t kvl_conn_bytes_recv(const kvl_conn *c) { return tp(c)->bytes_recv(c->ep); }
uint64_t kvl_conn_bytes_put(const kvl_conn *c) { return tp(c)->bytes_put(c->ep); }
void kvl_conn_regions_changed(kvl_conn *c)
{
    kvl_mover *m;
    const kvl_mover_ops *mv = c->dead ? NULL : mover_of(c, &m);
    if (mv && (mv->caps & KVL_MV_MAPS_REGIONS) && mv->sync)
        mv->sync(m);
}
kvl_conn *kvl_conn_next(const kvl_conn *c) { return c->next; }
int kvl_conn_has_output(const kvl_conn *c) { return !c->dead && tp(c)->has_output(c->ep); }
void kvl_conn_drop_unstarted(kvl_conn *c)
{
    if (!c->dead)
        tp(c)->drop_unstarted(c->ep);
}
int kvl_conn_cancel_chunk(kvl_conn *c, uint64_t xid, uint32_t ci, uint32_t attempt)
{
    return !c->dead && tp(c)->cancel(c->ep, xid, ci, attempt);
}

/* ---- send ---- */

void kvl_proto_release(kvl_agent *a, kvl_tp_hold *h)
{
    if (h->xfer)
        h->xfer->io_refs--;
    for (int i = 0; i < h->nrefs; i++)
        kvl_regions_release(&a->regions, h->refs[i]);
    free(h->refs);
    memset(h, 0, sizeof *h);
}

static int send_frame(kvl_conn *c, kvl_tp_frame *f)
{
    size_t qbytes = 0;
    size_t qframes = c->dead || !c->accepted ? 0 : tp(c)->queued(c->ep, &qbytes);
    if (qframes >= KVL_MAX_ANSWERS_QUEUED || qbytes >= KVL_MAX_ANSWER_BYTES) {
        /* answers (ACK, READ_RESP, REGIONS, PONG) pile up: the peer sends
         * requests and does not read what they bring back */
        char why[192];
        snprintf(why, sizeof why,
                 "'%s' does not read its answers: %zu frames, %zu bytes queued to it "
                 "(connection closed)",
                 c->peer_name[0] ? c->peer_name : "an unnamed peer", qframes, qbytes);
        kvl_log(c->a, KVL_LOG_WARNING, c->peer_name[0] ? c->peer_name : NULL, -1, "%s", why);
        kvl_conn_fail(c, KVL_ERR_PROTOCOL, why);
    }
    if (c->dead) {
        kvl_proto_release(c->a, &f->hold);
        free(f->payload);
        free(f->dst);
        kvl_buf_free(&f->head);
        return -1;
    }
    return tp(c)->send(c->ep, f);
}

int kvl_conn_send_frame(kvl_conn *c, kvl_buf *buf)
{
    kvl_tp_frame f = {.head = *buf};
    memset(buf, 0, sizeof *buf);
    return send_frame(c, &f);
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
    kvl_tp_frame f = {.is_chunk = 1, .xid = x->id, .chunk = ci, .attempt = x->attempt[ci]};
    kvl_frame_start(&f.head);
    kvl_enc_chunk(&f.head, x->id, ci, x->attempt[ci], ch->n_pieces);
    uint32_t caps = mover_caps(c);
    if (push && (caps & KVL_MV_ONE_SIDED)) { /* the mover may put the payload */
        f.dst = malloc(ch->n_pieces * sizeof *f.dst);
        if (!f.dst)
            f.head.oom = 1;
        else
            f.n_dst = ch->n_pieces;
    }
    uint32_t n_keys = 0, mark = ++x->key_frames; /* key_used[k] == mark: this frame has key k */
    uint64_t prev_region = 0;
    for (uint32_t i = 0; i < ch->n_pieces; i++) {
        const kvl_segment *s = &x->segs[pc[i].seg];
        kvl_wire_piece wp = {
            .region = push ? s->dst_region : s->src_region,
            .offset = (push ? s->dst_offset : s->src_offset) + pc[i].seg_offset,
            .len = pc[i].len,
        };
        kvl_enc_piece(&f.head, &wp);
        if (f.dst)
            f.dst[i] = wp;
        if (i && wp.region == prev_region)
            continue; /* pieces of one region come in runs: its key is marked already */
        prev_region = wp.region;
        const kvl_rkey_entry *k = bsearch(&wp.region, x->keys, x->n_keys, sizeof *x->keys,
                                          kvl_region_key_cmp);
        if (k && x->key_used[k - x->keys] != mark) {
            x->key_used[k - x->keys] = mark;
            n_keys++;
        }
    }
    kvl_enc_keys(&f.head, n_keys); /* every region the pieces name, ascending */
    for (size_t k = 0; k < x->n_keys; k++)
        if (x->key_used[k] == mark)
            kvl_enc_key(&f.head, x->keys[k].id, x->keys[k].key);
    /* a pull over a one-sided mover: say where the bytes go here */
    int want_put = !push && (caps & KVL_MV_ONE_SIDED);
    for (uint32_t i = 0; want_put && i < ch->n_pieces; i++) {
        const kvl_segment *s = &x->segs[pc[i].seg];
        kvl_enc_dst(&f.head, s->dst_region, s->dst_offset + pc[i].seg_offset);
    }
    if (push) {
        f.payload = malloc(ch->n_pieces * sizeof *f.payload);
        if (!f.payload)
            f.head.oom = 1;
        else
            for (uint32_t i = 0; i < ch->n_pieces; i++)
                iov_add(f.payload, &f.n_payload, x->local_ptr[pc[i].seg] + pc[i].seg_offset,
                        pc[i].len);
        f.payload_len = ch->bytes;
        f.stage = x->stage; /* GPU memory: gathered into host memory before it goes */
        f.hold.xfer = x;
        x->io_refs++;
    }
    kvl_frame_finish(&f.head, push ? KVL_F_DATA : KVL_F_READ_REQ, f.payload_len);
    if (want_put && !f.head.oom)
        f.head.p[6] |= KVL_HF_DST;
    if (f.head.oom) {
        kvl_proto_release(c->a, &f.hold);
        free(f.payload);
        free(f.dst);
        kvl_buf_free(&f.head);
        return -1;
    }
    return send_frame(c, &f);
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

/* Copies that were placing chunk `chunk` of push entry rx (or pull x) stop
 * before c's copy places a byte: with I/O threads their bytes may be landing
 * right now (transport.h, revocation).  Only asked when some copy of the
 * transfer is placing, so a flood of frames costs no walk. */
static void revoke_others(kvl_conn *self, kvl_rx_xfer *rx, kvl_xfer *px, uint32_t chunk)
{
    for (kvl_conn *c = self->a->conns; c; c = c->next)
        if (c != self && !c->dead && ((rx && c->rx == rx) || (px && c->px == px)) &&
            c->pst.chunk == chunk)
            tp(c)->revoke(c->ep);
}

void kvl_proto_revoke_rx(kvl_agent *a, kvl_rx_xfer *r, int silent)
{
    int placing = a->cfg.io_threads && r->refs;
    if (!placing && !(silent && (kvl_movers_caps(&a->cfg) & KVL_MV_ONE_SIDED)))
        return;
    for (kvl_conn *c = a->conns; c; c = c->next) {
        if (c->dead)
            continue;
        /* a sender gone silent may have writes of r posted on a one-sided
         * path, whose header we may not even have read: they land without
         * us, so revoke fences every such path from that sender */
        if (silent && !c->outbound && c->kind == KVL_CONN_DATA && c->ib &&
            c->ib->sender == r->instance && (mover_caps(c) & KVL_MV_ONE_SIDED))
            tp(c)->revoke(c->ep);
        else if (placing && c->rx == r)
            tp(c)->revoke(c->ep);
    }
}

/* The staged payload's slot back to the pool (none: nothing). */
static void rx_release(kvl_conn *c)
{
    kvl_stage_give(c->a, c->srx);
    c->srx = NULL;
    c->stage = KVL_STAGE_NONE;
}

static void drain_all(kvl_conn *c)
{
    c->ndst = 0;
    rx_release(c);
    if (dst_reserve(c, 1)) {
        kvl_conn_fail(c, KVL_ERR_NOMEM, "out of memory for a drain");
        return;
    }
    c->dst[0].iov_base = NULL;
    c->dst[0].iov_len = c->h->payload_len;
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
                          kvl_msg_status *st, uint64_t *total, int *stage)
{
    kvl_region *last = NULL;
    *total = 0;
    *stage = KVL_STAGE_NONE;
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
            const uint8_t *key = e ? NULL : kvl_dec_key_for(m, p.region);
            if (!e && (!key || !kvl_ct_equal(key, r->key, KVL_KEY_BYTES))) {
                /* the message first: once released, r may be deregistered and freed */
                e = kvl_fail(KVL_ERR_ACCESS_DENIED,
                             "%s: region %llu '%s': the access key is %s (the sender's "
                             "metadata of this agent is stale, or it never had it)",
                             what, (unsigned long long)p.region, r->name,
                             key ? "wrong" : "missing");
                kvl_regions_release(&c->a->regions, r);
                kvl_log_limited(c->a, KVL_LOG_WARNING, c->peer_name, "%s", kvl_last_error());
            }
            if (e || prefs_push(c, r)) {
                if (!e)
                    kvl_regions_release(&c->a->regions, r);
                st->status = e ? e : KVL_ERR_NOMEM;
                snprintf(st->msg, sizeof st->msg, "%s", e ? kvl_last_error() : "out of memory");
                release_prefs(c);
                return -1;
            }
            last = r;
            int k = kvl_stage_kind(c->a, r->mem);
            if (k > *stage)
                *stage = k;
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

/* The largest payload this agent stages on receipt: its own chunk size or
 * staged chunk size, whichever is larger (a peer configured alike never
 * sends more). */
static uint64_t stage_cap(const kvl_agent *a)
{
    return a->cfg.stage_chunk_bytes > a->cfg.chunk_bytes ? a->cfg.stage_chunk_bytes
                                                         : a->cfg.chunk_bytes;
}

/* The payload about to arrive (total bytes) goes to memory the socket cannot
 * write (kind: KVL_STAGE_*): it is received into c's host slot, and the
 * pieces c->dst named are kept in c->sdst for on_payload.  0, or -1 with c
 * failed (out of memory). */
static int rx_stage(kvl_conn *c, int kind, uint64_t total)
{
    if (kind == KVL_STAGE_NONE ||
        ((c->h->flags & KVL_HF_OOB) && (mover_caps(c) & KVL_MV_ONE_SIDED)))
        return 0; /* an OOB payload of a one-sided mover was put into the pieces */
    if (c->ndst > c->sdst_cap) {
        struct iovec *nd = realloc(c->sdst, (size_t)c->ndst * sizeof *nd);
        if (!nd) {
            kvl_conn_fail(c, KVL_ERR_NOMEM, "out of memory for a staged payload");
            return -1;
        }
        c->sdst = nd;
        c->sdst_cap = c->ndst;
    }
    rx_release(c);
    if (kvl_stage_take(c->a, kind, (size_t)total, &c->srx)) {
        kvl_conn_fail(c, KVL_ERR_NOMEM, kvl_last_error());
        return -1;
    }
    memcpy(c->sdst, c->dst, (size_t)c->ndst * sizeof *c->sdst);
    c->nsdst = c->ndst;
    c->dst[0].iov_base = c->srx->p;
    c->dst[0].iov_len = (size_t)total;
    c->ndst = 1;
    c->stage = kind;
    return 0;
}

/* A staged payload verified and still this copy's to place: out of the slot
 * into its pieces, synchronised (staging.c).  KVL_OK, or the copy's error. */
static kvl_err rx_unstage(kvl_conn *c, int kind)
{
    return kvl_stage_scatter(c->srx, kind, c->sdst, c->nsdst);
}

/* ACK, or READ_RESP with the payload f carries (f may be NULL). */
static void send_status(kvl_conn *c, uint8_t type, const kvl_msg_status *st, kvl_tp_frame *f)
{
    kvl_tp_frame none = {0};
    if (!f)
        f = &none;
    kvl_frame_start(&f->head);
    kvl_enc_status(&f->head, st);
    kvl_frame_finish(&f->head, type, f->payload_len);
    send_frame(c, f);
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

/* Answers a HELLO with HELLO_ACK(status, why) and reads nothing more. */
static void refuse_hello(kvl_conn *c, const kvl_msg_hello *m, uint32_t status, const char *why)
{
    c->kind = m->kind;
    handshake_over(c); /* answered: the handshake timeout no longer applies */
    send_region_table(c, KVL_F_HELLO_ACK, status, why);
    tp(c)->refuse(c->ep);
}

/* The proofs of this connection cover who m says it is and who we are. */
static kvl_auth_ctx auth_ctx(const kvl_conn *c, const kvl_msg_hello *m)
{
    return (kvl_auth_ctx){.server_name = c->a->name, .server_instance = c->a->instance,
                          .client_name = m->name, .client_instance = m->instance,
                          .kind = m->kind, .path = m->path, .nonce_c = m->nonce,
                          .nonce_s = c->nonce_s};
}

static void admit(kvl_conn *c, const kvl_msg_hello *hello);

static void on_hello(kvl_conn *c)
{
    kvl_msg_hello m;
    if (kvl_dec_hello(c->body, c->h->body_len, &m)) {
        kvl_conn_fail(c, KVL_ERR_PROTOCOL, kvl_last_error());
        return;
    }
    kvl_agent *a = c->a;
    int has_auth = (m.flags & KVL_HELLO_AUTH) != 0;
    if (!a->secret_len != !has_auth) {
        char why[256];
        snprintf(why, sizeof why,
                 a->secret_len ? "agent '%s' requires authentication and '%s' has no secret: "
                                 "give every agent the same cluster secret (KVLINK_SECRET)"
                               : "agent '%s' has no secret to check the one '%s' holds: give "
                                 "every agent the same cluster secret (KVLINK_SECRET)",
                 a->name, m.name);
        kvl_log_limited(a, KVL_LOG_WARNING, NULL, "refused a connection claiming to be '%s': %s",
                m.name, why);
        refuse_hello(c, &m, KVL_ERR_AUTH, why);
        return;
    }
    if (!has_auth) {
        admit(c, &m);
        return;
    }
    /* prove we hold the secret over the initiator's nonce and ours; it
     * proves itself in AUTH before anything it sends is trusted */
    kvl_msg_challenge ch = {.instance = a->instance};
    strcpy(ch.name, a->name);
    c->hello = m;
    if (kvl_auth_nonce(c->nonce_s)) {
        kvl_conn_fail(c, KVL_ERR_SYSTEM, kvl_last_error());
        return;
    }
    kvl_auth_ctx x = auth_ctx(c, &c->hello);
    memcpy(ch.nonce, c->nonce_s, sizeof ch.nonce);
    kvl_auth_mac(a, 1, &x, ch.mac);
    kvl_buf b = {0};
    kvl_frame_start(&b);
    kvl_enc_challenge(&b, &ch);
    kvl_frame_finish(&b, KVL_F_CHALLENGE, 0);
    c->auth_wait = 1;
    kvl_conn_send_frame(c, &b);
}

static void on_auth(kvl_conn *c)
{
    c->auth_wait = 0;
    kvl_msg_auth m;
    if (kvl_dec_auth(c->body, c->h->body_len, &m)) {
        kvl_conn_fail(c, KVL_ERR_PROTOCOL, kvl_last_error());
        return;
    }
    kvl_agent *a = c->a;
    kvl_auth_ctx x = auth_ctx(c, &c->hello);
    uint8_t want[KVL_MAC_BYTES];
    kvl_auth_mac(a, 0, &x, want);
    char why[256] = "";
    if (m.status != KVL_OK)
        snprintf(why, sizeof why,
                 "'%s' could not verify agent '%s': the two hold different cluster secrets",
                 c->hello.name, a->name);
    else if (!kvl_ct_equal(m.mac, want, sizeof want))
        snprintf(why, sizeof why,
                 "agent '%s' could not verify '%s': the two hold different cluster secrets",
                 a->name, c->hello.name);
    explicit_bzero(want, sizeof want);
    if (why[0]) {
        kvl_log_limited(a, KVL_LOG_WARNING, NULL, "refused a connection claiming to be '%s': %s",
                c->hello.name, why);
        refuse_hello(c, &c->hello, KVL_ERR_AUTH, why);
        return;
    }
    admit(c, &c->hello);
}

/* The key of one sender session in the inbound tables (pushes, chunk
 * ownership, END, notification de-duplication): a client that claims a
 * sender's public name and instance without its session token, or its
 * instance under another name, gets another key and touches nothing of it. */
static uint64_t sender_key(const char *name, uint64_t instance, const uint8_t *token)
{
    kvl_sha256 h;
    uint8_t d[KVL_SHA256_BYTES];
    kvl_sha256_init(&h);
    kvl_sha256_update(&h, name, strlen(name) + 1);
    kvl_sha256_update(&h, &instance, sizeof instance);
    kvl_sha256_update(&h, token, KVL_TOKEN_BYTES);
    kvl_sha256_final(&h, d);
    uint64_t k;
    memcpy(&k, d, sizeof k);
    return k ? k : 1; /* 0: no session */
}

/* A record for inbound peer `name`; at KVL_MAX_PEER_NAMES one whose
 * connections are all gone makes room.  NULL when none can. */
static kvl_inbound *inbound_new(kvl_agent *a, const char *name)
{
    if (a->n_inbound >= KVL_MAX_PEER_NAMES) {
        kvl_inbound **pp = &a->inbound;
        while (*pp && (*pp)->conns > 0)
            pp = &(*pp)->next;
        if (!*pp)
            return NULL;
        kvl_inbound *old = *pp;
        *pp = old->next;
        free(old);
        a->n_inbound--;
    }
    kvl_inbound *ib = calloc(1, sizeof *ib);
    if (!ib)
        return NULL;
    strcpy(ib->name, name);
    ib->next = a->inbound;
    a->inbound = ib;
    a->n_inbound++;
    return ib;
}

/* Who the HELLO says it is is settled (proven, with a secret): take it in
 * or refuse it, and answer with HELLO_ACK. */
static void admit(kvl_conn *c, const kvl_msg_hello *hello)
{
    kvl_msg_hello m = *hello;
    c->kind = m.kind;
    c->rx_path = m.path;
    handshake_over(c);
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
    } else if (ib && ib->conns > 0 && !kvl_ct_equal(ib->token, m.token, KVL_TOKEN_BYTES)) {
        /* the instance id is public (metadata); the session token is not: a
         * connection may join the live ones only from the same session */
        status = KVL_ERR_DUPLICATE_NAME;
        snprintf(msg, sizeof msg,
                 "agent '%s' has live connections from '%s' in another session: a second "
                 "process is using that agent's name and instance",
                 a->name, m.name);
        kvl_log_limited(a, KVL_LOG_WARNING, NULL, "refused a connection claiming to be '%s': %s",
                m.name, msg);
    } else if (ib && ib->conns >= KVL_MAX_CONNS_PER_PEER) {
        status = KVL_ERR_BUSY;
        snprintf(msg, sizeof msg, "agent '%s' holds %d connections from '%s' already", a->name,
                 ib->conns, m.name);
    } else if (!ib && !(ib = inbound_new(a, m.name))) {
        status = KVL_ERR_BUSY;
        snprintf(msg, sizeof msg,
                 "agent '%s' has live connections from %d peer names: no room for '%s'",
                 a->name, KVL_MAX_PEER_NAMES, m.name);
    } else {
        if (ib->conns == 0 && (!ib->sender || ib->instance != m.instance ||
                               !kvl_ct_equal(ib->token, m.token, KVL_TOKEN_BYTES))) {
            /* a new session of this name: its own earlier one is over */
            if (ib->sender)
                kvl_rx_forget_sender(a, ib->sender);
            memcpy(ib->token, m.token, KVL_TOKEN_BYTES);
            ib->sender = sender_key(m.name, m.instance, m.token);
        }
        ib->instance = m.instance;
        ib->conns++;
        c->ib = ib;
    }
    const kvl_mover_ops *mv = m.movers ? kvl_mover_by_kind(m.movers) : NULL;
    if (status == KVL_OK && m.movers && !mv) {
        status = KVL_ERR_PROTOCOL;
        snprintf(msg, sizeof msg, "agent '%s' has no mover of kind %#x ('%s' asked for it)",
                 a->name, m.movers, m.name);
    }
    if (status == KVL_OK && mv && kvl_mover_allowed(&a->cfg, mv, a->name, m.name)) {
        status = KVL_ERR_INVALID_ARG;
        snprintf(msg, sizeof msg, "%s", kvl_last_error());
    }
    if (status == KVL_OK && mv && !(mv->caps & KVL_MV_OFFER)) {
        kvl_mover *mover = NULL;
        if (mv->agree(a, c->ep, &mover)) {
            /* e.g. a peer elsewhere asking for descriptors of our memory: no */
            status = KVL_ERR_PROTOCOL;
            snprintf(msg, sizeof msg, "agent '%s' refused %s to '%s': %s", a->name, mv->what,
                     m.name, kvl_last_error());
        } else {
            tp(c)->set_mover(c->ep, mv, mover, NULL);
        }
    }
    c->mover_due = status == KVL_OK && mv && (mv->caps & KVL_MV_OFFER) ? mv : NULL;
    send_region_table(c, KVL_F_HELLO_ACK, status, msg);
    if (status != KVL_OK)
        tp(c)->refuse(c->ep); /* nothing behind a refused HELLO is read */
}

/* MOVER_OFFER: once per data connection whose HELLO named a mover set up by
 * an offer.  The mover answers (MOVER_ACCEPT or MOVER_REFUSE); only a peer
 * that proved the cluster secret gets an answer other than a refusal
 * (docs/ucx.md: libucp parses worker addresses unchecked). */
static void on_mover_offer(kvl_conn *c)
{
    const kvl_mover_ops *mv = c->mover_due;
    if (!mv || c->h->body_len < 1 || c->body[0] != mv->kind) {
        kvl_conn_fail(c, KVL_ERR_PROTOCOL,
                      "MOVER_OFFER for a mover the HELLO did not name, or a second one");
        return;
    }
    c->mover_due = NULL;
    mv->answer(c->a, c->ep, c->body + 1, c->h->body_len - 1, c->a->secret_len != 0);
}

/* MOVER_KEYS: the peer's mover mapped regions registered after its set-up
 * (docs/ucx.md step 3).  For a mover it has gone since (fenced, dropped) the
 * keys have nothing to go with. */
static void on_mover_keys(kvl_conn *c)
{
    kvl_mover *m;
    const kvl_mover_ops *mv = mover_of(c, &m);
    if (c->h->body_len < 1 || (mv && c->body[0] != mv->kind) ||
        !kvl_mover_by_kind(c->body[0])) {
        kvl_conn_fail(c, KVL_ERR_PROTOCOL, "MOVER_KEYS for a mover this path does not run");
        return;
    }
    if (!mv || !mv->keys)
        return;
    if (mv->keys(m, c->body + 1, c->h->body_len - 1) != 0)
        kvl_conn_fail(c, KVL_ERR_PROTOCOL, kvl_last_error());
    else if (c->outbound && c->path >= 0) { /* paths() shows the keys it holds now */
        kvl_path *pa = &c->peer->paths[c->path];
        tp(c)->note(c->ep, pa->tnote, sizeof pa->tnote);
    }
}

static void on_data(kvl_conn *c)
{
    kvl_msg_chunk m;
    if (kvl_dec_chunk(c->body, c->h->body_len, &m)) {
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
    if (declared != c->h->payload_len) {
        kvl_conn_fail(c, KVL_ERR_PROTOCOL, "DATA frame: pieces and payload length disagree");
        return;
    }
    int stage = KVL_STAGE_NONE;
    c->stage = KVL_STAGE_NONE;
    if (resolve_pieces(c, &m, KVL_REMOTE_WRITE, &c->pst, &total, &stage) == 0 && stage &&
        total > stage_cap(c->a)) {
        /* a slot is as large as the payload: a peer may not make us pin more
         * than a chunk of our own configuration (refused before any claim) */
        release_prefs(c);
        c->pst.status = KVL_ERR_INVALID_ARG;
        snprintf(c->pst.msg, sizeof c->pst.msg,
                 "agent '%s' stages payloads of GPU memory up to %llu bytes, this chunk has "
                 "%llu: give both agents the same gpu_chunk_bytes and chunk_bytes",
                 c->a->name, (unsigned long long)stage_cap(c->a), (unsigned long long)total);
    } else if (c->pst.status == KVL_OK) {
        uint32_t drain_status = KVL_OK;
        uint64_t instance = c->ib ? c->ib->sender : 0;
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
        } else {
            if (c->a->cfg.io_threads && c->rx->refs > 1)
                revoke_others(c, c->rx, NULL, m.chunk);
            if (rx_stage(c, stage, total))
                return;
        }
    }
    if (c->pst.status != KVL_OK)
        drain_all(c);
}

static void on_read_req(kvl_conn *c)
{
    kvl_msg_chunk m;
    if (kvl_dec_chunk_flags(c->body, c->h->body_len, c->h->flags, &m)) {
        kvl_conn_fail(c, KVL_ERR_PROTOCOL, kvl_last_error());
        return;
    }
    kvl_msg_status st = {.xfer = m.xfer, .chunk = m.chunk, .attempt = m.attempt};
    uint64_t total = 0;
    kvl_tp_frame f = {0}, *fp = NULL;
    int stage = KVL_STAGE_NONE;
    if (resolve_pieces(c, &m, KVL_REMOTE_READ, &st, &total, &stage) == 0) {
        struct iovec *iov = malloc((size_t)c->ndst * sizeof *iov);
        if (!iov) {
            release_prefs(c);
            kvl_conn_fail(c, KVL_ERR_NOMEM, "out of memory for a READ_RESP");
            return;
        }
        memcpy(iov, c->dst, (size_t)c->ndst * sizeof *iov);
        if (m.dst) { /* a pull over a one-sided mover: it may put into the initiator's pieces */
            f.dst = malloc(m.n_pieces * sizeof *f.dst);
            if (!f.dst) {
                free(iov);
                release_prefs(c);
                kvl_conn_fail(c, KVL_ERR_NOMEM, "out of memory for a READ_RESP");
                return;
            }
            f.n_dst = m.n_pieces;
            for (uint32_t i = 0; i < m.n_pieces; i++)
                kvl_dec_dst_piece(&m, i, &f.dst[i]);
        }
        f.payload = iov;
        f.n_payload = c->ndst;
        f.payload_len = total;
        f.stage = stage; /* GPU memory: gathered into host memory before it goes */
        /* the frame now owns the region references */
        f.hold.refs = c->prefs;
        f.hold.nrefs = c->nprefs;
        c->prefs = NULL;
        c->nprefs = c->prefs_cap = 0;
        fp = &f;
    }
    send_status(c, KVL_F_READ_RESP, &st, fp);
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
    if (st->status == KVL_RX_SUPERSEDED) { /* a newer copy of this chunk is the one that counts */
        kvl_sched_superseded(c->peer, x, st->chunk, (uint32_t)c->path, st->attempt);
        return;
    }
    if (st->status == KVL_ERR_CHECKSUM) {
        kvl_sched_requeue(c->peer, x, st->chunk, KVL_ERR_CHECKSUM, st->msg);
        return;
    }
    kvl_err e = st->status > 0 && st->status <= KVL_ERR_MAX ? st->status : KVL_ERR_PROTOCOL;
    kvl_sched_fail(x, e, "peer '%s' refused chunk %u: %s", c->peer->name, st->chunk, st->msg);
}

static void on_ack(kvl_conn *c)
{
    kvl_msg_status st;
    if (kvl_dec_status(c->body, c->h->body_len, &st)) {
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
    if (kvl_dec_status(c->body, c->h->body_len, &st)) {
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
    if (c->h->payload_len != ch->bytes) {
        kvl_conn_fail(c, KVL_ERR_PROTOCOL, "READ_RESP payload length differs from the request");
        return;
    }
    c->ndst = 0;
    c->stage = KVL_STAGE_NONE;
    if (dst_reserve(c, (int)ch->n_pieces)) {
        kvl_conn_fail(c, KVL_ERR_NOMEM, "out of memory");
        return;
    }
    const kvl_piece *pc = &x->plan.pieces[ch->first_piece];
    for (uint32_t i = 0; i < ch->n_pieces; i++)
        iov_add(c->dst, &c->ndst, x->local_ptr[pc[i].seg] + pc[i].seg_offset, pc[i].len);
    if (st.attempt < x->powner[st.chunk]) {
        drain_all(c); /* a newer copy of this chunk is already being placed */
        kvl_sched_superseded(c->peer, x, st.chunk, (uint32_t)c->path, st.attempt);
        return;
    }
    x->powner[st.chunk] = st.attempt;
    if (c->a->cfg.io_threads && x->io_refs)
        revoke_others(c, NULL, x, st.chunk);
    if (rx_stage(c, x->stage, ch->bytes))
        return;
    c->px = x;
    x->io_refs++;
}

static void on_notify(kvl_conn *c)
{
    kvl_msg_notify m;
    if (kvl_dec_notify(c->body, c->h->body_len, &m)) {
        kvl_conn_fail(c, KVL_ERR_PROTOCOL, kvl_last_error());
        return;
    }
    if (kvl_notify_inbound(c->a, c->peer_name, c->ib ? c->ib->sender : 0, &m) && m.xfer) {
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
    if (kvl_dec_token(c->body, c->h->body_len, &xfer)) {
        kvl_conn_fail(c, KVL_ERR_PROTOCOL, kvl_last_error());
        return;
    }
    kvl_notify_acked(c->peer, xfer);
}

static void on_regions(kvl_conn *c)
{
    kvl_msg_hello_ack m;
    if (kvl_dec_hello_ack(c->body, c->h->body_len, &m)) {
        kvl_conn_fail(c, KVL_ERR_PROTOCOL, kvl_last_error());
        return;
    }
    kvl_peer *p = c->peer;
    kvl_region_info *tab;
    if (kvl_dec_region_table(&m, &tab)) {
        kvl_conn_fail(c, KVL_ERR_NOMEM, kvl_last_error());
        return;
    }
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
    if (kvl_dec_token(c->body, c->h->body_len, &token)) {
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
    if (kvl_dec_status(c->body, c->h->body_len, &m)) {
        kvl_conn_fail(c, KVL_ERR_PROTOCOL, kvl_last_error());
        return;
    }
    kvl_rx_end(c->a, c->ib ? c->ib->sender : 0, &m);
}

static void on_announce(kvl_conn *c)
{
    kvl_msg_announce m;
    if (kvl_dec_announce(c->body, c->h->body_len, &m)) {
        kvl_conn_fail(c, KVL_ERR_PROTOCOL, kvl_last_error());
        return;
    }
    /* out of room: its DATA frames are then refused, which fails the push
     * on the sender with that reason */
    kvl_rx_announce(c->a, c->ib ? c->ib->sender : 0, c->peer_name, &m);
}

static void on_pong(kvl_conn *c)
{
    uint64_t token;
    if (kvl_dec_token(c->body, c->h->body_len, &token)) {
        kvl_conn_fail(c, KVL_ERR_PROTOCOL, kvl_last_error());
        return;
    }
    kvl_monitor_on_pong(c->peer, c->path, token, kvl_now_ns());
}

/* A whole frame (header and body) has arrived: route it by type and by what
 * this connection is. */
void kvl_proto_on_frame(kvl_conn *c, const kvl_frame_hdr *h, const uint8_t *body)
{
    c->h = h;
    c->body = body;
    uint8_t t = h->type;
    if (kvl_crc32c(0, c->body, c->h->body_len) != c->h->body_crc) {
        kvl_conn_fail(c, KVL_ERR_PROTOCOL, "frame body failed its crc32c check");
        return;
    }
    int in_data = !c->outbound && c->kind == KVL_CONN_DATA;
    int in_ctrl = !c->outbound && c->kind == KVL_CONN_CONTROL;
    int out_data = c->outbound && c->kind == KVL_CONN_DATA;
    int out_ctrl = c->outbound && c->kind == KVL_CONN_CONTROL;
    if (h->flags & (KVL_HF_OOB | KVL_HF_DST)) {
        uint32_t caps = c->kind == KVL_CONN_DATA ? mover_caps(c) : 0;
        if (!caps || ((h->flags & KVL_HF_DST) && !(caps & KVL_MV_ONE_SIDED))) {
            kvl_conn_fail(c, KVL_ERR_PROTOCOL,
                          (h->flags & KVL_HF_OOB)
                              ? "a frame with header flag OOB on a path without a mover set up"
                              : "a frame with header flag DST on a path without a one-sided "
                                "mover set up");
            return;
        }
    }
    if (!c->handshaken && c->auth_wait) {
        if (t != KVL_F_AUTH)
            kvl_conn_fail(c, KVL_ERR_PROTOCOL, "the frame after CHALLENGE is not an AUTH");
        else
            on_auth(c);
    } else if (!c->handshaken) {
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
    else if (t == KVL_F_MOVER_OFFER && in_data)
        on_mover_offer(c);
    else if (t == KVL_F_MOVER_KEYS && (in_data || out_data))
        on_mover_keys(c);
    else {
        char why[96];
        snprintf(why, sizeof why, "unexpected frame type %u on this connection", t);
        kvl_conn_fail(c, KVL_ERR_PROTOCOL, why);
        return;
    }
}

const struct iovec *kvl_proto_sink(kvl_conn *c, int *n)
{
    *n = c->ndst;
    return c->dst;
}

int kvl_proto_payload_live(kvl_conn *c)
{
    /* the transfer failed, or another copy of this chunk owns it or was
     * verified: the destination must not change through this copy */
    if (c->px && (!kvl_xfer_running(c->px) || c->px->cstate[c->pst.chunk] == KVL_CHUNK_DONE ||
                  c->px->powner[c->pst.chunk] != c->pst.attempt))
        return 0;
    return !c->rx || kvl_rx_owns(c->rx, c->pst.chunk, c->pst.attempt);
}

static void on_payload(kvl_conn *c, uint32_t crc, uint32_t want, int staged);

void kvl_proto_on_payload(kvl_conn *c, uint32_t crc, uint32_t want)
{
    on_payload(c, crc, want, c->stage);
    rx_release(c); /* placed, or never to be */
}

static void on_payload(kvl_conn *c, uint32_t crc, uint32_t want, int staged)
{
    int crc_ok = want == crc;
    if (c->h->type == KVL_F_DATA) {
        if (c->rx) {
            kvl_rx_xfer *r = c->rx;
            c->rx = NULL;
            int owner = kvl_rx_owns(r, c->pst.chunk, c->pst.attempt);
            if (staged && owner && crc_ok) {
                /* verified over the slot: into its pieces and synchronised
                 * before the chunk counts (never ACK bytes not yet there) */
                kvl_err se = rx_unstage(c, staged);
                if (se) {
                    crc_ok = 0;
                    c->pst.status = se;
                    snprintf(c->pst.msg, sizeof c->pst.msg,
                             "agent '%s' could not place a staged payload: %s", c->a->name,
                             kvl_last_error());
                }
            }
            /* the regions stay referenced until their bytes are placed */
            release_prefs(c);
            int settled_elsewhere = !owner && !r->ended && c->pst.chunk < r->n &&
                                    r->chunks[c->pst.chunk].settled;
            kvl_rx_done(r, c->pst.chunk, c->pst.attempt, owner && crc_ok, (uint32_t)c->rx_path,
                        c->h->payload_len);
            if (!owner) { /* lost the chunk to another copy mid-way */
                c->pst.status = settled_elsewhere ? KVL_OK : KVL_RX_SUPERSEDED;
                c->drained = 1;
            }
        }
        release_prefs(c);
        if (c->pst.status == KVL_OK && !crc_ok && !c->drained) {
            c->pst.status = KVL_ERR_CHECKSUM;
            snprintf(c->pst.msg, sizeof c->pst.msg,
                     "payload crc32c mismatch on '%s' (computed %08x, sender %08x)", c->a->name,
                     crc, want);
        }
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
        if (crc_ok && staged) { /* into the transfer's memory before the chunk counts */
            if (rx_unstage(c, staged)) {
                kvl_sched_fail(x, KVL_ERR_SYSTEM, "chunk %u: placing a staged payload: %s",
                               c->pst.chunk, kvl_last_error());
                return;
            }
        }
        if (crc_ok) {
            kvl_sched_on_chunk_done(c->peer, x, c->pst.chunk, (uint32_t)c->path, kvl_now_ns());
        } else {
            char why[128];
            snprintf(why, sizeof why, "payload crc32c mismatch (computed %08x, sender %08x)",
                     crc, want);
            kvl_sched_requeue(c->peer, x, c->pst.chunk, KVL_ERR_CHECKSUM, why);
        }
    }
}

void kvl_proto_on_version(kvl_conn *c, const char *why)
{
    if (c->handshaken) { /* a version change mid-connection is garbage */
        kvl_conn_fail(c, KVL_ERR_PROTOCOL, why);
        return;
    }
    /* tell the initiator why before hanging up: HandshakeError there, not a
     * bare connection reset */
    handshake_over(c);
    c->kind = KVL_CONN_DATA;
    send_region_table(c, KVL_F_HELLO_ACK, KVL_ERR_HANDSHAKE, why);
    tp(c)->refuse(c->ep);
}

void kvl_proto_on_error(kvl_conn *c, kvl_err err, const char *why) { kvl_conn_fail(c, err, why); }

static void conn_close(kvl_conn *c, int abortive, kvl_err err, const char *why)
{
    (void)err;
    if (c->dead)
        return;
    c->dead = 1;
    kvl_agent *a = c->a;
    /* what the payload in progress held; then the transport drops its queue
     * (releasing what queued frames held) and closes */
    release_prefs(c);
    if (c->rx) {
        kvl_rx_done(c->rx, c->pst.chunk, c->pst.attempt, 0, 0, 0);
        c->rx = NULL;
    }
    if (c->px) {
        c->px->io_refs--;
        c->px = NULL;
    }
    uint64_t sent = tp(c)->bytes_sent(c->ep), recv = tp(c)->bytes_recv(c->ep);
    uint64_t put = tp(c)->bytes_put(c->ep);
    /* a path whose connection still ran a mover that falls back (not fenced:
     * that is no failure) */
    int mover_died = c->outbound && c->path >= 0 && !atomic_load(&a->closing) &&
                     (mover_caps(c) & KVL_MV_FALLS_BACK);
    tp(c)->close(c->ep, abortive);
    rx_release(c); /* after close: no I/O thread writes into the slot any more */
    if (c->ib)
        c->ib->conns--;
    if (c->accepted)
        a->n_conns_in--;
    if (c->accepted && !c->handshaken)
        a->n_preauth--;
    if (c->outbound) {
        kvl_notify_conn_lost(c->peer, c);
        if (c->path >= 0) {
            kvl_path *pa = &c->peer->paths[c->path];
            pa->bytes_sent_prev += sent;
            pa->bytes_recv_prev += recv;
            pa->bytes_put_prev += put;
            if (mover_died) { /* "a UCX path that dies falls back to TCP" */
                snprintf(pa->mover_died, sizeof pa->mover_died, "%s", why);
                pa->mover_died_kind = pa->mover_kind;
                __atomic_store_n(&pa->mover_off_until_ns,
                                 kvl_now_ns() + KVL_MOVER_FALLBACK_MS * 1000000ull,
                                 __ATOMIC_RELAXED);
            }
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

void kvl_conn_fail(kvl_conn *c, kvl_err err, const char *why) { conn_close(c, 0, err, why); }

static void conn_free(kvl_conn *c)
{
    c->a->stream->free(c->ep); /* teardown: queued frames' holds are the agent's to free */
    free(c->prefs);
    free(c->dst);
    free(c->sdst);
    kvl_stage_give(c->a, c->srx);
    free(c);
}

void kvl_conn_expire(kvl_agent *a, uint64_t now)
{
    uint64_t limit = (uint64_t)a->cfg.connect_timeout_ms * 1000000ull;
    for (kvl_conn *c = a->conns, *next; c; c = next) {
        next = c->next;
        uint64_t since = c->dead || !c->accepted ? 0 : tp(c)->rx_partial_since(c->ep, now);
        if (!c->handshaken && now - c->t_open_ns > limit)
            kvl_conn_fail(c, KVL_ERR_TIMEOUT, "no HELLO within the handshake timeout");
        else if (since && now > since && now - since > KVL_PARTIAL_FRAME_TIMEOUTS * limit)
            kvl_conn_fail(c, KVL_ERR_TIMEOUT,
                          "a frame started arriving and no more of it came for 6 x "
                          "connect_timeout");
    }
}

void kvl_conn_reap(kvl_agent *a)
{
    while (a->dead) {
        kvl_conn *c = a->dead;
        a->dead = c->next;
        conn_free(c);
    }
}

void kvl_conn_close_all(kvl_agent *a)
{
    kvl_conn_reap(a);
    while (a->conns) {
        kvl_conn *c = a->conns;
        a->conns = c->next;
        conn_free(c);
    }
}
