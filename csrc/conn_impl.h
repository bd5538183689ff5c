/* conn_impl.h: one connection as the core sees it (struct kvl_conn), shared by
 * the four files that serve it and by nothing else:
 *   conn.c       its life: accepted or adopted, bound to a peer's path, frames
 *                queued (control frames, chunks), closed, reaped
 *   handshake.c  both halves of HELLO / CHALLENGE / AUTH, admission, the
 *                listener's side of a mover's set-up
 *   place.c      where a payload goes: pieces resolved against the regions,
 *                sinks, staging slots, revocation of other copies
 *   proto.c      frame routing and the handlers after the handshake
 * Everything here runs on the engine thread, but the initiator's handshake
 * (kvl_handshake_initiate), which runs on add_peer's helper threads and the
 * prober on a detached endpoint.
 */
#ifndef KVLINK_CONN_IMPL_H
#define KVLINK_CONN_IMPL_H

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
    uint64_t t_frame_ns;   /* inbound: when its last frame (or payload byte) came: the idle rule */
    uint64_t idle_rx_bytes; /* inbound: payload bytes received when the idle rule last looked */
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

static inline const kvl_stream_ops *tp(const kvl_conn *c) { return c->a->stream; }

/* c's mover (NULL: payloads in-stream), as the stream has it now: a mover
 * may drop itself (a fence, keys that disagree with the region table). */
static inline const kvl_mover_ops *mover_of(const kvl_conn *c, kvl_mover **m)
{
    kvl_mover *dummy;
    return tp(c)->mover(c->ep, m ? m : &dummy);
}

static inline uint32_t mover_caps(const kvl_conn *c)
{
    const kvl_mover_ops *ops = mover_of(c, NULL);
    return ops ? ops->caps : 0;
}

int kvl_conn_send_tp(kvl_conn *c, kvl_tp_frame *f);
/* Adds [p, p+len) to an iovec array, merging with the previous entry when
 * contiguous (paged KV blocks often are). */
void kvl_iov_add(struct iovec *v, int *n, void *p, size_t len);
void kvl_handshake_on_hello(kvl_conn *c);
/* An accepted connection answered its HELLO (admitted or refused): it no
 * longer counts among those still in their handshake. */
void kvl_handshake_over(kvl_conn *c);
void kvl_handshake_on_auth(kvl_conn *c);
/* MOVER_OFFER: once per data connection whose HELLO named a mover set up by
 * an offer.  The mover answers (MOVER_ACCEPT or MOVER_REFUSE); only a peer
 * that proved the cluster secret gets an answer other than a refusal
 * (docs/ucx.md: libucp parses worker addresses unchecked). */
void kvl_handshake_on_mover_offer(kvl_conn *c);
void kvl_place_release_prefs(kvl_conn *c);
/* A staged payload verified and still this copy's to place: out of the slot
 * into its pieces, synchronised (staging.c).  KVL_OK, or the copy's error. */
kvl_err kvl_place_unstage(kvl_conn *c, int kind);
int kvl_place_dst_reserve(kvl_conn *c, int n);
/* The largest payload this agent stages on receipt: its own chunk size or
 * staged chunk size, whichever is larger (a peer configured alike never
 * sends more). */
uint64_t kvl_place_stage_cap(const kvl_agent *a);
void kvl_place_drain_all(kvl_conn *c);
/* Checks every piece of a DATA/READ_REQ body against our regions with the
 * rights `need`; on success the regions are referenced in c->prefs and the
 * pieces' addresses are in c->dst.  On failure *st carries the status and
 * a message; a refused region is KVL_REFUSED_REGION_ACCESS whatever the
 * reason (the reason goes to the local log, rate-limited). */
int kvl_place_resolve(kvl_conn *c, const kvl_msg_chunk *m, uint32_t need,
                          kvl_msg_status *st, uint64_t *total, int *stage);
/* The payload about to arrive (total bytes) goes to memory the socket cannot
 * write (kind: KVL_STAGE_*): it is received into c's host slot, and the
 * pieces c->dst named are kept in c->sdst for on_payload.  0, or -1 with c
 * failed (out of memory). */
int kvl_place_stage(kvl_conn *c, int kind, uint64_t total);
/* The staged payload's slot back to the pool (none: nothing). */
void kvl_place_rx_release(kvl_conn *c);
/* Copies that were placing chunk `chunk` of push entry rx (or pull x) stop
 * before c's copy places a byte: with I/O threads their bytes may be landing
 * right now (transport.h, revocation).  Only asked when some copy of the
 * transfer is placing, so a flood of frames costs no walk. */
void kvl_place_revoke_others(kvl_conn *self, kvl_rx_xfer *rx, kvl_xfer *px, uint32_t chunk);
void kvl_conn_send_region_table(kvl_conn *c, uint8_t type, uint32_t status, const char *msg);

#endif
