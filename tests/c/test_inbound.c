/* test_inbound.c: chunk ownership and the receiver's handle (csrc/inbound.c)
 * driven the way the connection code drives it: ANNOUNCE, copies claimed,
 * placed, verified or lost, END, expiry. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "test_main.h"

/* The revocation inbound.c asks for (a->revoke_rx, place.c's in the agent)
 * before a handle reports a failure (the real one walks connections, which
 * this test has none of): counted, with whether the handle had already
 * failed when it came. */
static int revoked, revoked_after_failure;

static void revoke_rx(kvl_agent *a, kvl_rx_xfer *r, int silent)
{
    (void)a;
    (void)silent;
    revoked++;
    if (r->h && kvl_inxfer_wait(r->h, 0) != KVL_ERR_TIMEOUT)
        revoked_after_failure++;
}

static kvl_agent *agent_new(void)
{
    kvl_agent *a = calloc(1, sizeof *a);
    snprintf(a->name, sizeof a->name, "test");
    a->revoke_rx = revoke_rx;
    pthread_mutex_init(&a->inq_mu, NULL);
    pthread_cond_init(&a->inq_cv, NULL);
    pthread_mutex_init(&a->notif_mu, NULL);
    pthread_mutex_init(&a->log_mu, NULL);
    pthread_cond_init(&a->log_cv, NULL);
    return a;
}

static void agent_free(kvl_agent *a)
{
    kvl_rx_free_all(a);
    kvl_share_free_all(a);
    pthread_mutex_destroy(&a->notif_mu);
    pthread_mutex_destroy(&a->inq_mu);
    pthread_cond_destroy(&a->inq_cv);
    pthread_mutex_destroy(&a->log_mu);
    pthread_cond_destroy(&a->log_cv);
    free(a);
}

/* Announces transfer xfer of instance 7: n chunks, chunk i on layer i / 2. */
static kvl_err announce(kvl_agent *a, uint64_t xfer, uint32_t n, const char *tag)
{
    uint32_t lf[64], ll[64];
    for (uint32_t i = 0; i < n; i++)
        lf[i] = ll[i] = i / 2;
    kvl_msg_announce m = {.xfer = xfer, .bytes = 1000ull * n, .n_chunks = n,
                          .n_layers = (n + 1) / 2, .tag_len = (uint32_t)strlen(tag),
                          .tag = (const uint8_t *)tag};
    kvl_buf b = {0};
    kvl_enc_announce(&b, &m, lf, ll);
    kvl_msg_announce d;
    kvl_err e = kvl_dec_announce(b.p, b.len, &d);
    if (!e)
        e = kvl_rx_announce(a, 7, "sender", &d);
    kvl_buf_free(&b);
    return e;
}

static void test_ownership(void)
{
    kvl_agent *a = agent_new();
    kvl_rx_xfer *r = NULL, *r2 = NULL;
    uint32_t st = 0;
    /* not announced: refused */
    CHECK(!kvl_rx_claim(a, 7, 1, 0, 1, &r, &st) && st == KVL_ERR_PROTOCOL);
    CHECK(announce(a, 1, 4, "req") == KVL_OK);
    CHECK(announce(a, 1, 4, "req") == KVL_OK); /* a repeat on another connection: ignored */
    /* outside the announced count, however large */
    CHECK(!kvl_rx_claim(a, 7, 1, 4, 1, &r, &st) && st == KVL_ERR_PROTOCOL);
    CHECK(!kvl_rx_claim(a, 7, 1, 0x80000000u, 1, &r, &st) && st == KVL_ERR_PROTOCOL);
    /* another sender instance with the same transfer id is another transfer */
    CHECK(!kvl_rx_claim(a, 8, 1, 0, 1, &r, &st) && st == KVL_ERR_PROTOCOL);
    /* copy 1 owns chunk 0, then copy 2 (newer) takes it over */
    CHECK(kvl_rx_claim(a, 7, 1, 0, 1, &r, &st) && kvl_rx_owns(r, 0, 1));
    CHECK(kvl_rx_claim(a, 7, 1, 0, 2, &r2, &st) && r2 == r);
    CHECK(!kvl_rx_owns(r, 0, 1) && kvl_rx_owns(r, 0, 2));
    /* an older copy arriving now is drained */
    kvl_rx_xfer *r3 = NULL;
    CHECK(!kvl_rx_claim(a, 7, 1, 0, 1, &r3, &st) && st == KVL_RX_SUPERSEDED);
    /* copy 1 finishing "verified" settles nothing: it no longer owned the chunk */
    kvl_rx_done(r, 0, 1, 1, 0, 1000);
    CHECK(!r->chunks[0].settled);
    kvl_rx_done(r, 0, 2, 1, 1, 1000);
    CHECK(r->chunks[0].settled && r->refs == 0);
    /* once settled, every copy is drained and answered OK */
    CHECK(!kvl_rx_claim(a, 7, 1, 0, 9, &r3, &st) && st == KVL_OK);
    /* the handle saw one chunk, layer 0 half done */
    kvl_inxfer *h = NULL;
    CHECK(kvl_inbound_next(a, "req", 3, 0, 0, &h) == KVL_OK && h);
    kvl_inbound_progress pr;
    kvl_inxfer_progress(h, &pr);
    CHECK(pr.chunks_done == 1 && pr.layers_ready == 0 && pr.bytes_done == 1000);
    kvl_rx_claim(a, 7, 1, 1, 1, &r, &st);
    kvl_rx_done(r, 1, 1, 1, 0, 1000);
    CHECK(kvl_inxfer_wait_layer(h, 0, 0) == KVL_OK);
    CHECK(kvl_inxfer_wait_layer(h, 1, 0) == KVL_ERR_TIMEOUT);
    CHECK(kvl_inxfer_wait_layer(h, 2, 0) == KVL_ERR_INVALID_ARG);
    /* a copy that fails its crc leaves the chunk open for another copy */
    kvl_rx_claim(a, 7, 1, 2, 1, &r, &st);
    kvl_rx_done(r, 2, 1, 0, 0, 1000);
    CHECK(!r->chunks[2].settled);
    CHECK(kvl_rx_claim(a, 7, 1, 2, 2, &r, &st));
    kvl_rx_done(r, 2, 2, 1, 0, 1000);
    kvl_rx_claim(a, 7, 1, 3, 1, &r, &st);
    kvl_rx_done(r, 3, 1, 1, 0, 1000);
    CHECK(kvl_inxfer_wait(h, 0) == KVL_OK);
    kvl_chunk_event ev;
    int events = 0;
    while (kvl_inxfer_next_event(h, 0, &ev) == KVL_OK)
        events++;
    CHECK(events == 4);
    /* END: late copies of any chunk are drained from now on */
    kvl_msg_status end = {.xfer = 1};
    kvl_rx_end(a, 7, &end);
    CHECK(!kvl_rx_claim(a, 7, 1, 3, 5, &r, &st) && st == KVL_RX_SUPERSEDED);
    kvl_inxfer_release(h);
    agent_free(a);
}

static void test_end_before_done_fails_the_handle(void)
{
    kvl_agent *a = agent_new();
    CHECK(announce(a, 2, 2, "x") == KVL_OK);
    kvl_inxfer *h = NULL;
    CHECK(kvl_inbound_next(a, NULL, 0, 1, 0, &h) == KVL_OK);
    kvl_msg_status end = {.xfer = 2, .status = KVL_ERR_CONN_LOST};
    snprintf(end.msg, sizeof end.msg, "all paths down");
    revoked = revoked_after_failure = 0;
    kvl_rx_end(a, 7, &end);
    CHECK(revoked == 1 && revoked_after_failure == 0); /* copies stopped first */
    CHECK(kvl_inxfer_wait(h, 0) == KVL_ERR_CONN_LOST);
    CHECK(strstr(kvl_last_error(), "all paths down") != NULL);
    kvl_inxfer_release(h);
    agent_free(a);
}

static void test_bounds(void)
{
    kvl_agent *a = agent_new();
    /* malformed maps are refused by the decoder */
    uint32_t lf[2] = {1, 0}, ll[2] = {1, 0};
    kvl_msg_announce m = {.xfer = 3, .bytes = 2, .n_chunks = 2, .n_layers = 2};
    kvl_buf b = {0};
    kvl_enc_announce(&b, &m, lf, ll); /* layers going backwards */
    kvl_msg_announce d;
    CHECK(kvl_dec_announce(b.p, b.len, &d) == KVL_ERR_PROTOCOL);
    kvl_buf_free(&b);
    lf[0] = 0;
    ll[0] = 5; /* beyond n_layers */
    kvl_enc_announce(&b, &m, lf, ll);
    CHECK(kvl_dec_announce(b.p, b.len, &d) == KVL_ERR_PROTOCOL);
    kvl_buf_free(&b);
    m.n_chunks = KVL_MAX_XFER_CHUNKS + 1; /* more chunks than a transfer may have */
    kvl_buf_free(&b);
    b = (kvl_buf){0};
    uint8_t hdr[32] = {0};
    memcpy(hdr, &m.xfer, 8);
    CHECK(kvl_dec_announce(hdr, sizeof hdr, &d) == KVL_ERR_PROTOCOL);
    /* every chunk spanning every layer would make per-layer work quadratic:
     * a chunk must start where the one before it ended, or later */
    uint32_t wf[3] = {0, 0, 0}, wl[3] = {5, 5, 5};
    kvl_msg_announce w = {.xfer = 4, .bytes = 3, .n_chunks = 3, .n_layers = 6};
    kvl_enc_announce(&b, &w, wf, wl);
    CHECK(kvl_dec_announce(b.p, b.len, &d) == KVL_ERR_PROTOCOL);
    kvl_buf_free(&b);
    wf[1] = 5;
    wl[1] = 5;
    wf[2] = 5; /* [0,5], [5,5], [5,5]: layer 5 split over three chunks is fine */
    kvl_enc_announce(&b, &w, wf, wl);
    CHECK(kvl_dec_announce(b.p, b.len, &d) == KVL_OK);
    kvl_buf_free(&b);
    agent_free(a);
}

/* Announces from sender `sender` a push of n chunks over n layers (ids and
 * tags as announce()); maps of any size. */
static kvl_err announce_timed(kvl_agent *a, uint64_t sender, uint64_t xfer, uint32_t n,
                              const char *tag, uint32_t timeout_ms);

static kvl_err announce_from(kvl_agent *a, uint64_t sender, uint64_t xfer, uint32_t n,
                             const char *tag)
{
    return announce_timed(a, sender, xfer, n, tag, 0);
}

static kvl_err announce_timed(kvl_agent *a, uint64_t sender, uint64_t xfer, uint32_t n,
                              const char *tag, uint32_t timeout_ms)
{
    uint32_t *lf = calloc(n, sizeof *lf), *ll = calloc(n, sizeof *ll);
    for (uint32_t i = 0; i < n; i++)
        lf[i] = ll[i] = i;
    kvl_msg_announce m = {.xfer = xfer, .bytes = n, .n_chunks = n, .n_layers = n,
                          .timeout_ms = timeout_ms, .tag_len = (uint32_t)strlen(tag),
                          .tag = (const uint8_t *)tag};
    kvl_buf b = {0};
    kvl_enc_announce(&b, &m, lf, ll);
    kvl_msg_announce d;
    kvl_err e = kvl_dec_announce(b.p, b.len, &d);
    if (!e)
        e = kvl_rx_announce(a, sender, "sender", &d);
    kvl_buf_free(&b);
    free(lf);
    free(ll);
    return e;
}

/* Releases every handle still queued, then the agent. */
static void drain_and_free(kvl_agent *a)
{
    kvl_inxfer *h;
    while (kvl_inbound_next(a, NULL, 0, 1, 0, &h) == KVL_OK)
        kvl_inxfer_release(h);
    agent_free(a);
}

static kvl_rx_xfer *entry(kvl_agent *a, uint64_t sender, uint64_t xfer)
{
    kvl_share *s = kvl_share_find(a, sender);
    for (kvl_rx_xfer *r = s ? s->lru_head : NULL; r; r = r->next)
        if (r->xfer == xfer)
            return r;
    return NULL;
}

static void age_all(kvl_share *s, uint64_t ns)
{
    for (kvl_rx_xfer *r = s->lru_head; r; r = r->next)
        r->t_progress_ns -= ns;
}

/* One sender's quota: beyond KVL_SHARE_LIVE pushes it is refused with a
 * reason its DATA gets; its own pushes idle (no newly verified chunk, not
 * "no frame") for a second make way; one with a copy placing never. */
static void test_sender_quota(void)
{
    kvl_agent *a = agent_new();
    for (uint64_t x = 1; x <= KVL_SHARE_LIVE; x++)
        CHECK(announce_from(a, 7, x, 1, "") == KVL_OK);
    CHECK(announce_from(a, 7, 9999, 1, "") == KVL_ERR_BUSY);
    CHECK(strstr(kvl_last_error(), "inbound share (2048 pushes) is in use") != NULL);
    kvl_rx_xfer *r = NULL;
    uint32_t st = 0;
    CHECK(!kvl_rx_claim(a, 7, 9999, 0, 1, &r, &st) && st == KVL_ERR_BUSY);
    char why[256];
    kvl_rx_refusal(a, 7, why, sizeof why);
    CHECK(strstr(why, "2048 pushes") != NULL);
    /* another sender is not affected by 7's quota */
    CHECK(announce_from(a, 8, 1, 1, "") == KVL_OK);
    /* a claim and an unverified copy are no progress: 7's pushes stay idle */
    kvl_share *s = kvl_share_find(a, 7);
    age_all(s, 2000000000ull);
    kvl_rx_xfer *busy = NULL;
    CHECK(kvl_rx_claim(a, 7, 1, 0, 1, &busy, &st) && busy); /* the oldest, being placed */
    kvl_rx_xfer *two = NULL;
    CHECK(kvl_rx_claim(a, 7, 2, 0, 1, &two, &st) && two);
    kvl_rx_done(two, 0, 1, 0, 0, 1); /* failed crc: not progress */
    CHECK(announce_from(a, 7, 10000, 1, "") == KVL_OK);
    CHECK(entry(a, 7, 1) == busy && !entry(a, 7, 2)); /* the oldest idle one without a copy */
    CHECK(s->live == KVL_SHARE_LIVE);
    kvl_rx_done(busy, 0, 1, 1, 0, 1);
    drain_and_free(a);
}

/* Four senders at their chunk quota fill the agent's room; a fifth still
 * gets in, taking room from one of the heaviest (its push fails BUSY), and
 * a sender within its part is never the one evicted, however idle. */
static void test_room_taken_from_heaviest(void)
{
    kvl_agent *a = agent_new();
    CHECK(announce_from(a, 50, 1, 16, "small") == KVL_OK); /* within any share */
    kvl_share *small = kvl_share_find(a, 50);
    age_all(small, 10000000000ull);
    for (uint64_t s = 1; s <= 3; s++)
        CHECK(announce_from(a, s, 1, KVL_SHARE_CHUNKS, "") == KVL_OK);
    CHECK(announce_from(a, 4, 1, KVL_SHARE_CHUNKS - 16, "") == KVL_OK);
    CHECK(a->shares.chunks == KVL_ROOM_CHUNKS);
    CHECK(announce_from(a, 5, 1, 8, "newcomer") == KVL_OK);
    CHECK(entry(a, 50, 1) != NULL);
    int gone = 0;
    for (uint64_t s = 1; s <= 3; s++)
        gone += entry(a, s, 1) == NULL;
    CHECK(gone == 1 && a->shares.chunks <= KVL_ROOM_CHUNKS);
    /* the evicted push's handle says why */
    kvl_inxfer *h;
    int busy = 0;
    while (kvl_inbound_next(a, NULL, 0, 1, 0, &h) == KVL_OK) {
        busy += kvl_inxfer_wait(h, 0) == KVL_ERR_BUSY;
        kvl_inxfer_release(h);
    }
    CHECK(busy == 1);
    agent_free(a);
}

/* Handles nobody takes: one sender's flood keeps at most KVL_SHARE_QUEUED
 * of them queued and cannot push another sender's handle out. */
static void test_queue_share(void)
{
    kvl_agent *a = agent_new();
    CHECK(announce_from(a, 2, 1, 1, "mine") == KVL_OK);
    for (uint64_t x = 1; x <= 2 * KVL_ROOM_QUEUED; x++) {
        uint64_t sender = 10 + x % 8; /* eight floods */
        CHECK(announce_from(a, sender, x, 1, "flood") == KVL_OK);
        kvl_msg_status end = {.xfer = x};
        kvl_rx_end(a, sender, &end); /* ended: the flood stays within its live quota */
    }
    CHECK(a->shares.queued <= KVL_ROOM_QUEUED);
    for (kvl_share *s = a->shares.all; s; s = s->next)
        CHECK(s->queued <= KVL_SHARE_QUEUED);
    kvl_inxfer *h = NULL;
    CHECK(kvl_inbound_next(a, "mine", 4, 0, 0, &h) == KVL_OK && h);
    kvl_inxfer_release(h);
    while (kvl_inbound_next(a, NULL, 0, 1, 0, &h) == KVL_OK)
        kvl_inxfer_release(h);
    CHECK(a->shares.queued == 0);
    agent_free(a);
}

/* A sender whose END never comes: at its announced deadline (+2 s) the
 * handle fails and the push becomes a tombstone, so no late copy lands in
 * memory the application was just told it may reuse. */
static void test_deadline_without_end(void)
{
    kvl_agent *a = agent_new();
    uint32_t lf[1] = {0}, ll[1] = {0};
    kvl_msg_announce m = {.xfer = 5, .bytes = 10, .n_chunks = 1, .n_layers = 1, .timeout_ms = 1};
    kvl_buf b = {0};
    kvl_enc_announce(&b, &m, lf, ll);
    kvl_msg_announce d;
    CHECK(kvl_dec_announce(b.p, b.len, &d) == KVL_OK);
    CHECK(kvl_rx_announce(a, 7, "sender", &d) == KVL_OK);
    kvl_buf_free(&b);
    kvl_inxfer *h = NULL;
    CHECK(kvl_inbound_next(a, NULL, 0, 1, 0, &h) == KVL_OK);
    kvl_rx_xfer *r = NULL;
    uint32_t st = 0;
    revoked = revoked_after_failure = 0;
    kvl_rx_expire(a, kvl_now_ns() + 3000000000ull);
    CHECK(revoked == 1 && revoked_after_failure == 0);
    CHECK(kvl_inxfer_wait(h, 0) == KVL_ERR_DEADLINE);
    CHECK(!kvl_rx_claim(a, 7, 5, 0, 1, &r, &st) && st == KVL_RX_SUPERSEDED);
    CHECK(a->shares.chunks == 0);
    kvl_inxfer_release(h);
    agent_free(a);
}

/* A full table: every entry is found (by its hash bucket), through
 * announce, claim, END and expiry; the expired ones are gone for good. */
static void test_full_table_lookup(void)
{
    kvl_agent *a = agent_new();
    a->rx_seed = 0x1234;
    enum { N = KVL_ROOM_ENTRIES };
#define SENDER(x) (1 + (x) % (KVL_ROOM_ENTRIES / KVL_SHARE_LIVE))
    for (uint64_t x = 1; x <= N; x++)
        CHECK(announce_from(a, SENDER(x), x * 977, 1, "") == KVL_OK);
    CHECK(a->shares.entries == N);
    int owned = 0, found_ended = 0, gone = 0;
    for (uint64_t x = 1; x <= N; x++) {
        kvl_rx_xfer *r = NULL;
        uint32_t st = 0;
        if (kvl_rx_claim(a, SENDER(x), x * 977, 0, 1, &r, &st) && r->xfer == x * 977) {
            kvl_rx_done(r, 0, 1, 1, 0, 1000);
            owned++;
        }
        kvl_msg_status end = {.xfer = x * 977};
        kvl_rx_end(a, SENDER(x), &end);
    }
    CHECK(owned == N);
    for (uint64_t x = 1; x <= N; x++) {
        kvl_rx_xfer *r = NULL;
        uint32_t st = 0;
        found_ended += !kvl_rx_claim(a, SENDER(x), x * 977, 0, 2, &r, &st) && st == KVL_RX_SUPERSEDED;
    }
    CHECK(found_ended == N);
    kvl_rx_expire(a, kvl_now_ns() + 400ull * 1000000000ull);
    CHECK(a->shares.entries == 0);
    for (uint64_t x = 1; x <= N; x++) {
        kvl_rx_xfer *r = NULL;
        uint32_t st = 0;
        gone += !kvl_rx_claim(a, SENDER(x), x * 977, 0, 3, &r, &st) && st == KVL_ERR_PROTOCOL;
    }
    CHECK(gone == N);
#undef SENDER
    kvl_inxfer *h;
    while (kvl_inbound_next(a, NULL, 0, 1, 0, &h) == KVL_OK)
        kvl_inxfer_release(h);
    kvl_share_sweep(a, kvl_now_ns());
    CHECK(a->shares.n == 0); /* nothing held: no share left */
    agent_free(a);
}

/* Notification de-duplication per sender: O(1) lookups in a ring that
 * starts small, doubles while it fills and then forgets the oldest. */
static void test_seen_set(void)
{
    kvl_agent *a = agent_new();
    kvl_share *s = kvl_share_get(a, 42);
    CHECK(s && !kvl_share_seen(s, 1, 1, 0) && !s->seen); /* a peek records nothing */
    CHECK(!kvl_share_seen(s, 1, 1, 1) && s->seen->cap == KVL_SHARE_SEEN_MIN);
    CHECK(kvl_share_seen(s, 1, 1, 1));
    for (uint64_t x = 2; x <= 3000; x++)
        CHECK(!kvl_share_seen(s, x * 7919, 1, 1));
    CHECK(s->seen->cap == KVL_SHARE_SEEN && s->seen->n == KVL_SHARE_SEEN);
    int kept = 0, forgotten = 0;
    for (uint64_t x = 2; x <= 3000; x++) {
        int seen = kvl_share_seen(s, x * 7919, 1, 0);
        kept += x > 3000 - KVL_SHARE_SEEN && seen;
        forgotten += x <= 3000 - KVL_SHARE_SEEN && !seen;
    }
    CHECK(kept == KVL_SHARE_SEEN && forgotten == 3000 - KVL_SHARE_SEEN - 1);
    CHECK(kvl_share_find(a, 42) == s && !kvl_share_find(a, 43));
    /* a share that holds nothing goes once its memory of notifications expires */
    kvl_share_sweep(a, 2);
    CHECK(kvl_share_find(a, 42) == s);
    kvl_share_sweep(a, 61ull * 1000000000ull);
    CHECK(!kvl_share_find(a, 42) && a->shares.n == 0);
    agent_free(a);
}

/* Deadlines in announce order other than their own: the soonest expires
 * first (the heap was once ordered by announce, the newest on top). */
static void test_deadline_heap_order(void)
{
    kvl_agent *a = agent_new();
    CHECK(announce_timed(a, 7, 1, 1, "soon", 1) == KVL_OK);
    CHECK(announce_timed(a, 7, 2, 1, "late", 3600000) == KVL_OK);
    CHECK(announce_timed(a, 7, 3, 1, "mid", 60000) == KVL_OK);
    kvl_inxfer *soon = NULL, *late = NULL, *mid = NULL;
    CHECK(kvl_inbound_next(a, "soon", 4, 0, 0, &soon) == KVL_OK);
    CHECK(kvl_inbound_next(a, "late", 4, 0, 0, &late) == KVL_OK);
    CHECK(kvl_inbound_next(a, "mid", 3, 0, 0, &mid) == KVL_OK);
    kvl_rx_expire(a, kvl_now_ns() + 10ull * 1000000000ull);
    CHECK(kvl_inxfer_wait(soon, 0) == KVL_ERR_DEADLINE);
    CHECK(kvl_inxfer_wait(mid, 0) == KVL_ERR_TIMEOUT && kvl_inxfer_wait(late, 0) == KVL_ERR_TIMEOUT);
    kvl_rx_expire(a, kvl_now_ns() + 70ull * 1000000000ull);
    CHECK(kvl_inxfer_wait(mid, 0) == KVL_ERR_DEADLINE && kvl_inxfer_wait(late, 0) == KVL_ERR_TIMEOUT);
    kvl_inxfer_release(soon);
    kvl_inxfer_release(late);
    kvl_inxfer_release(mid);
    agent_free(a);
}

/* A tombstone a copy still places into is dropped (over the sender's
 * tombstone quota): it waits for that copy's end, then goes (ASan: no use
 * after free), and the copy settles nothing. */
static void test_dropped_tombstone_outlives_its_copy(void)
{
    kvl_agent *a = agent_new();
    CHECK(announce_from(a, 7, 1, 1, "") == KVL_OK);
    kvl_rx_xfer *r = NULL;
    uint32_t st = 0;
    CHECK(kvl_rx_claim(a, 7, 1, 0, 1, &r, &st) && r);
    kvl_msg_status end = {.xfer = 1};
    kvl_rx_end(a, 7, &end);
    for (uint64_t x = 2; x <= KVL_SHARE_TOMBS + 1; x++) {
        kvl_msg_status e2 = {.xfer = x};
        kvl_rx_end(a, 7, &e2);
    }
    CHECK(kvl_share_find(a, 7)->tombs == KVL_SHARE_TOMBS);
    kvl_rx_xfer *again = NULL;
    CHECK(!kvl_rx_claim(a, 7, 1, 0, 2, &again, &st) && st == KVL_ERR_PROTOCOL); /* gone */
    CHECK(!kvl_rx_owns(r, 0, 1));
    kvl_rx_done(r, 0, 1, 1, 0, 1); /* frees it */
    drain_and_free(a);
}

/* Room that eviction cannot make is not made: a push larger than what the
 * other senders hold beyond their parts is refused, and nobody is evicted
 * for it. */
static void test_no_eviction_in_vain(void)
{
    kvl_agent *a = agent_new();
    for (uint64_t s = 1; s <= 4; s++)
        for (uint64_t x = 1; x <= 64; x++)
            CHECK(announce_from(a, s, x, 1024, "") == KVL_OK);
    CHECK(a->shares.chunks == KVL_ROOM_CHUNKS);
    uint64_t evicted = a->shares.evicted;
    CHECK(announce_from(a, 5, 1, KVL_MAX_XFER_CHUNKS, "") == KVL_ERR_BUSY);
    CHECK(a->shares.evicted == evicted && a->shares.chunks == KVL_ROOM_CHUNKS);
    CHECK(strstr(kvl_last_error(), "out of room") != NULL);
    /* one that eviction can make room for gets in */
    CHECK(announce_from(a, 5, 2, 4096, "") == KVL_OK);
    CHECK(a->shares.evicted == evicted + 4);
    drain_and_free(a);
}

/* A full share table: the least recently used share that holds only
 * memory makes way for a new session; when every share looked at holds
 * pushes, a new session's DATA is answered BUSY with the reason. */
static void test_share_table_full(void)
{
    kvl_agent *a = agent_new();
    for (uint64_t x = 1; x <= KVL_SHARE_MAX; x++)
        kvl_share_seen(kvl_share_get(a, 1000 + x), 1, 1, 1); /* memory only */
    CHECK(a->shares.n == KVL_SHARE_MAX);
    CHECK(kvl_share_get(a, 1) != NULL && a->shares.n == KVL_SHARE_MAX);
    CHECK(!kvl_share_find(a, 1001)); /* the least recently used went */
    /* a session that ends for good forgets what it remembered */
    kvl_share *s = kvl_share_find(a, 1002);
    kvl_rx_forget_sender(a, 1002);
    CHECK(!s->seen && !s->n_refused);
    kvl_share_free_all(a);
    /* every share holds a tombstone: nobody makes way */
    for (uint64_t x = 1; x <= KVL_SHARE_MAX; x++) {
        kvl_msg_status end = {.xfer = 1};
        kvl_rx_end(a, 5000 + x, &end);
    }
    CHECK(a->shares.n == KVL_SHARE_MAX);
    CHECK(announce_from(a, 2, 1, 1, "") == KVL_ERR_BUSY);
    kvl_rx_xfer *r = NULL;
    uint32_t st = 0;
    char why[256];
    CHECK(!kvl_rx_claim(a, 2, 1, 0, 1, &r, &st) && st == KVL_ERR_BUSY);
    kvl_rx_refusal(a, 2, why, sizeof why);
    CHECK(strstr(why, "8192 sender sessions") != NULL);
    CHECK(a->shares.full_refused >= 1);
    drain_and_free(a);
}

/* Senders over their part cannot pin the room by keeping a copy in flight:
 * the newcomer still gets in, the evicted push's copies are revoked before
 * its handle fails, and its memory waits for that copy's end. */
static void test_room_pinned_by_copies(void)
{
    kvl_agent *a = agent_new();
    kvl_rx_xfer *held[4];
    uint32_t st = 0;
    for (uint64_t s = 1; s <= 4; s++) {
        CHECK(announce_from(a, s, 1, KVL_MAX_XFER_CHUNKS, "") == KVL_OK);
        CHECK(kvl_rx_claim(a, s, 1, 0, 1, &held[s - 1], &st));
    }
    revoked = revoked_after_failure = 0;
    CHECK(announce_from(a, 5, 1, 8, "") == KVL_OK);
    CHECK(revoked == 1 && revoked_after_failure == 0);
    int orphans = 0;
    for (int i = 0; i < 4; i++)
        orphans += held[i]->orphan;
    CHECK(orphans == 1);
    for (int i = 0; i < 4; i++) /* the copies end; the orphan is freed (ASan) */
        kvl_rx_done(held[i], 0, 1, 1, 0, 1);
    drain_and_free(a);
}

int main(void)
{
    double t0 = test_now_s();
    test_ownership();
    test_end_before_done_fails_the_handle();
    test_bounds();
    test_deadline_without_end();
    test_full_table_lookup();
    test_sender_quota();
    test_room_taken_from_heaviest();
    test_queue_share();
    test_seen_set();
    test_deadline_heap_order();
    test_dropped_tombstone_outlives_its_copy();
    test_no_eviction_in_vain();
    test_share_table_full();
    test_room_pinned_by_copies();
    return test_report("test_inbound", t0);
}
