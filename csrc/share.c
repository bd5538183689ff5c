/* share.c: what one sender session holds on this agent.
 *
 * Everything a peer can make the receiver hold (inbound pushes, their
 * chunks, layers and tags, tombstones, queued notifications, handles
 * nobody took yet) is counted twice: against the sender's share (its
 * quota, share.h) and against the agent's room.  inbound.c and notify.c
 * refuse what is over the sender's quota, and when the room is full take
 * room only from the sender holding the most, never from one within its
 * fair part: one admitted peer cannot lock the others out.
 *
 * A share is keyed on the authenticated session (kvl_inbound.sender: name,
 * instance and session token), never on a name a frame claims.  It lives
 * while it holds something; shares that hold nothing are freed by the
 * engine's sweep, so the table is bounded by what senders hold.
 *
 * The table and the engine counters are engine-thread only; the
 * notification counters are under notif_mu, the queue counters under
 * inq_mu (the application's threads decrement those).
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define SEEN_KEEP_NS (60ull * 1000000000ull) /* a re-sent NOTIFY comes within seconds */

static uint32_t mix(uint64_t seed, uint64_t v, uint32_t mod)
{
    uint64_t h = (v ^ seed) * 0x9e3779b97f4a7c15ull; /* splitmix64's finaliser */
    h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
    h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
    return (uint32_t)((h ^ (h >> 31)) % mod);
}

kvl_share *kvl_share_find(kvl_agent *a, uint64_t sender)
{
    kvl_share *s = a->shares.buckets[mix(a->shares.seed, sender, KVL_SHARE_BUCKETS)];
    while (s && s->sender != sender)
        s = s->hnext;
    return s;
}

static void list_unlink(kvl_agent *a, kvl_share *s)
{
    *(s->prev ? &s->prev->next : &a->shares.all) = s->next;
    *(s->next ? &s->next->prev : &a->shares.all_tail) = s->prev;
    s->prev = s->next = NULL;
}

static void list_push_head(kvl_agent *a, kvl_share *s)
{
    s->prev = NULL;
    s->next = a->shares.all;
    *(s->next ? &s->next->prev : &a->shares.all_tail) = s;
    a->shares.all = s;
}

static int holds_nothing(kvl_agent *a, const kvl_share *s, uint64_t now);
static void share_free(kvl_agent *a, kvl_share *s);

/* Of the KVL_SHARE_EVICT_LOOK least recently used shares, the oldest that
 * holds only memory (a session that ended long ago, or one cycling names to
 * fill the table), or NULL. */
static kvl_share *memory_only_lru(kvl_agent *a)
{
    kvl_share *v = a->shares.all_tail;
    for (int i = 0; v && i < KVL_SHARE_EVICT_LOOK; i++, v = v->prev)
        if (holds_nothing(a, v, UINT64_MAX))
            return v;
    return NULL;
}

kvl_share *kvl_share_get(kvl_agent *a, uint64_t sender)
{
    kvl_share *s = kvl_share_find(a, sender);
    if (s) {
        if (a->shares.all != s) { /* the most recently used first */
            list_unlink(a, s);
            list_push_head(a, s);
        }
        return s;
    }
    if (a->shares.n >= KVL_SHARE_MAX) {
        kvl_share *v = memory_only_lru(a);
        if (!v) {
            a->shares.full_refused++;
            return NULL;
        }
        share_free(a, v);
    }
    s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    s->sender = sender;
    s->salt = a->shares.seed ^ (sender * 0x9e3779b97f4a7c15ull);
    kvl_share **b = &a->shares.buckets[mix(a->shares.seed, sender, KVL_SHARE_BUCKETS)];
    s->hnext = *b;
    *b = s;
    list_push_head(a, s);
    a->shares.n++;
    return s;
}

static void seen_free(kvl_seen_set *t)
{
    if (t) {
        free(t->xfer);
        free(t);
    }
}

/* Remembers xfer in t (the ring's next slot; the oldest leaves when full). */
static void seen_put(kvl_seen_set *t, uint64_t salt, uint64_t xfer)
{
    uint16_t slot = (uint16_t)t->head;
    if (t->n == t->cap) { /* full: the oldest leaves its chain */
        uint16_t *pp = &t->bucket[mix(salt, t->xfer[slot], 2 * t->cap)];
        while (*pp != slot)
            pp = &t->next[*pp];
        *pp = t->next[slot];
    } else {
        t->n++;
    }
    uint16_t *b = &t->bucket[mix(salt, xfer, 2 * t->cap)];
    t->xfer[slot] = xfer;
    t->next[slot] = *b;
    *b = slot;
    t->head = (t->head + 1) % t->cap;
}

/* A set of cap slots holding old's entries, oldest first (NULL: no memory). */
static kvl_seen_set *seen_new(uint32_t cap, uint64_t salt, const kvl_seen_set *old)
{
    kvl_seen_set *t = calloc(1, sizeof *t);
    uint8_t *mem = malloc(cap * (sizeof(uint64_t) + 3 * sizeof(uint16_t)));
    if (!t || !mem) {
        free(t);
        free(mem);
        return NULL;
    }
    t->cap = cap;
    t->xfer = (uint64_t *)mem;
    t->next = (uint16_t *)(mem + cap * sizeof(uint64_t));
    t->bucket = t->next + cap;
    for (uint32_t i = 0; i < 2 * cap; i++)
        t->bucket[i] = (uint16_t)cap;
    if (old) /* a full ring: its oldest is at head */
        for (uint32_t i = 0; i < old->n; i++)
            seen_put(t, salt, old->xfer[(old->head + i) % old->cap]);
    return t;
}

int kvl_share_seen(kvl_share *s, uint64_t xfer, uint64_t now, int record)
{
    kvl_seen_set *t = s->seen;
    if (t) {
        for (uint16_t i = t->bucket[mix(s->salt, xfer, 2 * t->cap)]; i != t->cap; i = t->next[i])
            if (t->xfer[i] == xfer)
                return 1;
    }
    if (!record)
        return 0;
    if (!t || (t->n == t->cap && t->cap < KVL_SHARE_SEEN)) {
        kvl_seen_set *grown = seen_new(t ? 2 * t->cap : KVL_SHARE_SEEN_MIN, s->salt, t);
        if (!grown && !t)
            return 0; /* no memory: unseen, delivered (a duplicate at worst) */
        if (grown) {
            seen_free(t);
            s->seen = t = grown;
        }
    }
    s->t_seen_ns = now;
    seen_put(t, s->salt, xfer);
    return 0;
}

/* Nothing held but memory that expired by `now` (UINT64_MAX: any memory). */
static int holds_nothing(kvl_agent *a, const kvl_share *s, uint64_t now)
{
    if (s->live || s->tombs || (s->seen && now - s->t_seen_ns < SEEN_KEEP_NS) ||
        (s->n_refused && now - s->t_refused_ns < SEEN_KEEP_NS))
        return 0;
    pthread_mutex_lock(&a->notif_mu);
    int empty = s->notifs == 0;
    pthread_mutex_unlock(&a->notif_mu);
    pthread_mutex_lock(&a->inq_mu);
    empty = empty && s->queued == 0;
    pthread_mutex_unlock(&a->inq_mu);
    return empty;
}

static void share_free(kvl_agent *a, kvl_share *s)
{
    kvl_share **pp = &a->shares.buckets[mix(a->shares.seed, s->sender, KVL_SHARE_BUCKETS)];
    while (*pp != s)
        pp = &(*pp)->hnext;
    *pp = s->hnext;
    list_unlink(a, s);
    a->shares.n--;
    seen_free(s->seen);
    free(s);
}

void kvl_share_forget(kvl_share *s)
{
    seen_free(s->seen);
    s->seen = NULL;
    s->n_refused = 0;
}

void kvl_share_sweep(kvl_agent *a, uint64_t now)
{
    /* the application's threads only decrement the counters under the
     * locks, so a share found empty there stays empty: no new reference
     * to it is made but by this thread */
    for (kvl_share *s = a->shares.all, *next; s; s = next) {
        next = s->next;
        if (holds_nothing(a, s, now))
            share_free(a, s);
    }
}

void kvl_share_free_all(kvl_agent *a)
{
    while (a->shares.all) {
        kvl_share *s = a->shares.all;
        a->shares.all = s->next;
        seen_free(s->seen);
        free(s);
    }
    memset(a->shares.buckets, 0, sizeof a->shares.buckets);
    a->shares.all_tail = NULL;
    a->shares.n = 0;
}
