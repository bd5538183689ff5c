/* inbound.h: which copy of a pushed chunk may write, and the receiver's handle (inbound.c). */
#ifndef KVLINK_INBOUND_H_
#define KVLINK_INBOUND_H_

#include "base.h"

/* ---- inbound.c: which copy of a pushed chunk may write ---- */
#define KVL_RX_SUPERSEDED 100 /* wire-only ACK status: a newer copy owns the chunk */
#define KVL_RX_NO_HEAP UINT32_MAX
typedef struct kvl_rx_chunk {
    uint32_t owner;   /* newest attempt seen: the only one allowed to place */
    uint8_t settled;  /* a copy was verified in place */
} kvl_rx_chunk;
typedef struct kvl_rx_xfer {
    uint64_t instance, xfer;  /* the sender session (kvl_inbound.sender) and its transfer id */
    kvl_rx_chunk *chunks;     /* NULL until announced, and again once ended */
    uint32_t n;               /* announced chunk count */
    uint32_t n_layers;        /* announced layer count */
    int ended;                /* the sender said END: every late copy is drained */
    int refs;                 /* connections placing bytes for it right now */
    int orphan;               /* dropped while refs: freed by the last kvl_rx_done */
    uint64_t t_progress_ns;   /* announced, or a chunk newly verified ("idle" counts from it);
                                 a tombstone: when it ended */
    uint64_t deadline_ns;     /* the sender's deadline, as announced (0: none) */
    uint32_t heap_at;         /* its place in the deadline heap (KVL_RX_NO_HEAP: none) */
    uint32_t tag_bytes;       /* charged to its share while the engine holds h */
    kvl_inxfer *h;            /* the application's handle, until the push ends */
    struct kvl_share *share;  /* its sender's (share.c) */
    struct kvl_rx_xfer *prev, *next; /* the share's live LRU, or its tombstone FIFO */
    struct kvl_rx_xfer *hnext; /* a->rx_buckets: entries of one hash bucket */
} kvl_rx_xfer;
/* ANNOUNCE from sender `instance` (agent `peer`): creates the entry and
 * queues its handle for kvl_inbound_next.  A repeat is ignored.  Over the
 * sender's share, or out of room with every other sender within its part,
 * the push is refused: its DATA frames are answered with the reason
 * (kvl_rx_refusal). */
kvl_err kvl_rx_announce(kvl_agent *a, uint64_t instance, const char *peer,
                        const kvl_msg_announce *m);
/* 1: this copy owns the chunk and may place (*out referenced); 0: drain it
 * and answer *drain_status (KVL_OK if another copy is already verified,
 * KVL_ERR_BUSY if its ANNOUNCE was refused (kvl_rx_refusal says why),
 * KVL_ERR_PROTOCOL if the transfer was not announced or the chunk is not
 * in it). */
int kvl_rx_claim(kvl_agent *a, uint64_t instance, uint64_t xfer, uint32_t chunk,
                 uint32_t attempt, kvl_rx_xfer **out, uint32_t *drain_status);
/* Why sender `instance`'s push was refused at ANNOUNCE (kvl_rx_claim said
 * KVL_ERR_BUSY), into out. */
void kvl_rx_refusal(kvl_agent *a, uint64_t instance, char *out, size_t len);
/* Still the owner?  Checked before every read into the destination. */
int kvl_rx_owns(const kvl_rx_xfer *r, uint32_t chunk, uint32_t attempt);
/* The copy finished (verified or not; path and bytes for the handle's
 * chunk event); drops the reference. */
void kvl_rx_done(kvl_rx_xfer *r, uint32_t chunk, uint32_t attempt, int verified, uint32_t path,
                 uint64_t bytes);
/* END: the sender finished the push (m->status says how). */
void kvl_rx_end(kvl_agent *a, uint64_t instance, const kvl_msg_status *m);
void kvl_rx_expire(kvl_agent *a, uint64_t now);
/* Sender session `sender` (kvl_inbound.sender) is over: what it left is
 * dropped, handles failed. */
void kvl_rx_forget_sender(kvl_agent *a, uint64_t sender);
void kvl_rx_free_all(kvl_agent *a);
/* place.c: every copy placing a chunk of r stops placing before this
 * returns (the handle is about to report a failure).  silent: the sender's
 * END never came, so writes of r it posted on a one-sided path may still
 * land: every such path from it is fenced too.  (inbound.c calls it as
 * a->revoke_rx, registered by the agent.) */
void kvl_proto_revoke_rx(kvl_agent *a, kvl_rx_xfer *r, int silent);

#endif
