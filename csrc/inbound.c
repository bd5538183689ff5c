/* inbound.c: the receiving side of pushes.
 *
 * A push announces itself (ANNOUNCE: tag, size, chunk-to-layer map) on each
 * connection before its first DATA there.  From that frame on the receiver
 * keeps, per sender instance and transfer:
 *
 *  - chunk ownership.  A chunk can reach us more than once: re-sent after
 *    its path was cut or stalled, or hedged onto a second path.  Both copies
 *    name the same destination bytes, so if both wrote, a slow or corrupt
 *    copy could overwrite bytes another copy had already verified, even after
 *    the sender reported the transfer complete.  So the newest attempt seen
 *    places its bytes, an older attempt still arriving is drained to scratch
 *    from then on, and once a copy is verified (settled) every other copy is
 *    drained.  After the sender's END the transfer is a tombstone: late
 *    copies are drained too.
 *  - the application's handle (kvl_inxfer): progress per chunk and per
 *    layer, taken with kvl_inbound_next, waited on with kvl_inxfer_wait /
 *    wait_layer / next_event.
 *
 * DATA for a transfer that was not announced is refused: every chunk index
 * is checked against the announced count.
 *
 * Fairness.  What a push holds here is charged to its sender's share
 * (share.c): a sender over its quota is refused with the reason, and when
 * the agent is out of room a new push takes room only from the sender
 * holding the most of what is short, and only while that sender holds more
 * than its fair part; never from one within it.  Each share keeps its live
 * pushes in an LRU by progress (a newly verified chunk, not any frame: a
 * sender keeping a push "alive" with 1-byte pieces into settled chunks is
 * idle) and its tombstones oldest last, so eviction and expiry take tails;
 * deadlines are in a heap.  Nothing on the engine thread walks every entry.
 *
 * The entry table is engine-thread only; a handle's progress is under its
 * own mutex; the queue of handles not yet taken is under a->inq_mu.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define ENDED_KEEP_NS (30ull * 1000000000ull) /* tombstones outlive any late copy */
#define IDLE_KEEP_NS (300ull * 1000000000ull) /* a sender that vanished without END */
#define END_GRACE_NS (2000ull * 1000000ull)   /* after the sender's deadline: its END is due */
#define EVICT_IDLE_NS (1000ull * 1000000ull)  /* over quota: its own push this idle goes */
#define EVICT_ENDED_NS (5000ull * 1000000ull) /* out of room: a tombstone this old goes first */
#define QUEUE_KEEP_NS (60ull * 1000000000ull) /* a finished handle nobody took is dropped */

/* The receiver's handle: a push's progress here (progress.c) and what it
 * announced.  A handle costs what its push announced: its tag inline
 * (kvl_inbound_info's 4096-byte array for 16384 handles would be 75 MiB a
 * sender could make us hold), the error text only once it failed. */
struct kvl_inxfer {
    atomic_int refs;           /* the engine's entry, and the queue's or the caller's */
    kvl_progress prog;         /* chunks, layers, events, outcome (not deferred) */
    uint64_t xfer_id;          /* the sender's; this and what follows never change */
    char peer[64];
    uint64_t t_announce_ns;
    uint32_t tag_len;
    uint8_t *tag;              /* tag_len bytes */
    /* inq_mu: the queue of handles nobody took yet */
    int queued;
    uint64_t t_queued_ns;
    kvl_share *share;          /* whose queue count it is in (valid while queued) */
    struct kvl_inxfer *qprev, *qnext;   /* a->inq_head: every queued handle, oldest first */
    struct kvl_inxfer *sqprev, *sqnext; /* share->q_head: its sender's */
};

/* ---- handles ---- */

static kvl_err inx_timeout(const kvl_progress *p, int what, uint32_t layer, uint32_t timeout_ms)
{
    const kvl_inxfer *t = p->owner;
    (void)layer;
    const char *waited = what == KVL_WAIT_LAYER  ? "layer not complete"
                         : what == KVL_WAIT_EVENT ? "no chunk"
                                                  : "still arriving";
    return kvl_fail(KVL_ERR_TIMEOUT,
                    "inbound push %llu from '%s': %s after %u ms (%llu of %llu bytes verified)",
                    (unsigned long long)t->xfer_id, t->peer, waited, timeout_ms,
                    (unsigned long long)p->bytes_done, (unsigned long long)p->bytes_total);
}

static kvl_err inx_failed(const kvl_progress *p)
{
    const kvl_inxfer *t = p->owner;
    return kvl_fail((kvl_err)p->err, "inbound push %llu from '%s': %s",
                    (unsigned long long)t->xfer_id, t->peer, kvl_progress_why(p));
}

static kvl_err inx_no_layer(const kvl_progress *p, uint32_t layer)
{
    return kvl_fail(KVL_ERR_INVALID_ARG, "layer %u: the push has layers 0..%u", layer,
                    p->n_layers - 1);
}

static const kvl_progress_msgs inx_msgs = {inx_timeout, inx_failed, inx_no_layer};

static void inx_free(kvl_inxfer *t)
{
    kvl_progress_destroy(&t->prog);
    free(t->tag);
    free(t);
}

void kvl_inxfer_release(kvl_inxfer *t)
{
    if (t && atomic_fetch_sub(&t->refs, 1) == 1)
        inx_free(t);
}

static kvl_inxfer *inx_new(const char *peer, const kvl_msg_announce *m, uint64_t now)
{
    kvl_inxfer *t = calloc(1, sizeof *t);
    if (!t)
        return NULL;
    kvl_progress_init(&t->prog, &inx_msgs, t, 0);
    atomic_init(&t->refs, 2);
    t->tag = malloc(m->tag_len ? m->tag_len : 1);
    if (!t->tag || kvl_progress_alloc(&t->prog, m->n_chunks, m->n_layers, m->bytes)) {
        inx_free(t);
        return NULL;
    }
    for (uint32_t i = 0; i < m->n_chunks; i++)
        kvl_dec_announce_chunk(m, i, &t->prog.chunk_lf[i], &t->prog.chunk_ll[i]);
    kvl_progress_start(&t->prog);
    t->xfer_id = m->xfer;
    snprintf(t->peer, sizeof t->peer, "%s", peer);
    t->tag_len = m->tag_len;
    memcpy(t->tag, m->tag, m->tag_len);
    t->t_announce_ns = now;
    return t;
}

static void inx_fail(kvl_inxfer *t, kvl_err err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void inx_fail(kvl_inxfer *t, kvl_err err, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    kvl_progress_vfail(&t->prog, err, fmt, ap);
    va_end(ap);
}

/* ---- the queue of handles not yet taken (inq_mu) ---- */

static void queue_unlink(kvl_agent *a, kvl_inxfer *t)
{
    kvl_share *s = t->share;
    *(t->qprev ? &t->qprev->qnext : &a->inq_head) = t->qnext;
    *(t->qnext ? &t->qnext->qprev : &a->inq_tail) = t->qprev;
    *(t->sqprev ? &t->sqprev->sqnext : &s->q_head) = t->sqnext;
    *(t->sqnext ? &t->sqnext->sqprev : &s->q_tail) = t->sqprev;
    t->qprev = t->qnext = t->sqprev = t->sqnext = NULL;
    t->queued = 0;
    t->share = NULL;
    s->queued--;
    a->shares.queued--;
}

/* The share holding the most queued handles (O(shares), only when the
 * whole queue is full). */
static kvl_share *queue_heaviest(kvl_agent *a)
{
    kvl_share *best = NULL;
    for (kvl_share *s = a->shares.all; s; s = s->next)
        if (s->queued && (!best || s->queued > best->queued))
            best = s;
    return best;
}

/* Queues t for kvl_inbound_next.  Nobody takes them: over its sender's
 * KVL_SHARE_QUEUED the sender's oldest goes, and with the queue full the
 * oldest of the sender queuing the most, so a flood of pushes nobody
 * takes cannot push other senders' handles out. */
static void queue_put(kvl_agent *a, kvl_share *s, kvl_inxfer *t, uint64_t now)
{
    pthread_mutex_lock(&a->inq_mu);
    kvl_inxfer *drop = NULL;
    kvl_share *from = s->queued >= KVL_SHARE_QUEUED         ? s
                      : a->shares.queued >= KVL_ROOM_QUEUED ? queue_heaviest(a)
                                                             : NULL;
    if (from) {
        drop = from->q_head;
        queue_unlink(a, drop);
    }
    t->t_queued_ns = now;
    t->queued = 1;
    t->share = s;
    t->qprev = a->inq_tail;
    *(a->inq_tail ? &a->inq_tail->qnext : &a->inq_head) = t;
    a->inq_tail = t;
    t->sqprev = s->q_tail;
    *(s->q_tail ? &s->q_tail->sqnext : &s->q_head) = t;
    s->q_tail = t;
    s->queued++;
    a->shares.queued++;
    pthread_cond_broadcast(&a->inq_cv);
    pthread_mutex_unlock(&a->inq_mu);
    kvl_inxfer_release(drop);
}

/* Releases handles unlinked from the queue and chained by qnext (outside
 * inq_mu: the last reference frees). */
static void release_chain(kvl_inxfer *drop)
{
    while (drop) {
        kvl_inxfer *t = drop;
        drop = t->qnext;
        kvl_inxfer_release(t);
    }
}

/* Finished handles nobody took for QUEUE_KEEP_NS go: oldest first, so the
 * walk stops at the first one queued more recently. */
static void queue_expire(kvl_agent *a, uint64_t now)
{
    kvl_inxfer *drop = NULL;
    pthread_mutex_lock(&a->inq_mu);
    for (kvl_inxfer *t = a->inq_head, *next; t && now - t->t_queued_ns > QUEUE_KEEP_NS; t = next) {
        next = t->qnext;
        if (kvl_progress_finished(&t->prog)) {
            queue_unlink(a, t);
            t->qnext = drop;
            drop = t;
        }
    }
    pthread_mutex_unlock(&a->inq_mu);
    release_chain(drop);
}

/* ---- entries (engine thread) ---- */

/* Every DATA frame looks its transfer up: a hash over a secret seed keeps
 * that O(1) however many entries senders create (and whatever ids they pick). */
static kvl_rx_xfer **bucket(kvl_agent *a, uint64_t instance, uint64_t xfer)
{
    uint64_t h = (instance ^ a->rx_seed) + xfer * 0x9e3779b97f4a7c15ull; /* splitmix64 */
    h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
    h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
    h ^= h >> 31;
    return &a->rx_buckets[h % KVL_RX_BUCKETS];
}

static kvl_rx_xfer *find(kvl_agent *a, uint64_t instance, uint64_t xfer)
{
    for (kvl_rx_xfer *r = *bucket(a, instance, xfer); r; r = r->hnext)
        if (r->instance == instance && r->xfer == xfer)
            return r;
    return NULL;
}

/* -- the deadline heap: the soonest announced deadline on top -- */

static void heap_set(kvl_agent *a, uint32_t i, kvl_rx_xfer *r)
{
    a->rx_heap[i] = r;
    r->heap_at = i;
}

static void heap_up(kvl_agent *a, uint32_t i)
{
    kvl_rx_xfer *r = a->rx_heap[i];
    while (i > 0 && a->rx_heap[(i - 1) / 2]->deadline_ns > r->deadline_ns) {
        heap_set(a, i, a->rx_heap[(i - 1) / 2]);
        i = (i - 1) / 2;
    }
    heap_set(a, i, r);
}

static void heap_down(kvl_agent *a, uint32_t i)
{
    kvl_rx_xfer *r = a->rx_heap[i];
    for (;;) {
        uint32_t c = 2 * i + 1;
        if (c >= a->rx_heap_n)
            break;
        if (c + 1 < a->rx_heap_n && a->rx_heap[c + 1]->deadline_ns < a->rx_heap[c]->deadline_ns)
            c++;
        if (a->rx_heap[c]->deadline_ns >= r->deadline_ns)
            break;
        heap_set(a, i, a->rx_heap[c]);
        i = c;
    }
    heap_set(a, i, r);
}

static int heap_push(kvl_agent *a, kvl_rx_xfer *r)
{
    if (!a->rx_heap && !(a->rx_heap = malloc(KVL_ROOM_ENTRIES * sizeof *a->rx_heap)))
        return -1;
    a->rx_heap[a->rx_heap_n] = r; /* live pushes are at most KVL_ROOM_ENTRIES */
    heap_up(a, a->rx_heap_n++);
    return 0;
}

static void heap_remove(kvl_agent *a, kvl_rx_xfer *r)
{
    uint32_t i = r->heap_at;
    if (i == KVL_RX_NO_HEAP)
        return;
    r->heap_at = KVL_RX_NO_HEAP;
    kvl_rx_xfer *last = a->rx_heap[--a->rx_heap_n];
    if (last == r)
        return;
    heap_set(a, i, last);
    heap_up(a, i);
    heap_down(a, last->heap_at);
}

/* -- a share's lists: live pushes by progress, tombstones by age -- */

static kvl_rx_xfer **list_head(kvl_rx_xfer *r)
{
    return r->ended ? &r->share->tomb_head : &r->share->lru_head;
}

static kvl_rx_xfer **list_tail(kvl_rx_xfer *r)
{
    return r->ended ? &r->share->tomb_tail : &r->share->lru_tail;
}

static void list_unlink(kvl_rx_xfer *r)
{
    *(r->prev ? &r->prev->next : list_head(r)) = r->next;
    *(r->next ? &r->next->prev : list_tail(r)) = r->prev;
    r->prev = r->next = NULL;
}

static void list_push_head(kvl_rx_xfer *r)
{
    kvl_rx_xfer **head = list_head(r);
    r->prev = NULL;
    r->next = *head;
    *(*head ? &(*head)->prev : list_tail(r)) = r;
    *head = r;
}

/* -- what an entry holds, charged to its share and the room -- */

static void charge_live(kvl_agent *a, kvl_rx_xfer *r, int sign)
{
    kvl_share *s = r->share;
    uint32_t d = sign > 0 ? 1u : (uint32_t)-1;
    s->live += d;
    s->chunks += d * r->n;
    a->shares.chunks += d * r->n;
    s->layers += d * r->n_layers;
    a->shares.layers += d * r->n_layers;
}

static void charge_tag(kvl_agent *a, kvl_rx_xfer *r, int sign)
{
    uint32_t d = sign > 0 ? r->tag_bytes : (uint32_t)-r->tag_bytes;
    r->share->tag_bytes += d;
    a->shares.tag_bytes += d;
}

static void unhash(kvl_agent *a, kvl_rx_xfer *r)
{
    kvl_rx_xfer **pp = bucket(a, r->instance, r->xfer);
    while (*pp != r)
        pp = &(*pp)->hnext;
    *pp = r->hnext;
}

static kvl_rx_xfer *entry_new(kvl_agent *a, kvl_share *s, uint64_t xfer)
{
    kvl_rx_xfer *r = calloc(1, sizeof *r);
    if (!r)
        return NULL;
    r->instance = s->sender;
    r->xfer = xfer;
    r->share = s;
    r->heap_at = KVL_RX_NO_HEAP;
    kvl_rx_xfer **b = bucket(a, r->instance, xfer);
    r->hnext = *b;
    *b = r;
    a->shares.entries++;
    return r;
}

/* A push that failed before the application took its handle keeps only
 * what reports the failure: its per-chunk and per-layer arrays go now, so
 * handles waiting in the queue cost their tag, not their push's size. */
static void drop_handle(kvl_agent *a, kvl_rx_xfer *r)
{
    pthread_mutex_lock(&a->inq_mu);
    if (r->h->queued)
        kvl_progress_shrink(&r->h->prog);
    pthread_mutex_unlock(&a->inq_mu);
    kvl_inxfer_release(r->h);
    r->h = NULL;
    charge_tag(a, r, -1);
}

/* r is over (END, its deadline, or dropped): no copy lands any more, and
 * what its chunks held goes back.  A handle still held fails with err and why. */
static void end_live(kvl_agent *a, kvl_rx_xfer *r, kvl_err err, const char *why)
{
    if (r->h) {
        inx_fail(r->h, err, "%s", why);
        drop_handle(a, r);
    }
    if (r->ended || !r->chunks)
        return; /* a tombstone, or an entry made a tombstone at once (kvl_rx_end) */
    heap_remove(a, r);
    list_unlink(r);
    charge_live(a, r, -1);
    free(r->chunks);
    r->chunks = NULL;
    r->n = r->n_layers = 0;
}

/* Frees r, live or a tombstone.  A copy still placing (refs) keeps its
 * memory: r leaves every table and count now, as an orphan that places
 * nothing more, and kvl_rx_done frees it when the last copy ends. */
static void entry_drop(kvl_agent *a, kvl_rx_xfer *r, kvl_err err, const char *why)
{
    end_live(a, r, err, why);
    if (r->ended) {
        list_unlink(r);
        r->share->tombs--;
    }
    unhash(a, r);
    a->shares.entries--;
    if (r->refs) {
        r->ended = 1; /* kvl_rx_owns: no copy owns a chunk of it any more */
        r->orphan = 1;
        r->share = NULL;
        return;
    }
    free(r);
}

/* No copy of r's chunks may land from now on (END, or the sender's
 * deadline passed without one): r stays as a tombstone.  Beyond the
 * sender's KVL_SHARE_TOMBS its oldest tombstone goes. */
static void tombstone(kvl_agent *a, kvl_rx_xfer *r, uint64_t now)
{
    end_live(a, r, KVL_ERR_PROTOCOL, "over");
    kvl_share *s = r->share;
    if (s->tombs >= KVL_SHARE_TOMBS && s->tomb_tail)
        entry_drop(a, s->tomb_tail, KVL_OK, "");
    r->ended = 1;
    r->t_progress_ns = now;
    list_push_head(r);
    s->tombs++;
}

/* One push always fits an empty share: eviction of the sender's own idle
 * pushes can always make room for it. */
_Static_assert(KVL_SHARE_CHUNKS >= KVL_MAX_XFER_CHUNKS && KVL_SHARE_LAYERS >= KVL_MAX_LAYERS &&
                   KVL_SHARE_TAG_BYTES >= KVL_MAX_TAG,
               "a share holds at least one push of every size");

/* What a new push needs. */
typedef struct need {
    uint32_t chunks, layers, tag_bytes;
} need;

/* The first resource s's quota lacks for n (its name for the refusal and
 * the quota), or NULL when n fits. */
static const char *over_quota(const kvl_share *s, const need *n, uint32_t *quota)
{
    if (s->live >= KVL_SHARE_LIVE)
        return *quota = KVL_SHARE_LIVE, "pushes";
    if (s->chunks + n->chunks > KVL_SHARE_CHUNKS)
        return *quota = KVL_SHARE_CHUNKS, "chunks";
    if (s->layers + n->layers > KVL_SHARE_LAYERS)
        return *quota = KVL_SHARE_LAYERS, "layers";
    if (s->tag_bytes + n->tag_bytes > KVL_SHARE_TAG_BYTES)
        return *quota = KVL_SHARE_TAG_BYTES, "tag bytes";
    return NULL;
}

enum { RES_ENTRIES, RES_CHUNKS, RES_LAYERS, RES_TAGS, RES_NONE };

static uint32_t used(const kvl_share *s, int res)
{
    return res == RES_ENTRIES ? s->live + s->tombs
           : res == RES_CHUNKS ? s->chunks
           : res == RES_LAYERS ? s->layers
                               : s->tag_bytes;
}

static const uint32_t room_of[] = {KVL_ROOM_ENTRIES, KVL_ROOM_CHUNKS, KVL_ROOM_LAYERS,
                                   KVL_ROOM_TAG_BYTES};

/* The resource the room lacks for n (RES_NONE: it fits). */
static int short_of(const kvl_agent *a, const need *n)
{
    if (a->shares.entries >= KVL_ROOM_ENTRIES)
        return RES_ENTRIES;
    if (a->shares.chunks + n->chunks > KVL_ROOM_CHUNKS)
        return RES_CHUNKS;
    if (a->shares.layers + n->layers > KVL_ROOM_LAYERS)
        return RES_LAYERS;
    if (a->shares.tag_bytes + n->tag_bytes > KVL_ROOM_TAG_BYTES)
        return RES_TAGS;
    return RES_NONE;
}

/* The oldest-progress live push of s that no copy is placing, idle for at
 * least min_idle_ns; NULL if none.  Walks from the tail past copies in
 * flight only (at most one per connection). */
static kvl_rx_xfer *lru_victim(kvl_share *s, uint64_t now, uint64_t min_idle_ns)
{
    for (kvl_rx_xfer *r = s->lru_tail; r && now - r->t_progress_ns >= min_idle_ns; r = r->prev)
        if (!r->refs)
            return r;
    return NULL;
}

static uint32_t room_used(const kvl_agent *a, int res)
{
    return res == RES_ENTRIES ? a->shares.entries
           : res == RES_CHUNKS ? a->shares.chunks
           : res == RES_LAYERS ? a->shares.layers
                               : a->shares.tag_bytes;
}

/* A sender's fair part of `res`: the room over the senders holding any
 * (`asking` counted). */
static uint32_t fair_part(const kvl_agent *a, const kvl_share *asking, int res)
{
    uint32_t active = asking->live + asking->tombs ? 0 : 1;
    for (const kvl_share *s = a->shares.all; s; s = s->next)
        active += s->live + s->tombs ? 1 : 0;
    return room_of[res] / active;
}

/* Whether evicting what other senders hold beyond their fair part can make
 * room for `need` of `res`: if not, nobody is evicted in vain. */
static int can_make_room(const kvl_agent *a, const kvl_share *asking, int res, uint32_t need)
{
    uint32_t fair = fair_part(a, asking, res);
    uint64_t room = (uint64_t)room_of[res] - room_used(a, res);
    for (const kvl_share *s = a->shares.all; s; s = s->next)
        if (s != asking && used(s, res) > fair)
            room += used(s, res) - fair;
    return room >= need;
}

/* What v gives up for `res`: an old tombstone, else its least recently
 * progressed push no copy is placing, else its oldest tombstone, else its
 * least recently progressed push even with a copy in flight (a sender over
 * its part cannot pin room by holding a copy's last bytes back). */
static kvl_rx_xfer *victim_of(kvl_share *v, int res, uint64_t now)
{
    kvl_rx_xfer *r = NULL;
    if (res == RES_ENTRIES && v->tomb_tail && now - v->tomb_tail->t_progress_ns >= EVICT_ENDED_NS)
        r = v->tomb_tail;
    if (!r)
        r = lru_victim(v, now, 0);
    if (!r && res == RES_ENTRIES)
        r = v->tomb_tail;
    return r ? r : v->lru_tail;
}

/* The room lacks `res`: of the senders holding more of it than their fair
 * part, the one holding the most that has something to give gives up one
 * entry (never `asking`).  0: nobody may be evicted. */
static int evict_heaviest(kvl_agent *a, const kvl_share *asking, int res, uint64_t now)
{
    uint32_t fair = fair_part(a, asking, res);
    kvl_share *v = NULL;
    kvl_rx_xfer *r = NULL;
    for (kvl_share *s = a->shares.all; s; s = s->next) {
        if (s == asking || used(s, res) <= fair || (v && used(s, res) <= used(v, res)))
            continue;
        kvl_rx_xfer *c = victim_of(s, res, now);
        if (c) {
            v = s;
            r = c;
        }
    }
    if (!r)
        return 0;
    a->shares.evicted += !r->ended;
    if (r->refs && !r->ended)
        a->revoke_rx(a, r, 0); /* its copies stop placing before the handle fails */
    entry_drop(a, r, KVL_ERR_BUSY,
               "dropped: the agent ran out of room for inbound pushes and this sender held more "
               "than its part");
    return 1;
}

static uint32_t need_of(const need *n, int res)
{
    return res == RES_ENTRIES ? 1
           : res == RES_CHUNKS ? n->chunks
           : res == RES_LAYERS ? n->layers
                               : n->tag_bytes;
}

static kvl_err refuse(kvl_agent *a, kvl_share *s, uint64_t xfer, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static kvl_err refuse(kvl_agent *a, kvl_share *s, uint64_t xfer, const char *fmt, ...)
{
    a->shares.refused++;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s->refused_why, sizeof s->refused_why, fmt, ap);
    va_end(ap);
    if (s->n_refused == KVL_SHARE_REFUSED) {
        memmove(s->refused, s->refused + 1, (KVL_SHARE_REFUSED - 1) * sizeof *s->refused);
        s->n_refused--;
    }
    s->refused[s->n_refused++] = xfer;
    s->t_refused_ns = kvl_now_ns();
    return kvl_fail(KVL_ERR_BUSY, "%s", s->refused_why);
}

void kvl_rx_refusal(kvl_agent *a, uint64_t instance, char *out, size_t len)
{
    kvl_share *s = kvl_share_find(a, instance);
    if (s && s->n_refused)
        snprintf(out, len, "%s", s->refused_why);
    else if (!s)
        snprintf(out, len,
                 "agent '%s' holds inbound state of %u sender sessions, none of which can make "
                 "way; retry later",
                 a->name, KVL_SHARE_MAX);
    else
        snprintf(out, len, "agent '%s' refused the push", a->name);
}

static int was_refused(const kvl_share *s, uint64_t xfer)
{
    for (uint32_t i = 0; s && i < s->n_refused; i++)
        if (s->refused[i] == xfer)
            return 1;
    return 0;
}

/* Room for a push needing n from s: within s's quota (its own idle pushes
 * make way), then within the agent's room (the heaviest sender over its
 * part makes way).  KVL_OK, or the refusal (recorded for its DATA). */
static kvl_err make_room(kvl_agent *a, kvl_share *s, uint64_t xfer, const need *n, uint64_t now)
{
    uint32_t quota = 0;
    const char *what;
    kvl_rx_xfer *v;
    while ((what = over_quota(s, n, &quota)) && (v = lru_victim(s, now, EVICT_IDLE_NS))) {
        a->shares.evicted++;
        entry_drop(a, v, KVL_ERR_BUSY,
                   "dropped: no chunk of it was verified for 1 s while its sender announced "
                   "more than its share here");
    }
    if (what)
        return refuse(a, s, xfer,
                      "agent '%s': this peer's inbound share (%u %s) is in use by its pushes "
                      "here; retry once they finish",
                      a->name, quota, what);
    int res;
    for (int r = RES_ENTRIES; r < RES_NONE; r++)
        if ((r == RES_ENTRIES ? room_used(a, r) >= room_of[r]
                              : room_used(a, r) + need_of(n, r) > room_of[r]) &&
            !can_make_room(a, s, r, need_of(n, r)))
            return refuse(a, s, xfer,
                          "agent '%s' is out of room for inbound pushes (%u of %u pushes, %u of "
                          "%u chunks) and every sender holds at most its part; retry later",
                          a->name, a->shares.entries, KVL_ROOM_ENTRIES, a->shares.chunks,
                          KVL_ROOM_CHUNKS);
    while ((res = short_of(a, n)) != RES_NONE && evict_heaviest(a, s, res, now))
        ;
    if (res != RES_NONE)
        return refuse(a, s, xfer,
                      "agent '%s' is out of room for inbound pushes (%u of %u pushes, %u of %u "
                      "chunks) and every sender holds at most its part; retry later",
                      a->name, a->shares.entries, KVL_ROOM_ENTRIES, a->shares.chunks,
                      KVL_ROOM_CHUNKS);
    return KVL_OK;
}

kvl_err kvl_rx_announce(kvl_agent *a, uint64_t instance, const char *peer,
                        const kvl_msg_announce *m)
{
    if (find(a, instance, m->xfer))
        return KVL_OK; /* announced on another connection already, or over */
    kvl_share *s = kvl_share_get(a, instance);
    if (!s)
        return kvl_fail(KVL_ERR_BUSY,
                        "agent '%s' holds inbound state of %u sender sessions, none of which "
                        "can make way",
                        a->name, KVL_SHARE_MAX);
    if (was_refused(s, m->xfer))
        return KVL_ERR_BUSY; /* its ANNOUNCE on another connection: the same answer */
    uint64_t now = kvl_now_ns();
    need n = {m->n_chunks, m->n_layers, m->tag_len};
    kvl_err e = make_room(a, s, m->xfer, &n, now);
    if (e)
        return e;
    kvl_rx_chunk *chunks = calloc(m->n_chunks ? m->n_chunks : 1, sizeof *chunks);
    kvl_inxfer *h = chunks ? inx_new(peer, m, now) : NULL;
    kvl_rx_xfer *r = h ? entry_new(a, s, m->xfer) : NULL;
    if (r)
        r->deadline_ns = m->timeout_ms ? now + (uint64_t)m->timeout_ms * 1000000ull : 0;
    if (!r || (r->deadline_ns && heap_push(a, r) != 0)) {
        if (r) {
            unhash(a, r);
            free(r);
            a->shares.entries--;
        }
        free(chunks);
        if (h) {
            kvl_inxfer_release(h);
            kvl_inxfer_release(h);
        }
        return kvl_fail(KVL_ERR_NOMEM, "out of memory for an inbound transfer");
    }
    r->chunks = chunks;
    r->h = h;
    r->n = m->n_chunks;
    r->n_layers = m->n_layers;
    r->tag_bytes = m->tag_len;
    r->t_progress_ns = now;
    charge_live(a, r, 1);
    charge_tag(a, r, 1);
    list_push_head(r);
    queue_put(a, s, h, now);
    return KVL_OK;
}

int kvl_rx_claim(kvl_agent *a, uint64_t instance, uint64_t xfer, uint32_t chunk,
                 uint32_t attempt, kvl_rx_xfer **out, uint32_t *drain_status)
{
    kvl_rx_xfer *r = find(a, instance, xfer);
    if (r && r->ended) {
        *drain_status = KVL_RX_SUPERSEDED;
        return 0;
    }
    kvl_share *sh = r ? NULL : kvl_share_find(a, instance);
    if (!r && (was_refused(sh, xfer) || (!sh && a->shares.n >= KVL_SHARE_MAX))) {
        *drain_status = KVL_ERR_BUSY; /* kvl_rx_refusal says why */
        return 0;
    }
    if (!r || !r->chunks || chunk >= r->n) {
        *drain_status = KVL_ERR_PROTOCOL; /* not announced, or outside what was */
        return 0;
    }
    kvl_rx_chunk *ch = &r->chunks[chunk];
    if (ch->settled) {
        *drain_status = KVL_OK; /* another copy is verified in place already */
        return 0;
    }
    if (attempt < ch->owner) {
        *drain_status = KVL_RX_SUPERSEDED;
        return 0;
    }
    ch->owner = attempt;
    r->refs++;
    *out = r;
    return 1;
}

int kvl_rx_owns(const kvl_rx_xfer *r, uint32_t chunk, uint32_t attempt)
{
    return !r->ended && chunk < r->n && !r->chunks[chunk].settled &&
           r->chunks[chunk].owner == attempt;
}

void kvl_rx_done(kvl_rx_xfer *r, uint32_t chunk, uint32_t attempt, int verified, uint32_t path,
                 uint64_t bytes)
{
    if (verified && kvl_rx_owns(r, chunk, attempt)) {
        r->chunks[chunk].settled = 1;
        r->t_progress_ns = kvl_now_ns(); /* progress: to the head of its share's LRU */
        list_unlink(r);
        list_push_head(r);
        if (r->h)
            kvl_progress_chunk_done(&r->h->prog, chunk, path, bytes, r->t_progress_ns);
    }
    if (--r->refs == 0 && r->orphan)
        free(r); /* dropped while this copy placed (entry_drop) */
}

void kvl_rx_end(kvl_agent *a, uint64_t instance, const kvl_msg_status *m)
{
    kvl_rx_xfer *r = find(a, instance, m->xfer);
    if (r && r->ended)
        return;
    if (!r) {
        /* a tombstone, so a late ANNOUNCE cannot start it again; none at
         * the room's limit: a late copy then finds no entry and is refused */
        kvl_share *s = a->shares.entries < KVL_ROOM_ENTRIES ? kvl_share_get(a, instance) : NULL;
        if (!s || !(r = entry_new(a, s, m->xfer)))
            return;
        tombstone(a, r, kvl_now_ns());
        return;
    }
    /* nothing lands once the handle says it is over (END comes only once the
     * sender's one-sided writes are complete or fenced: transport.h) */
    a->revoke_rx(a, r, 0);
    if (r->h) {
        if (m->status != KVL_OK)
            inx_fail(r->h, m->status > 0 && m->status <= KVL_ERR_MAX ? m->status
                                                                           : KVL_ERR_PROTOCOL,
                     "the sender failed the push: %s", m->msg);
        else
            inx_fail(r->h, KVL_ERR_PROTOCOL,
                     "the sender ended the push before every chunk was verified here");
        drop_handle(a, r);
    }
    tombstone(a, r, kvl_now_ns());
}

/* Tails first: tombstones past ENDED_KEEP_NS, pushes with no progress for
 * IDLE_KEEP_NS (a sender that vanished without END). */
static void expire_share(kvl_agent *a, kvl_share *s, uint64_t now)
{
    while (s->tomb_tail && now - s->tomb_tail->t_progress_ns > ENDED_KEEP_NS)
        entry_drop(a, s->tomb_tail, KVL_OK, "");
    kvl_rx_xfer *r;
    while ((r = lru_victim(s, now, IDLE_KEEP_NS + 1)))
        entry_drop(a, r, KVL_ERR_CONN_LOST, "the sender went silent for 300 s");
}

void kvl_rx_expire(kvl_agent *a, uint64_t now)
{
    while (a->rx_heap_n && now > a->rx_heap[0]->deadline_ns + END_GRACE_NS) {
        kvl_rx_xfer *r = a->rx_heap[0];
        /* the sender's END never came: the push is over here too, and no
         * late copy may land once the handle says it failed, not even a
         * write the sender posted on a one-sided path */
        a->revoke_rx(a, r, 1);
        if (r->h) {
            inx_fail(r->h, KVL_ERR_DEADLINE,
                     "push %llu from this sender passed its deadline without finishing",
                     (unsigned long long)r->xfer);
            drop_handle(a, r);
        }
        tombstone(a, r, now); /* leaves the heap */
    }
    for (kvl_share *s = a->shares.all; s; s = s->next)
        expire_share(a, s, now);
    queue_expire(a, now);
    kvl_share_sweep(a, now);
}

void kvl_rx_forget_sender(kvl_agent *a, uint64_t sender)
{
    kvl_share *s = kvl_share_find(a, sender);
    if (!s)
        return;
    for (kvl_rx_xfer *r = s->lru_head, *next; r; r = next) {
        next = r->next;
        if (!r->refs) /* a copy still placing keeps it */
            entry_drop(a, r, KVL_ERR_CONN_LOST, "the sender's session ended: it reconnected anew");
    }
    while (s->tomb_head)
        entry_drop(a, s->tomb_head, KVL_OK, "");
    kvl_share_forget(s); /* its session key never sends again */
}

void kvl_rx_free_all(kvl_agent *a)
{
    for (kvl_share *s = a->shares.all; s; s = s->next) {
        while (s->lru_head) {
            kvl_rx_xfer *r = s->lru_head;
            r->refs = 0;
            entry_drop(a, r, KVL_ERR_CLOSED, "the agent was closed while the push arrived");
        }
        while (s->tomb_head)
            entry_drop(a, s->tomb_head, KVL_OK, "");
    }
    memset(a->rx_buckets, 0, sizeof a->rx_buckets);
    free(a->rx_heap);
    a->rx_heap = NULL;
    a->rx_heap_n = 0;
    pthread_mutex_lock(&a->inq_mu);
    kvl_inxfer *drop = NULL;
    while (a->inq_head) {
        kvl_inxfer *t = a->inq_head;
        queue_unlink(a, t);
        t->qnext = drop;
        drop = t;
    }
    pthread_mutex_unlock(&a->inq_mu);
    release_chain(drop);
}

/* ---- the application's side (any thread) ---- */

kvl_err kvl_inbound_next(kvl_agent *a, const void *tag, size_t tag_len, int any_tag,
                         uint32_t timeout_ms, kvl_inxfer **out)
{
    kvl_clear_error();
    if (!a || !out || (!any_tag && tag_len && !tag))
        return kvl_fail(KVL_ERR_INVALID_ARG, "inbound: NULL argument");
    if (tag_len > KVL_MAX_TAG)
        return kvl_fail(KVL_ERR_INVALID_ARG, "inbound: tag is %zu bytes; tags are at most %d",
                        tag_len, KVL_MAX_TAG);
    struct timespec ts = kvl_deadline_ts(timeout_ms);
    pthread_mutex_lock(&a->inq_mu);
    kvl_inxfer *found = NULL;
    int rc = 0;
    for (;;) {
        for (kvl_inxfer *t = a->inq_head; t; t = t->qnext) {
            /* tag and tag_len never change after creation */
            if (any_tag || (t->tag_len == tag_len && !memcmp(t->tag, tag, tag_len))) {
                queue_unlink(a, t);
                found = t;
                break;
            }
        }
        if (found || rc || atomic_load(&a->stopping) || atomic_load(&a->closing))
            break;
        rc = pthread_cond_timedwait(&a->inq_cv, &a->inq_mu, &ts);
    }
    pthread_mutex_unlock(&a->inq_mu);
    if (found) {
        *out = found; /* the queue's reference is the caller's now */
        return KVL_OK;
    }
    if (atomic_load(&a->stopping) || atomic_load(&a->closing))
        return kvl_fail(KVL_ERR_CLOSED, "the agent is closed");
    if (any_tag)
        return kvl_fail(KVL_ERR_TIMEOUT, "no inbound push announced within %u ms", timeout_ms);
    char shown[64];
    size_t k = 0;
    for (size_t i = 0; i < tag_len && k + 5 < sizeof shown; i++) {
        uint8_t ch = ((const uint8_t *)tag)[i];
        k += (size_t)snprintf(shown + k, sizeof shown - k, ch >= 32 && ch < 127 && ch != '\'' ? "%c" : "\\x%02x", ch);
    }
    return kvl_fail(KVL_ERR_TIMEOUT,
                    "no inbound push with notify tag '%s%s' within %u ms (each push is handed out "
                    "once: was it taken already?)",
                    shown, k + 5 >= sizeof shown ? "..." : "", timeout_ms);
}

kvl_err kvl_inxfer_wait(kvl_inxfer *t, uint32_t timeout_ms)
{
    return kvl_progress_wait(&t->prog, timeout_ms);
}

kvl_err kvl_inxfer_wait_layer(kvl_inxfer *t, uint32_t layer, uint32_t timeout_ms)
{
    return kvl_progress_wait_layer(&t->prog, layer, timeout_ms);
}

kvl_err kvl_inxfer_next_event(kvl_inxfer *t, uint32_t timeout_ms, kvl_chunk_event *ev)
{
    return kvl_progress_next_event(&t->prog, timeout_ms, ev);
}

kvl_err kvl_inxfer_info(kvl_inxfer *t, kvl_inbound_info *out)
{
    kvl_clear_error();
    kvl_progress_snap s;
    kvl_progress_get(&t->prog, &s, out->message, sizeof out->message);
    out->xfer_id = t->xfer_id;
    memcpy(out->peer, t->peer, sizeof out->peer);
    out->state = s.state;
    out->err = s.err;
    out->bytes_total = s.bytes_total;
    out->bytes_done = s.bytes_done;
    out->chunks_total = s.chunks_total;
    out->chunks_done = s.chunks_done;
    out->layers = s.layers;
    out->layers_ready = s.layers_ready;
    out->t_announce_ns = t->t_announce_ns;
    out->t_first_byte_ns = s.t_first_byte_ns;
    out->t_done_ns = s.t_done_ns;
    out->tag_len = t->tag_len;
    memcpy(out->tag, t->tag, t->tag_len);
    return KVL_OK;
}

kvl_err kvl_inxfer_progress(kvl_inxfer *t, kvl_inbound_progress *out)
{
    kvl_progress_snap s;
    kvl_progress_get(&t->prog, &s, NULL, 0);
    out->state = s.state;
    out->chunks_done = s.chunks_done;
    out->layers_ready = s.layers_ready;
    out->bytes_done = s.bytes_done;
    return KVL_OK;
}

kvl_err kvl_inxfer_layer_done(kvl_inxfer *t, uint32_t layer, int *done)
{
    kvl_clear_error();
    if (layer >= t->prog.n_layers) /* fixed at announce */
        return kvl_fail(KVL_ERR_INVALID_ARG, "layer %u: the push has layers 0..%u", layer,
                        t->prog.n_layers - 1);
    *done = kvl_progress_layer_done(&t->prog, layer); /* 0 once failed and shrunk */
    return KVL_OK;
}
