/* share.h: what one sender session holds on this agent, against its quota (share.c). */
#ifndef KVLINK_SHARE_H_
#define KVLINK_SHARE_H_

#include <pthread.h>

#include "base.h"

struct kvl_rx_xfer;
struct kvl_inxfer;

/* A sender session's quota: what one admitted peer may hold here at most.
 * A legitimate sender never needs more (a push of 64 GiB in 1 MiB chunks
 * is 65,536 chunks); an attacker at every quota holds ~20 MiB
 * (docs/security.md adds it up). */
#define KVL_SHARE_LIVE 2048                 /* announced, unended pushes */
#define KVL_SHARE_TOMBS 2048                /* ended pushes remembered: late copies drained */
#define KVL_SHARE_CHUNKS 65536              /* chunks of its live pushes */
#define KVL_SHARE_LAYERS (1u << 18)         /* their layers */
#define KVL_SHARE_TAG_BYTES (2u << 20)      /* tags of the handles the engine holds for it */
#define KVL_SHARE_NOTIFS 8192               /* notifications queued for the application */
#define KVL_SHARE_NOTIF_BYTES (4u << 20)    /* ...and their bytes (node and tag) */
#define KVL_SHARE_QUEUED 256                /* handles waiting for kvl_inbound_next */
#define KVL_SHARE_SEEN 1024                 /* notifications remembered for de-duplication */
#define KVL_SHARE_SEEN_MIN 16
#define KVL_SHARE_REFUSED 8                 /* refused pushes whose DATA gets the reason */

/* The agent's room: what every sender together may hold.  Four senders at
 * their quota fill it; a fifth then takes room from the heaviest. */
#define KVL_ROOM_ENTRIES 16384              /* live pushes and tombstones */
#define KVL_ROOM_CHUNKS (1u << 18)
#define KVL_ROOM_LAYERS (1u << 20)
#define KVL_ROOM_TAG_BYTES (8u << 20)
#define KVL_ROOM_NOTIFS 65536
#define KVL_ROOM_NOTIF_BYTES (64u << 20)
#define KVL_ROOM_QUEUED 1024
#define KVL_SHARE_MAX 8192                  /* sender sessions with state here */
#define KVL_SHARE_BUCKETS 4096
#define KVL_SHARE_EVICT_LOOK 64             /* shares a full table looks at for one to drop */

/* Notifications one sender had delivered, for de-duplication: a ring (the
 * oldest is forgotten first) indexed by a hash, so a lookup is O(1).  It
 * starts small and doubles up to KVL_SHARE_SEEN: a sender that sent one
 * notification costs a few hundred bytes, not the whole ring. */
typedef struct kvl_seen_set {
    uint32_t cap, n, head;                  /* slots, used, the ring's next slot */
    uint64_t *xfer;                         /* [cap] */
    uint16_t *next;                         /* [cap] chain within a bucket; cap: end */
    uint16_t *bucket;                       /* [2 * cap] */
} kvl_seen_set;

typedef struct kvl_share {
    uint64_t sender;                        /* kvl_inbound.sender */
    /* engine thread */
    uint32_t live, tombs, chunks, layers;   /* what its entries hold (inbound.c) */
    uint32_t tag_bytes;
    struct kvl_rx_xfer *lru_head, *lru_tail;   /* live pushes, most recent progress first */
    struct kvl_rx_xfer *tomb_head, *tomb_tail; /* tombstones, newest first */
    kvl_seen_set *seen;                     /* NULL until its first notification */
    uint64_t t_seen_ns;                     /* its last notification: seen[] is kept a while */
    uint64_t refused[KVL_SHARE_REFUSED];    /* pushes refused at ANNOUNCE, newest last */
    uint32_t n_refused;
    uint64_t t_refused_ns;                  /* the last refusal: its reason is kept a while */
    uint64_t salt;                          /* seeds seen[]'s hash: ids the sender picks */
    char refused_why[200];
    struct kvl_share *hnext;
    struct kvl_share *prev, *next;          /* a->shares.all, most recently used first */
    /* under a->notif_mu */
    uint32_t notifs;
    uint32_t notif_bytes;
    /* under a->inq_mu */
    uint32_t queued;
    struct kvl_inxfer *q_head, *q_tail;     /* its queued handles, oldest first */
} kvl_share;

typedef struct kvl_shares {
    kvl_share *buckets[KVL_SHARE_BUCKETS];
    kvl_share *all, *all_tail;              /* every share, most recently used first */
    uint32_t n;
    uint64_t full_refused;                  /* frames of new sessions refused: table full */
    uint64_t seed;                          /* secret: senders cannot aim at one bucket */
    /* engine thread: totals of every share's engine counters */
    uint32_t entries, chunks, layers, tag_bytes;
    /* under a->notif_mu */
    uint32_t notifs, notif_bytes;
    uint64_t refused, evicted;              /* pushes refused at ANNOUNCE, dropped for room */
    /* under a->inq_mu */
    uint32_t queued;
} kvl_shares;

/* The share of sender `sender`, created if it has none (it becomes the most
 * recently used).  At KVL_SHARE_MAX the least recently used share that
 * holds only memory (de-duplication, refusals) makes way, looking at most
 * KVL_SHARE_EVICT_LOOK of them: O(1); NULL when none does (nothing is
 * created).  Engine thread; takes notif_mu and inq_mu. */
kvl_share *kvl_share_get(kvl_agent *a, uint64_t sender);
/* The share of `sender`, or NULL.  Engine thread. */
kvl_share *kvl_share_find(kvl_agent *a, uint64_t sender);
/* Notification de-duplication: 1 if s had transfer xfer's notification
 * delivered before; 0 if not (then, with `record`, it is remembered; the
 * oldest of KVL_SHARE_SEEN is forgotten).  Engine thread; NOMEM counts as
 * unseen. */
int kvl_share_seen(kvl_share *s, uint64_t xfer, uint64_t now, int record);
/* Sender session s is over for good (a new session of its name began):
 * what it remembered (de-duplication, refusals) goes; it is freed once it
 * holds nothing else.  Engine thread. */
void kvl_share_forget(kvl_share *s);
/* Frees every share that holds nothing (and whose notification memory
 * expired), so the table is bounded by what senders hold.  Engine thread;
 * takes notif_mu and inq_mu. */
void kvl_share_sweep(kvl_agent *a, uint64_t now);
/* Teardown: frees every share (nothing may refer to them any more). */
void kvl_share_free_all(kvl_agent *a);

#endif
