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
 * is checked against the announced count, and a peer can only create
 * entries up to MAX_ENTRIES.
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
#define MAX_ENTRIES 16384                     /* transfers (live and tombstones) per agent */
#define MAX_LIVE_CHUNKS (1u << 18)            /* chunks of all announced, unended pushes */
#define MAX_LIVE_LAYERS (1u << 20)            /* their layers (5 bytes each per push) */
#define EVICT_IDLE_NS (1000ull * 1000000ull)  /* out of room: an announced push this idle goes */
#define EVICT_ENDED_NS (5000ull * 1000000ull) /* ...then a tombstone this old */
#define QUEUE_MAX 1024                        /* handles waiting for kvl_inbound_next */
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
    uint64_t t_queued_ns;      /* inq_mu */
    struct kvl_inxfer *qnext;  /* inq_mu */
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

/* ---- the queue of handles not yet taken ---- */

static void queue_put(kvl_agent *a, kvl_inxfer *t, uint64_t now)
{
    pthread_mutex_lock(&a->inq_mu);
    t->t_queued_ns = now;
    t->qnext = NULL;
    kvl_inxfer **pp = &a->inq_head;
    uint32_t n = 0;
    while (*pp) {
        pp = &(*pp)->qnext;
        n++;
    }
    *pp = t;
    kvl_inxfer *drop = NULL;
    if (n >= QUEUE_MAX) { /* nobody takes them: the oldest goes */
        drop = a->inq_head;
        a->inq_head = drop->qnext;
    }
    pthread_cond_broadcast(&a->inq_cv);
    pthread_mutex_unlock(&a->inq_mu);
    kvl_inxfer_release(drop);
}

static void queue_expire(kvl_agent *a, uint64_t now)
{
    kvl_inxfer *drop = NULL;
    pthread_mutex_lock(&a->inq_mu);
    for (kvl_inxfer **pp = &a->inq_head; *pp;) {
        kvl_inxfer *t = *pp;
        if (kvl_progress_finished(&t->prog) && now - t->t_queued_ns > QUEUE_KEEP_NS) {
            *pp = t->qnext;
            t->qnext = drop;
            drop = t;
        } else {
            pp = &t->qnext;
        }
    }
    pthread_mutex_unlock(&a->inq_mu);
    while (drop) {
        kvl_inxfer *t = drop;
        drop = t->qnext;
        kvl_inxfer_release(t);
    }
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

static void unhash(kvl_agent *a, kvl_rx_xfer *r)
{
    kvl_rx_xfer **pp = bucket(a, r->instance, r->xfer);
    while (*pp != r)
        pp = &(*pp)->hnext;
    *pp = r->hnext;
}

static kvl_rx_xfer *entry_new(kvl_agent *a, uint64_t instance, uint64_t xfer)
{
    if (a->n_rx_xfers >= MAX_ENTRIES)
        return NULL;
    kvl_rx_xfer *r = calloc(1, sizeof *r);
    if (!r)
        return NULL;
    r->instance = instance;
    r->xfer = xfer;
    r->next = a->rx_xfers;
    a->rx_xfers = r;
    kvl_rx_xfer **b = bucket(a, instance, xfer);
    r->hnext = *b;
    *b = r;
    a->n_rx_xfers++;
    return r;
}

/* A push that failed before the application took its handle keeps only
 * what reports the failure: its per-chunk and per-layer arrays go now, so
 * handles waiting in the queue cost their tag, not their push's size. */
static void inx_shrink_if_queued(kvl_agent *a, kvl_inxfer *t)
{
    pthread_mutex_lock(&a->inq_mu);
    int queued = 0;
    for (kvl_inxfer *q = a->inq_head; q && !queued; q = q->qnext)
        queued = q == t;
    if (queued)
        kvl_progress_shrink(&t->prog);
    pthread_mutex_unlock(&a->inq_mu);
}

static void drop_handle(kvl_agent *a, kvl_rx_xfer *r)
{
    inx_shrink_if_queued(a, r->h);
    kvl_inxfer_release(r->h);
    r->h = NULL;
}

/* Unlinks r (at *pp in a->rx_xfers) and frees it; a handle still held
 * fails with err and why. */
static void entry_drop(kvl_agent *a, kvl_rx_xfer **pp, kvl_err err, const char *why)
{
    kvl_rx_xfer *r = *pp;
    *pp = r->next;
    unhash(a, r);
    if (r->h) {
        inx_fail(r->h, err, "%s", why);
        drop_handle(a, r);
    }
    if (r->chunks) {
        a->rx_chunks_live -= r->n;
        a->rx_layers_live -= r->n_layers;
    }
    free(r->chunks);
    free(r);
    a->n_rx_xfers--;
}

static int fits(const kvl_agent *a, uint32_t n_chunks, uint32_t n_layers, int new_entry)
{
    return a->rx_chunks_live + n_chunks <= MAX_LIVE_CHUNKS &&
           a->rx_layers_live + n_layers <= MAX_LIVE_LAYERS &&
           (!new_entry || a->n_rx_xfers < MAX_ENTRIES);
}

/* Out of room for a new push: senders that announce and then go quiet
 * (a flood of ANNOUNCE frames, or a sender that died) must not lock out
 * the pushes that are moving.  Drops announced pushes that placed nothing
 * for EVICT_IDLE_NS, then tombstones older than EVICT_ENDED_NS, until the
 * new one fits.  Returns whether it does. */
static int make_room(kvl_agent *a, const kvl_rx_xfer *keep, uint32_t n_chunks,
                     uint32_t n_layers, int new_entry, uint64_t now)
{
    for (int pass = 0; pass < 2 && !fits(a, n_chunks, n_layers, new_entry); pass++) {
        for (kvl_rx_xfer **pp = &a->rx_xfers; *pp && !fits(a, n_chunks, n_layers, new_entry);) {
            kvl_rx_xfer *r = *pp;
            uint64_t idle = now - r->t_last_ns;
            int drop = r != keep && !r->refs &&
                       (pass == 0 ? !r->ended && idle > EVICT_IDLE_NS
                                  : r->ended && idle > EVICT_ENDED_NS);
            if (drop)
                entry_drop(a, pp, KVL_ERR_NOMEM,
                           "dropped: nothing arrived for it while the agent ran out of room "
                           "for inbound pushes");
            else
                pp = &r->next;
        }
    }
    return fits(a, n_chunks, n_layers, new_entry);
}

kvl_err kvl_rx_announce(kvl_agent *a, uint64_t instance, const char *peer,
                        const kvl_msg_announce *m)
{
    kvl_rx_xfer *r = find(a, instance, m->xfer);
    if (r && (r->chunks || r->ended))
        return KVL_OK; /* announced on another connection already, or over */
    uint64_t now = kvl_now_ns();
    if (!make_room(a, r, m->n_chunks, m->n_layers, !r, now))
        return kvl_fail(KVL_ERR_NOMEM,
                        "agent '%s' tracks %u inbound pushes (%u chunks, %u layers), all of "
                        "them active",
                        a->name, a->n_rx_xfers, a->rx_chunks_live, a->rx_layers_live);
    if (!r && !(r = entry_new(a, instance, m->xfer)))
        return kvl_fail(KVL_ERR_NOMEM, "out of memory for an inbound transfer");
    r->t_last_ns = now;
    r->chunks = calloc(m->n_chunks, sizeof *r->chunks);
    r->h = r->chunks ? inx_new(peer, m, now) : NULL;
    if (!r->h) {
        free(r->chunks);
        r->chunks = NULL;
        return kvl_fail(KVL_ERR_NOMEM, "out of memory for an inbound transfer");
    }
    r->n = m->n_chunks;
    r->n_layers = m->n_layers;
    a->rx_chunks_live += r->n;
    a->rx_layers_live += r->n_layers;
    r->deadline_ns = m->timeout_ms ? now + (uint64_t)m->timeout_ms * 1000000ull : 0;
    queue_put(a, r->h, now);
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
    if (!r || !r->chunks || chunk >= r->n) {
        *drain_status = KVL_ERR_PROTOCOL; /* not announced, or outside what was */
        return 0;
    }
    r->t_last_ns = kvl_now_ns();
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
    r->t_last_ns = kvl_now_ns(); /* a copy just ended: the push is moving */
    if (verified && kvl_rx_owns(r, chunk, attempt)) {
        r->chunks[chunk].settled = 1;
        if (r->h)
            kvl_progress_chunk_done(&r->h->prog, chunk, path, bytes, kvl_now_ns());
    }
    r->refs--;
}

/* No copy of r's chunks may land from now on (END, or the sender's
 * deadline passed without one). */
static void tombstone(kvl_agent *a, kvl_rx_xfer *r)
{
    if (r->chunks) {
        a->rx_chunks_live -= r->n;
        a->rx_layers_live -= r->n_layers;
    }
    r->ended = 1;
    free(r->chunks);
    r->chunks = NULL;
    r->n = 0;
    r->t_last_ns = kvl_now_ns();
}

void kvl_rx_end(kvl_agent *a, uint64_t instance, const kvl_msg_status *m)
{
    kvl_rx_xfer *r = find(a, instance, m->xfer);
    if (!r && !(r = entry_new(a, instance, m->xfer)))
        return; /* at the limit: a late copy then finds no entry and is refused */
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
    tombstone(a, r);
}

void kvl_rx_expire(kvl_agent *a, uint64_t now)
{
    kvl_rx_xfer **pp = &a->rx_xfers;
    while (*pp) {
        kvl_rx_xfer *r = *pp;
        if (!r->ended && r->deadline_ns && now > r->deadline_ns + END_GRACE_NS) {
            /* the sender's END never came: the push is over here too, and
             * no late copy may land once the handle says it failed, not
             * even a write the sender posted on a one-sided path */
            a->revoke_rx(a, r, 1);
            if (r->h) {
                inx_fail(r->h, KVL_ERR_DEADLINE,
                         "push %llu from this sender passed its deadline without finishing",
                         (unsigned long long)r->xfer);
                drop_handle(a, r);
            }
            tombstone(a, r);
        }
        uint64_t keep = r->ended ? ENDED_KEEP_NS : IDLE_KEEP_NS;
        if (!r->refs && now - r->t_last_ns > keep) {
            entry_drop(a, pp, KVL_ERR_CONN_LOST, "the sender went silent for 300 s");
        } else {
            pp = &r->next;
        }
    }
    queue_expire(a, now);
}

void kvl_rx_forget_sender(kvl_agent *a, uint64_t sender)
{
    kvl_rx_xfer **pp = &a->rx_xfers;
    while (*pp) {
        kvl_rx_xfer *r = *pp;
        if (r->instance != sender || r->refs) /* a copy still placing keeps it */
            pp = &r->next;
        else
            entry_drop(a, pp, KVL_ERR_CONN_LOST, "the sender's session ended: it reconnected anew");
    }
}

void kvl_rx_free_all(kvl_agent *a)
{
    while (a->rx_xfers) {
        kvl_rx_xfer *r = a->rx_xfers;
        a->rx_xfers = r->next;
        if (r->h) {
            inx_fail(r->h, KVL_ERR_CLOSED, "the agent was closed while the push arrived");
            drop_handle(a, r);
        }
        free(r->chunks);
        free(r);
    }
    memset(a->rx_buckets, 0, sizeof a->rx_buckets);
    a->n_rx_xfers = 0;
    a->rx_chunks_live = 0;
    a->rx_layers_live = 0;
    while (a->inq_head) {
        kvl_inxfer *t = a->inq_head;
        a->inq_head = t->qnext;
        kvl_inxfer_release(t);
    }
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
        for (kvl_inxfer **pp = &a->inq_head; *pp; pp = &(*pp)->qnext) {
            kvl_inxfer *t = *pp; /* tag and tag_len never change after creation */
            if (any_tag || (t->tag_len == tag_len && !memcmp(t->tag, tag, tag_len))) {
                *pp = t->qnext;
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
