/* place.c: where a payload goes.  Every piece a header names is resolved
 * against the regions this agent exposes (bounds, rights, access key)
 * before one byte is placed; the sink is built from them (scratch for a
 * copy that may not place), payloads of memory the stream cannot touch go
 * through a staging slot, and a copy that takes over a chunk revokes the
 * others still placing it.
 */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "conn_impl.h"

/* ---- receive helpers ---- */

int kvl_place_dst_reserve(kvl_conn *c, int n)
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
void kvl_place_revoke_others(kvl_conn *self, kvl_rx_xfer *rx, kvl_xfer *px, uint32_t chunk)
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
void kvl_place_rx_release(kvl_conn *c)
{
    kvl_stage_give(c->a, c->srx);
    c->srx = NULL;
    c->stage = KVL_STAGE_NONE;
}

void kvl_place_drain_all(kvl_conn *c)
{
    c->ndst = 0;
    kvl_place_rx_release(c);
    if (kvl_place_dst_reserve(c, 1)) {
        kvl_conn_fail(c, KVL_ERR_NOMEM, "out of memory for a drain");
        return;
    }
    c->dst[0].iov_base = NULL;
    c->dst[0].iov_len = c->h->payload_len;
    c->ndst = 1;
}

void kvl_place_release_prefs(kvl_conn *c)
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
int kvl_place_resolve(kvl_conn *c, const kvl_msg_chunk *m, uint32_t need,
                          kvl_msg_status *st, uint64_t *total, int *stage)
{
    kvl_region *last = NULL;
    *total = 0;
    *stage = KVL_STAGE_NONE;
    c->ndst = 0;
    if (kvl_place_dst_reserve(c, (int)m->n_pieces)) {
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
            }
            if (e) {
                /* the details (whether the region exists, its name, its size,
                 * its rights) stay in our log: the peer gets one answer for
                 * all of them, so a connection without the key learns nothing
                 * (docs/security.md) */
                kvl_log_limited(c->a, KVL_LOG_WARNING, c->peer_name, "%s", kvl_last_error());
                st->status = KVL_ERR_ACCESS_DENIED;
                snprintf(st->msg, sizeof st->msg, "%s", KVL_REFUSED_REGION_ACCESS);
                kvl_place_release_prefs(c);
                return -1;
            }
            if (prefs_push(c, r)) {
                kvl_regions_release(&c->a->regions, r);
                st->status = KVL_ERR_NOMEM;
                snprintf(st->msg, sizeof st->msg, "out of memory");
                kvl_place_release_prefs(c);
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
            kvl_place_release_prefs(c);
            return -1;
        }
        *total += p.len;
        kvl_iov_add(c->dst, &c->ndst, last->base + p.offset, p.len);
    }
    return 0;
}

/* The largest payload this agent stages on receipt: its own chunk size or
 * staged chunk size, whichever is larger (a peer configured alike never
 * sends more). */
uint64_t kvl_place_stage_cap(const kvl_agent *a)
{
    return a->cfg.stage_chunk_bytes > a->cfg.chunk_bytes ? a->cfg.stage_chunk_bytes
                                                         : a->cfg.chunk_bytes;
}

/* The payload about to arrive (total bytes) goes to memory the socket cannot
 * write (kind: KVL_STAGE_*): it is received into c's host slot, and the
 * pieces c->dst named are kept in c->sdst for on_payload.  0, or -1 with c
 * failed (out of memory). */
int kvl_place_stage(kvl_conn *c, int kind, uint64_t total)
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
    kvl_place_rx_release(c);
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
kvl_err kvl_place_unstage(kvl_conn *c, int kind)
{
    return kvl_stage_scatter(c->srx, kind, c->sdst, c->nsdst);
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

void kvl_place_payload_dropped(kvl_conn *c)
{
    kvl_place_release_prefs(c);
    if (c->rx) {
        kvl_rx_done(c->rx, c->pst.chunk, c->pst.attempt, 0, 0, 0);
        c->rx = NULL;
    }
    if (c->px) {
        c->px->io_refs--;
        c->px = NULL;
    }
}

void kvl_place_slot_free(kvl_conn *c) { kvl_place_rx_release(c); }
