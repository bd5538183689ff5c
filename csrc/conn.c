/* conn.c: a connection's life (conn.h): accepted from a listener or adopted
 * from add_peer and the prober, bound to its peer's path (and what carries
 * its payloads), frames queued to the stream, closed (its path and the
 * transfers it carried told), freed at the end of the engine's iteration.
 */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "conn_impl.h"

kvl_conn *kvl_conn_new(kvl_agent *a, kvl_ep *ep)
{
    kvl_conn *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    c->a = a;
    c->ep = ep;
    c->path = -1;
    c->serial = ++a->next_conn_serial;
    c->t_open_ns = c->t_frame_ns = kvl_now_ns();
    c->next = a->conns;
    if (a->conns)
        a->conns->prev = c;
    a->conns = c;
    return c;
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
        char note[sizeof pa->tnote];
        tp(c)->note(c->ep, note, sizeof note);
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
            snprintf(note, sizeof note,
                     "%s path died (%.60s): %s on the same NIC; %s again in %llu s", gone->label,
                     died, stream, gone->label, (unsigned long long)((off - now) / 1000000000ull));
        }
        kvl_path_carried_by(pa, mv ? mv->kind : 0, mv ? mv->caps : 0, note);
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

int kvl_conn_send_tp(kvl_conn *c, kvl_tp_frame *f)
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
    return kvl_conn_send_tp(c, &f);
}

/* Adds [p, p+len) to an iovec array, merging with the previous entry when
 * contiguous (paged KV blocks often are). */
void kvl_iov_add(struct iovec *v, int *n, void *p, size_t len)
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
                kvl_iov_add(f.payload, &f.n_payload, x->local_ptr[pc[i].seg] + pc[i].seg_offset,
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
    return kvl_conn_send_tp(c, &f);
}

void kvl_conn_send_region_table(kvl_conn *c, uint8_t type, uint32_t status, const char *msg)
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

void kvl_proto_on_error(kvl_conn *c, kvl_err err, const char *why) { kvl_conn_fail(c, err, why); }

static void conn_close(kvl_conn *c, int abortive, kvl_err err, const char *why)
{
    (void)err;
    if (c->dead)
        return;
    c->dead = 1;
    kvl_agent *a = c->a;
    /* what the payload in progress held (place.c); then the transport drops
     * its queue (releasing what queued frames held) and closes */
    a->conn_hooks->payload_dropped(c);
    uint64_t sent = tp(c)->bytes_sent(c->ep), recv = tp(c)->bytes_recv(c->ep);
    uint64_t put = tp(c)->bytes_put(c->ep);
    /* the mover a path's connection still ran (not fenced: that is no
     * failure): one that falls back keeps the path off it a while */
    uint32_t died_caps =
        c->outbound && c->path >= 0 && !atomic_load(&a->closing) ? mover_caps(c) : 0;
    tp(c)->close(c->ep, abortive);
    a->conn_hooks->slot_free(c); /* after close: no I/O thread writes into its slot any more */
    if (c->ib)
        c->ib->conns--;
    if (c->accepted)
        a->n_conns_in--;
    if (c->accepted && !c->handshaken)
        a->n_preauth--;
    if (c->outbound) {
        int was_ctrl = 0;
        if (c->path >= 0) {
            kvl_path_lost(&c->peer->paths[c->path], sent, recv, put, died_caps, why);
        } else if (c->peer->ctrl == c) {
            c->peer->ctrl = NULL;
            was_ctrl = 1;
        }
        a->conn_hooks->outbound_lost(c, c->peer, c->path, was_ctrl, why);
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

/* Whether an admitted inbound connection is idle past idle_conn_timeout:
 * no frame and no payload byte for that long, and nothing in flight (a
 * payload being placed or drained, a frame half read, answers queued). */
static int idle_past(kvl_conn *c, uint64_t since, uint64_t idle, uint64_t now)
{
    if (!idle || !c->accepted || !c->handshaken || !c->ib || c->dead)
        return 0;
    uint64_t rb = tp(c)->bytes_recv(c->ep);
    if (rb != c->idle_rx_bytes) { /* a long payload is still coming: not idle */
        c->idle_rx_bytes = rb;
        c->t_frame_ns = now;
        return 0;
    }
    if (since || c->rx || c->px || c->nprefs || kvl_conn_has_output(c))
        return 0;
    return now > c->t_frame_ns && now - c->t_frame_ns > idle;
}

void kvl_conn_expire(kvl_agent *a, uint64_t now)
{
    uint64_t limit = (uint64_t)a->cfg.connect_timeout_ms * 1000000ull;
    uint64_t idle = (uint64_t)a->cfg.idle_conn_timeout_ms * 1000000ull;
    for (kvl_conn *c = a->conns, *next; c; c = next) {
        next = c->next;
        uint64_t since = c->dead || !c->accepted ? 0 : tp(c)->rx_partial_since(c->ep, now);
        if (!c->handshaken && now - c->t_open_ns > limit)
            kvl_conn_fail(c, KVL_ERR_TIMEOUT, "no HELLO within the handshake timeout");
        else if (since && now > since && now - since > KVL_PARTIAL_FRAME_TIMEOUTS * limit)
            kvl_conn_fail(c, KVL_ERR_TIMEOUT,
                          "a frame started arriving and no more of it came for 6 x "
                          "connect_timeout");
        else if (idle_past(c, since, idle, now)) {
            /* a live agent pings every connection it holds (monitor.c): this
             * one's peer stopped or forgot it; it reconnects when it needs to */
            kvl_log_limited(a, KVL_LOG_INFO, c->peer_name,
                            "closed a %s connection from '%s' that carried nothing for %u ms "
                            "(idle_conn_timeout_s)",
                            c->kind == KVL_CONN_CONTROL ? "control" : "data", c->peer_name,
                            a->cfg.idle_conn_timeout_ms);
            kvl_conn_fail(c, KVL_OK, "idle past idle_conn_timeout_s");
        }
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
