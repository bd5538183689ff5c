/* test_progress.c: the progress both transfer handles embed (csrc/progress.c):
 * waits with deadlines, layers finishing out of order, chunk events in
 * verification order, and an outcome that wakes every waiter.  The writer
 * runs on its own thread as the engine does (make tsan runs this too). */
#include <pthread.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"
#include "test_main.h"

#define LONG_MS 10000 /* a wait that must be woken, not time out: a hang guard */

static kvl_err t_timeout(const kvl_progress *p, int what, uint32_t layer, uint32_t timeout_ms)
{
    return kvl_fail(KVL_ERR_TIMEOUT, "%s: wait %d layer %u after %u ms", (const char *)p->owner,
                    what, layer, timeout_ms);
}

static kvl_err t_failed(const kvl_progress *p)
{
    return kvl_fail((kvl_err)p->err, "%s: %s", (const char *)p->owner, kvl_progress_why(p));
}

static kvl_err t_no_layer(const kvl_progress *p, uint32_t layer)
{
    return kvl_fail(KVL_ERR_INVALID_ARG, "%s: no layer %u", (const char *)p->owner, layer);
}

static const kvl_progress_msgs msgs = {t_timeout, t_failed, t_no_layer};

/* n chunks of 100 bytes over layers lf[i]..ll[i]; absent: a layer to mark
 * ABSENT (the sender's way), or UINT32_MAX. */
static void make(kvl_progress *p, int deferred, uint32_t n, uint32_t layers, const uint32_t *lf,
                 const uint32_t *ll, uint32_t absent)
{
    kvl_progress_init(p, &msgs, "t", deferred);
    CHECK(kvl_progress_alloc(p, n, layers, 100ull * n) == KVL_OK);
    for (uint32_t i = 0; i < n; i++) {
        p->chunk_lf[i] = lf[i];
        p->chunk_ll[i] = ll[i];
    }
    if (absent != UINT32_MAX)
        p->layer_done[absent] = KVL_LAYER_ABSENT;
    kvl_progress_start(p);
}

static void test_deadlines(void)
{
    kvl_progress p;
    uint32_t lf[2] = {0, 1}, ll[2] = {0, 1};
    make(&p, 0, 2, 2, lf, ll, UINT32_MAX);
    kvl_chunk_event ev;
    CHECK(kvl_progress_wait(&p, 0) == KVL_ERR_TIMEOUT);
    CHECK(strstr(kvl_last_error(), "t: wait 0 layer 0 after 0 ms") != NULL);
    CHECK(kvl_progress_next_event(&p, 0, &ev) == KVL_ERR_TIMEOUT);
    CHECK(strstr(kvl_last_error(), "wait 2") != NULL);
    /* a deadline is never cut short: the clock is monotonic */
    for (uint32_t ms = 1; ms <= 64; ms *= 4) {
        double t0 = test_now_s();
        CHECK(kvl_progress_wait_layer(&p, 1, ms) == KVL_ERR_TIMEOUT);
        CHECKF(test_now_s() - t0 >= ms / 1000.0, "returned %.4f s into a %u ms wait",
               test_now_s() - t0, ms);
    }
    CHECK(strstr(kvl_last_error(), "wait 1 layer 1 after 64 ms") != NULL);
    CHECK(!kvl_progress_finished(&p));
    kvl_progress_chunk_done(&p, 0, 3, 100, 11);
    kvl_progress_chunk_done(&p, 1, 4, 100, 12);
    CHECK(kvl_progress_wait(&p, 0) == KVL_OK);
    CHECK(kvl_progress_finished(&p));
    kvl_progress_snap s;
    char msg[16] = "x";
    kvl_progress_get(&p, &s, msg, sizeof msg);
    CHECK(s.state == KVL_XFER_DONE && s.bytes_done == 200 && s.chunks_done == 2 &&
          s.layers_ready == 2 && s.t_first_byte_ns == 11 && s.t_first_layer_ns == 11 &&
          s.t_done_ns == 12 && msg[0] == 0);
    kvl_progress_destroy(&p);
}

static void test_layers_out_of_order(void)
{
    /* chunk 0: layer 0; chunk 1: layers 0..2; chunk 2: layer 2; chunk 3: layer 4
     * (layer 3 absent, the sender's way: wait_layer(3) is the caller's mistake) */
    kvl_progress p;
    uint32_t lf[4] = {0, 0, 2, 4}, ll[4] = {0, 2, 2, 4};
    make(&p, 0, 4, 5, lf, ll, 3);
    CHECK(kvl_progress_wait_layer(&p, 3, LONG_MS) == KVL_ERR_INVALID_ARG);
    CHECK(strstr(kvl_last_error(), "no layer 3") != NULL);
    CHECK(kvl_progress_wait_layer(&p, 5, LONG_MS) == KVL_ERR_INVALID_ARG);
    CHECK(!kvl_progress_layer_done(&p, 3) && !kvl_progress_layer_done(&p, 99));
    kvl_chunk_event ev;
    kvl_progress_chunk_done(&p, 3, 0, 100, 1); /* the last layer first */
    CHECK(kvl_progress_wait_layer(&p, 4, 0) == KVL_OK);
    CHECK(kvl_progress_layer_done(&p, 4) && !kvl_progress_layer_done(&p, 0));
    CHECK(kvl_progress_wait_layer(&p, 0, 0) == KVL_ERR_TIMEOUT);
    CHECK(kvl_progress_next_event(&p, 0, &ev) == KVL_OK && ev.chunk == 3 &&
          ev.layer_first == 4 && ev.layer_count == 1);
    kvl_progress_chunk_done(&p, 1, 0, 100, 2); /* layer 1 closes, 0 and 2 wait for others */
    CHECK(kvl_progress_next_event(&p, 0, &ev) == KVL_OK && ev.chunk == 1 &&
          ev.layer_first == 1 && ev.layer_count == 1);
    CHECK(kvl_progress_layer_done(&p, 1) && kvl_progress_wait_layer(&p, 2, 0) == KVL_ERR_TIMEOUT);
    kvl_progress_snap s;
    kvl_progress_get(&p, &s, NULL, 0);
    CHECK(s.layers_ready == 0 && s.t_first_layer_ns == 0);
    kvl_progress_chunk_done(&p, 0, 0, 100, 3);
    kvl_progress_get(&p, &s, NULL, 0);
    CHECK(s.layers_ready == 2 && s.t_first_layer_ns == 3 && s.state == KVL_XFER_RUNNING);
    kvl_progress_chunk_done(&p, 2, 0, 100, 4);
    kvl_progress_get(&p, &s, NULL, 0);
    CHECK(s.layers_ready == 5 && s.state == KVL_XFER_DONE); /* the absent layer counts */
    CHECK(kvl_progress_next_event(&p, 0, &ev) == KVL_OK && ev.chunk == 0 &&
          ev.layer_first == 0 && ev.layer_count == 1);
    CHECK(kvl_progress_next_event(&p, 0, &ev) == KVL_OK && ev.chunk == 2 &&
          ev.layer_first == 2 && ev.layer_count == 1);
    CHECK(kvl_progress_next_event(&p, 0, &ev) == KVL_ERR_END);
    kvl_progress_destroy(&p);

    /* the receiver's way: every layer in a chunk's range counts, one no chunk
     * covers is done from the start; a chunk that closes layers around an
     * open one reports the range between them */
    uint32_t rf[3] = {0, 1, 4}, rl[3] = {3, 1, 4};
    make(&p, 0, 3, 6, rf, rl, UINT32_MAX);
    CHECK(kvl_progress_layer_done(&p, 5) && !kvl_progress_layer_done(&p, 2));
    kvl_progress_chunk_done(&p, 0, 0, 100, 1);
    CHECK(kvl_progress_next_event(&p, 0, &ev) == KVL_OK && ev.layer_first == 0 &&
          ev.layer_count == 4);
    CHECK(!kvl_progress_layer_done(&p, 1) && kvl_progress_layer_done(&p, 2));
    kvl_progress_get(&p, &s, NULL, 0);
    CHECK(s.layers_ready == 1);
    kvl_progress_destroy(&p);
}

/* ---- threads ---- */

#define N_CHUNKS 512

typedef struct writer_arg {
    kvl_progress *p;
    uint32_t order[N_CHUNKS];
    uint32_t n;            /* chunks to verify before failing (N_CHUNKS: none fails) */
    int *waiting, waiters; /* the failure waits for this many waiters to start */
} writer_arg;

static void *writer(void *arg)
{
    writer_arg *w = arg;
    for (uint32_t i = 0; i < w->n; i++) {
        kvl_progress_chunk_done(w->p, w->order[i], i % 7, 100, 1000 + i);
        if (i % 64 == 0)
            sched_yield();
    }
    if (w->n == N_CHUNKS)
        return NULL;
    /* fail while they sleep: a failure that woke nobody would show as waits
     * that ran their whole time */
    while (__atomic_load_n(w->waiting, __ATOMIC_ACQUIRE) < w->waiters)
        sched_yield();
    usleep(50 * 1000);
    kvl_progress_fail(w->p, KVL_ERR_CONN_LOST, "lost after %u chunks", w->n);
    return NULL;
}

static void test_events_in_order(void)
{
    static writer_arg w;
    uint32_t lf[N_CHUNKS], ll[N_CHUNKS];
    for (uint32_t i = 0; i < N_CHUNKS; i++) {
        lf[i] = ll[i] = i / 4;
        w.order[i] = i;
    }
    test_rng rng = {42};
    for (uint32_t i = N_CHUNKS - 1; i > 0; i--) { /* verified in a random order */
        uint32_t j = (uint32_t)rng_range(&rng, 0, i), t = w.order[i];
        w.order[i] = w.order[j];
        w.order[j] = t;
    }
    kvl_progress p;
    make(&p, 0, N_CHUNKS, N_CHUNKS / 4, lf, ll, UINT32_MAX);
    w.p = &p;
    w.n = N_CHUNKS;
    pthread_t th;
    pthread_create(&th, NULL, writer, &w);
    kvl_chunk_event ev;
    uint32_t got = 0, in_order = 1, layers = 0;
    kvl_err e;
    while ((e = kvl_progress_next_event(&p, LONG_MS, &ev)) == KVL_OK) {
        in_order &= got < N_CHUNKS && ev.chunk == w.order[got] && ev.path == got % 7 &&
                    ev.t_ns == 1000 + got;
        layers += ev.layer_count;
        got++;
    }
    pthread_join(th, NULL);
    CHECK(e == KVL_ERR_END);
    CHECK_EQ_U64(got, N_CHUNKS);
    CHECK(in_order);
    CHECK_EQ_U64(layers, N_CHUNKS / 4); /* each layer reported closed once */
    CHECK(kvl_progress_wait(&p, 0) == KVL_OK);
    kvl_progress_destroy(&p);
}

typedef struct waiter_arg {
    kvl_progress *p;
    int what;
    uint32_t layer;
    int *waiting;
    kvl_err e;
    uint32_t events;       /* KVL_WAIT_EVENT: taken before the failure */
    double waited_s;
    int returned;          /* atomic */
} waiter_arg;

static void *waiter(void *arg)
{
    waiter_arg *w = arg;
    kvl_chunk_event ev;
    double t0 = test_now_s();
    __atomic_add_fetch(w->waiting, 1, __ATOMIC_RELEASE);
    if (w->what == KVL_WAIT_DONE)
        w->e = kvl_progress_wait(w->p, LONG_MS);
    else if (w->what == KVL_WAIT_LAYER)
        w->e = kvl_progress_wait_layer(w->p, w->layer, LONG_MS);
    else
        while ((w->e = kvl_progress_next_event(w->p, LONG_MS, &ev)) == KVL_OK)
            w->events++;
    if (w->e == KVL_ERR_CONN_LOST && !strstr(kvl_last_error(), "t: lost after"))
        w->e = KVL_ERR_PROTOCOL; /* the failure's own text, in this thread */
    w->waited_s = test_now_s() - t0;
    __atomic_store_n(&w->returned, 1, __ATOMIC_RELEASE);
    return NULL;
}

/* A failure wakes every waiter with it, whatever it waits for; a layer
 * verified before the failure stays good.  deferred: only once published. */
static void test_failure_wakes_all(int deferred)
{
    enum { N_WAITERS = 9 };
    uint32_t lf[N_CHUNKS], ll[N_CHUNKS];
    for (uint32_t i = 0; i < N_CHUNKS; i++)
        lf[i] = ll[i] = i / 4;
    kvl_progress p;
    make(&p, deferred, N_CHUNKS, N_CHUNKS / 4, lf, ll, UINT32_MAX);
    static writer_arg w;
    for (uint32_t i = 0; i < N_CHUNKS; i++)
        w.order[i] = i;
    w.p = &p;
    w.n = 8; /* layers 0 and 1, then the failure; the layer waiters wait on 2, 5, 8 */
    int waiting = 0;
    w.waiting = &waiting;
    w.waiters = N_WAITERS;
    waiter_arg wa[N_WAITERS];
    pthread_t th[N_WAITERS], wt;
    for (int i = 0; i < N_WAITERS; i++) {
        wa[i] = (waiter_arg){.p = &p, .what = i % 3, .layer = (uint32_t)i + 1,
                             .waiting = &waiting};
        pthread_create(&th[i], NULL, waiter, &wa[i]);
    }
    pthread_create(&wt, NULL, writer, &w);
    pthread_join(wt, NULL);
    if (deferred) { /* decided, not visible: "done" waits for the regions' release */
        CHECK(kvl_progress_wait(&p, 0) == KVL_ERR_TIMEOUT);
        usleep(50 * 1000); /* nor does it wake anyone for good */
        for (int i = 0; i < N_WAITERS; i++)
            CHECK(!__atomic_load_n(&wa[i].returned, __ATOMIC_ACQUIRE));
        CHECK(!kvl_progress_finished(&p));
        kvl_progress_publish(&p);
    }
    for (int i = 0; i < N_WAITERS; i++) {
        pthread_join(th[i], NULL);
        CHECKF(wa[i].e == KVL_ERR_CONN_LOST, "waiter %d (wait %d) got %d", i, wa[i].what,
               wa[i].e);
        /* woken, not run out (a missed wake-up still ends in the failure) */
        CHECKF(wa[i].waited_s < LONG_MS / 2000.0, "waiter %d (wait %d) slept %.1f s", i,
               wa[i].what, wa[i].waited_s);
    }
    uint32_t events = 0;
    for (int i = 0; i < N_WAITERS; i++)
        events += wa[i].events;
    CHECK_EQ_U64(events, 8); /* each event taken once, across the takers */
    CHECK(kvl_progress_wait_layer(&p, 1, 0) == KVL_OK); /* verified before the failure */
    CHECK(kvl_progress_wait_layer(&p, 2, 0) == KVL_ERR_CONN_LOST);
    /* the first outcome wins */
    kvl_progress_fail(&p, KVL_ERR_CLOSED, "second");
    char msg[64];
    kvl_progress_snap s;
    kvl_progress_get(&p, &s, msg, sizeof msg);
    CHECK(s.state == KVL_XFER_FAILED && s.err == KVL_ERR_CONN_LOST && s.chunks_done == 8 &&
          !strcmp(msg, "lost after 8 chunks"));
    /* shrunk (a failed push nobody took): the failure is all it reports */
    kvl_progress_shrink(&p);
    CHECK(!kvl_progress_layer_done(&p, 1));
    CHECK(kvl_progress_wait_layer(&p, 1, LONG_MS) == KVL_ERR_CONN_LOST);
    kvl_chunk_event ev;
    CHECK(kvl_progress_next_event(&p, LONG_MS, &ev) == KVL_ERR_CONN_LOST);
    CHECK(kvl_progress_wait(&p, LONG_MS) == KVL_ERR_CONN_LOST);
    kvl_progress_destroy(&p);
}

int main(void)
{
    double t0 = test_now_s();
    test_deadlines();
    test_layers_out_of_order();
    test_events_in_order();
    test_failure_wakes_all(0);
    test_failure_wakes_all(1);
    return test_report("test_progress", t0);
}
