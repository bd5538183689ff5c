/* proto.c: frames after the handshake.  Every frame from the stream is
 * checked (its body's crc, that its type and flags are legal on this
 * connection) and routed to its handler; DATA and READ_RESP payloads go
 * where place.c says, and their completion (kvl_proto_on_payload) is
 * verified, acknowledged and reported here.  Frames go out through conn.c;
 * the bytes themselves never pass through this file.
 */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "conn_impl.h"

/* ACK, or READ_RESP with the payload f carries (f may be NULL). */
static void send_status(kvl_conn *c, uint8_t type, const kvl_msg_status *st, kvl_tp_frame *f)
{
    kvl_tp_frame none = {0};
    if (!f)
        f = &none;
    kvl_frame_start(&f->head);
    kvl_enc_status(&f->head, st);
    kvl_frame_finish(&f->head, type, f->payload_len);
    kvl_conn_send_tp(c, f);
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
        char note[sizeof pa->tnote];
        tp(c)->note(c->ep, note, sizeof note);
        kvl_path_noted(pa, note);
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
    if (kvl_place_resolve(c, &m, KVL_REMOTE_WRITE, &c->pst, &total, &stage) == 0 && stage &&
        total > kvl_place_stage_cap(c->a)) {
        /* a slot is as large as the payload: a peer may not make us pin more
         * than a chunk of our own configuration (refused before any claim) */
        kvl_place_release_prefs(c);
        c->pst.status = KVL_ERR_INVALID_ARG;
        snprintf(c->pst.msg, sizeof c->pst.msg,
                 "agent '%s' stages payloads of GPU memory up to %llu bytes, this chunk has "
                 "%llu: give both agents the same gpu_chunk_bytes and chunk_bytes",
                 c->a->name, (unsigned long long)kvl_place_stage_cap(c->a), (unsigned long long)total);
    } else if (c->pst.status == KVL_OK) {
        uint32_t drain_status = KVL_OK;
        uint64_t instance = c->ib ? c->ib->sender : 0;
        if (!kvl_rx_claim(c->a, instance, m.xfer, m.chunk, m.attempt, &c->rx, &drain_status)) {
            /* another copy owns or already verified this chunk: drain ours */
            kvl_place_release_prefs(c);
            c->pst.status = drain_status;
            if (drain_status == KVL_ERR_BUSY) /* refused at its ANNOUNCE: say why */
                kvl_rx_refusal(c->a, instance, c->pst.msg, sizeof c->pst.msg);
            else if (drain_status == KVL_ERR_PROTOCOL)
                snprintf(c->pst.msg, sizeof c->pst.msg,
                         "agent '%s': push %llu was not announced, or has no chunk %u",
                         c->a->name, (unsigned long long)m.xfer, m.chunk);
            c->rx = NULL;
            kvl_place_drain_all(c);
            c->drained = 1;
        } else {
            if (c->a->cfg.io_threads && c->rx->refs > 1)
                kvl_place_revoke_others(c, c->rx, NULL, m.chunk);
            if (kvl_place_stage(c, stage, total))
                return;
        }
    }
    if (c->pst.status != KVL_OK)
        kvl_place_drain_all(c);
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
    if (kvl_place_resolve(c, &m, KVL_REMOTE_READ, &st, &total, &stage) == 0) {
        struct iovec *iov = malloc((size_t)c->ndst * sizeof *iov);
        if (!iov) {
            kvl_place_release_prefs(c);
            kvl_conn_fail(c, KVL_ERR_NOMEM, "out of memory for a READ_RESP");
            return;
        }
        memcpy(iov, c->dst, (size_t)c->ndst * sizeof *iov);
        if (m.dst) { /* a pull over a one-sided mover: it may put into the initiator's pieces */
            f.dst = malloc(m.n_pieces * sizeof *f.dst);
            if (!f.dst) {
                free(iov);
                kvl_place_release_prefs(c);
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
        kvl_place_drain_all(c);
        return;
    }
    const kvl_chunk *ch = &x->plan.chunks[st.chunk];
    if (c->h->payload_len != ch->bytes) {
        kvl_conn_fail(c, KVL_ERR_PROTOCOL, "READ_RESP payload length differs from the request");
        return;
    }
    c->ndst = 0;
    c->stage = KVL_STAGE_NONE;
    if (kvl_place_dst_reserve(c, (int)ch->n_pieces)) {
        kvl_conn_fail(c, KVL_ERR_NOMEM, "out of memory");
        return;
    }
    const kvl_piece *pc = &x->plan.pieces[ch->first_piece];
    for (uint32_t i = 0; i < ch->n_pieces; i++)
        kvl_iov_add(c->dst, &c->ndst, x->local_ptr[pc[i].seg] + pc[i].seg_offset, pc[i].len);
    if (st.attempt < x->powner[st.chunk]) {
        kvl_place_drain_all(c); /* a newer copy of this chunk is already being placed */
        kvl_sched_superseded(c->peer, x, st.chunk, (uint32_t)c->path, st.attempt);
        return;
    }
    x->powner[st.chunk] = st.attempt;
    if (c->a->cfg.io_threads && x->io_refs)
        kvl_place_revoke_others(c, NULL, x, st.chunk);
    if (kvl_place_stage(c, x->stage, ch->bytes))
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

/* REGIONS_REQ has an empty body (docs/wire-protocol.md): anything else is
 * not an agent of ours, and gets no table. */
static void on_regions_req(kvl_conn *c)
{
    if (c->h->body_len || c->h->payload_len) {
        kvl_conn_fail(c, KVL_ERR_PROTOCOL, "REGIONS_REQ with a body (it has none)");
        return;
    }
    kvl_conn_send_region_table(c, KVL_F_REGIONS, KVL_OK, "");
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
    /* refused (over its sender's share, out of room): its DATA frames are
     * then answered with the reason, which fails the push on the sender */
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
    c->t_frame_ns = kvl_now_ns(); /* the idle rule (conn.c) */
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
            kvl_handshake_on_auth(c);
    } else if (!c->handshaken) {
        if (t != KVL_F_HELLO)
            kvl_conn_fail(c, KVL_ERR_PROTOCOL, "first frame is not a HELLO");
        else
            kvl_handshake_on_hello(c);
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
        on_regions_req(c);
    else if (t == KVL_F_REGIONS && out_ctrl)
        on_regions(c);
    else if (t == KVL_F_PING && !c->outbound)
        on_ping(c);
    else if (t == KVL_F_END && !c->outbound)
        on_end(c);
    else if (t == KVL_F_PONG && c->outbound) /* the control connection's: keep-alive only */
        on_pong(c);
    else if (t == KVL_F_NOTIFY_ACK && c->outbound)
        on_notify_ack(c);
    else if (t == KVL_F_ANNOUNCE && in_data)
        on_announce(c);
    else if (t == KVL_F_MOVER_OFFER && in_data)
        kvl_handshake_on_mover_offer(c);
    else if (t == KVL_F_MOVER_KEYS && (in_data || out_data))
        on_mover_keys(c);
    else {
        char why[96];
        snprintf(why, sizeof why, "unexpected frame type %u on this connection", t);
        kvl_conn_fail(c, KVL_ERR_PROTOCOL, why);
        return;
    }
}

static void on_payload(kvl_conn *c, uint32_t crc, uint32_t want, int staged);

void kvl_proto_on_payload(kvl_conn *c, uint32_t crc, uint32_t want)
{
    on_payload(c, crc, want, c->stage);
    kvl_place_rx_release(c); /* placed, or never to be */
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
                kvl_err se = kvl_place_unstage(c, staged);
                if (se) {
                    crc_ok = 0;
                    c->pst.status = se;
                    snprintf(c->pst.msg, sizeof c->pst.msg,
                             "agent '%s' could not place a staged payload: %s", c->a->name,
                             kvl_last_error());
                }
            }
            /* the regions stay referenced until their bytes are placed */
            kvl_place_release_prefs(c);
            int settled_elsewhere = !owner && !r->ended && c->pst.chunk < r->n &&
                                    r->chunks[c->pst.chunk].settled;
            kvl_rx_done(r, c->pst.chunk, c->pst.attempt, owner && crc_ok, (uint32_t)c->rx_path,
                        c->h->payload_len);
            if (!owner) { /* lost the chunk to another copy mid-way */
                c->pst.status = settled_elsewhere ? KVL_OK : KVL_RX_SUPERSEDED;
                c->drained = 1;
            }
        }
        kvl_place_release_prefs(c);
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
            if (kvl_place_unstage(c, staged)) {
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
