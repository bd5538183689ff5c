/* test_planner.c: kvl_plan_make's invariants over randomised segment lists.
 *
 * What every plan must satisfy, whatever the sizes: each byte of each segment
 * in exactly one piece; chunks within chunk_bytes, max_pieces and the target;
 * layer-major, stable order; consistent layer bounds.  Plus the sizing rule
 * for a single segment, the argument errors, and concurrent planning (the
 * sort is serialised inside the planner).
 */
#include <pthread.h>
#include <string.h>

#include "internal.h" /* KVL_CHUNKS_PER_PATH */
#include "test_main.h"

#define KiB 1024ull
#define MiB (1024ull * 1024ull)
#define ALIGN 4096ull /* chunk sizes are page multiples unless capped by chunk_bytes */

static uint64_t ceil_div(uint64_t a, uint64_t b) { return a / b + (a % b != 0); }
static uint64_t round_up(uint64_t a, uint64_t m) { return ceil_div(a, m) * m; }
static uint64_t min_u64(uint64_t a, uint64_t b) { return a < b ? a : b; }
static uint64_t max_u64(uint64_t a, uint64_t b) { return a > b ? a : b; }

/* Log-uniform in [lo, hi]: small and large values both get drawn often. */
static uint64_t rng_log(test_rng *r, uint64_t lo, uint64_t hi)
{
    int blo = 63 - __builtin_clzll(lo), bhi = 63 - __builtin_clzll(hi);
    int b = (int)rng_range(r, (uint64_t)blo, (uint64_t)bhi);
    uint64_t a = max_u64(lo, 1ull << b), z = b == 63 ? hi : min_u64(hi, (2ull << b) - 1);
    return rng_range(r, a, z);
}

typedef struct plan_args {
    const kvl_segment *segs;
    size_t n_segs;
    uint32_t n_paths;
    uint64_t chunk_bytes, min_chunk_bytes;
    uint32_t max_pieces;
} plan_args;

static int by_seg_offset(const void *a, const void *b)
{
    const kvl_piece *x = a, *y = b;
    if (x->seg != y->seg)
        return x->seg < y->seg ? -1 : 1;
    return x->seg_offset < y->seg_offset ? -1 : x->seg_offset > y->seg_offset;
}

/* Checks every invariant of plan p made from a; returns failures seen. */
static unsigned long verify_plan(const plan_args *a, const kvl_plan *p)
{
    unsigned long before = __atomic_load_n(&test_failures, __ATOMIC_RELAXED);
    size_t n = a->n_segs;
    uint64_t total = 0;
    uint32_t max_layer = 0;
    for (size_t i = 0; i < n; i++) {
        total += a->segs[i].len;
        max_layer = a->segs[i].layer > max_layer ? a->segs[i].layer : max_layer;
    }
    CHECK_EQ_U64(p->n_layers, (uint64_t)max_layer + 1);
    if (!CHECK(p->chunks && p->pieces && p->order && p->n_chunks && p->n_pieces))
        return 1;

    /* Target: within [min(min_chunk, chunk_bytes), chunk_bytes]; a page
     * multiple unless chunk_bytes capped it; and no larger than what the
     * shrinking rule asks for (several chunks per path, first layer spread
     * over every path), floored at min_chunk. */
    uint64_t floor_ = min_u64(a->min_chunk_bytes, a->chunk_bytes);
    CHECKF(p->chunk_target >= floor_ && p->chunk_target <= a->chunk_bytes,
           "chunk_target %llu outside [%llu, %llu]", (unsigned long long)p->chunk_target,
           (unsigned long long)floor_, (unsigned long long)a->chunk_bytes);
    CHECKF(p->chunk_target % ALIGN == 0 || p->chunk_target == a->chunk_bytes,
           "chunk_target %llu is not a page multiple", (unsigned long long)p->chunk_target);
    uint64_t spread = ceil_div(total, (uint64_t)a->n_paths * KVL_CHUNKS_PER_PATH);
    uint64_t want_max = max_u64(round_up(spread, ALIGN), round_up(floor_, ALIGN));
    CHECKF(p->chunk_target <= want_max, "chunk_target %llu above %llu (total %llu, %u paths)",
           (unsigned long long)p->chunk_target, (unsigned long long)want_max,
           (unsigned long long)total, a->n_paths);
    uint32_t min_layer = UINT32_MAX;
    for (size_t i = 0; i < n; i++)
        min_layer = a->segs[i].layer < min_layer ? a->segs[i].layer : min_layer;
    if (min_layer != max_layer) {
        uint64_t first = 0;
        for (size_t i = 0; i < n; i++)
            first += a->segs[i].layer == min_layer ? a->segs[i].len : 0;
        uint64_t want_first =
            max_u64(round_up(ceil_div(first, a->n_paths), ALIGN), round_up(floor_, ALIGN));
        CHECKF(p->chunk_target <= want_first,
               "chunk_target %llu: first layer (%llu bytes) not spread over %u paths",
               (unsigned long long)p->chunk_target, (unsigned long long)first, a->n_paths);
    }

    /* order: a permutation, layer-major, stable within a layer. */
    uint8_t *seen = calloc(n, 1);
    if (!CHECK(seen))
        return 1;
    for (size_t k = 0; k < n; k++) {
        uint32_t s = p->order[k];
        if (!CHECKF(s < n && !seen[s], "order[%zu] = %u is out of range or repeated", k, s))
            break;
        seen[s] = 1;
        if (k) {
            uint32_t q = p->order[k - 1];
            CHECKF(a->segs[q].layer < a->segs[s].layer ||
                       (a->segs[q].layer == a->segs[s].layer && q < s),
                   "order[%zu..%zu] = %u (layer %u), %u (layer %u): not layer-major/stable",
                   k - 1, k, q, a->segs[q].layer, s, a->segs[s].layer);
        }
    }
    free(seen);

    /* Chunks: consecutive piece ranges, sizes and layer bounds. */
    uint64_t next_piece = 0, sum_bytes = 0;
    for (size_t c = 0; c < p->n_chunks; c++) {
        const kvl_chunk *ch = &p->chunks[c];
        if (!CHECKF(ch->first_piece == next_piece && ch->n_pieces >= 1 &&
                        ch->first_piece + ch->n_pieces <= p->n_pieces,
                    "chunk %zu: pieces [%llu, +%u) after %llu of %zu", c,
                    (unsigned long long)ch->first_piece, ch->n_pieces,
                    (unsigned long long)next_piece, p->n_pieces))
            return 1;
        CHECKF(ch->n_pieces <= a->max_pieces, "chunk %zu: %u pieces > max %u", c, ch->n_pieces,
               a->max_pieces);
        uint64_t bytes = 0;
        uint32_t lo = UINT32_MAX, hi = 0;
        for (uint32_t i = 0; i < ch->n_pieces; i++) {
            const kvl_piece *pc = &p->pieces[ch->first_piece + i];
            if (!CHECKF(pc->seg < n, "piece seg %llu out of range", (unsigned long long)pc->seg))
                return 1;
            bytes += pc->len;
            uint32_t l = a->segs[pc->seg].layer;
            lo = l < lo ? l : lo;
            hi = l > hi ? l : hi;
        }
        CHECKF(ch->bytes == bytes, "chunk %zu: bytes %llu != pieces' sum %llu", c,
               (unsigned long long)ch->bytes, (unsigned long long)bytes);
        CHECKF(ch->bytes <= a->chunk_bytes && ch->bytes <= p->chunk_target,
               "chunk %zu: %llu bytes > target %llu / chunk_bytes %llu", c,
               (unsigned long long)ch->bytes, (unsigned long long)p->chunk_target,
               (unsigned long long)a->chunk_bytes);
        CHECKF(ch->layer_first == lo && ch->layer_last == hi,
               "chunk %zu: layers [%u, %u], pieces span [%u, %u]", c, ch->layer_first,
               ch->layer_last, lo, hi);
        /* Greedy packing: only the last chunk may stop short of both limits. */
        if (c + 1 < p->n_chunks)
            CHECKF(ch->bytes == p->chunk_target || ch->n_pieces == a->max_pieces,
                   "chunk %zu of %zu: %llu bytes, %u pieces: neither full nor at max_pieces",
                   c, p->n_chunks, (unsigned long long)ch->bytes, ch->n_pieces);
        next_piece += ch->n_pieces;
        sum_bytes += ch->bytes;
    }
    CHECK_EQ_U64(next_piece, p->n_pieces);
    CHECK_EQ_U64(sum_bytes, total);

    /* Pieces in plan order: non-empty, layer-major and stable. */
    for (size_t i = 0; i < p->n_pieces; i++) {
        CHECKF(p->pieces[i].len > 0, "piece %zu is empty", i);
        if (i) {
            uint64_t s0 = p->pieces[i - 1].seg, s1 = p->pieces[i].seg;
            uint32_t l0 = a->segs[s0].layer, l1 = a->segs[s1].layer;
            CHECKF(l0 < l1 || (l0 == l1 && s0 <= s1),
                   "pieces %zu,%zu: seg %llu (layer %u) before seg %llu (layer %u)", i - 1, i,
                   (unsigned long long)s0, l0, (unsigned long long)s1, l1);
        }
    }

    /* Coverage: per segment, intervals sorted by offset tile [0, len). */
    kvl_piece *sorted = malloc(p->n_pieces * sizeof *sorted);
    if (!CHECK(sorted))
        return 1;
    memcpy(sorted, p->pieces, p->n_pieces * sizeof *sorted);
    qsort(sorted, p->n_pieces, sizeof *sorted, by_seg_offset);
    size_t i = 0;
    for (uint64_t s = 0; s < n; s++) {
        uint64_t at = 0;
        for (; i < p->n_pieces && sorted[i].seg == s; i++) {
            if (!CHECKF(sorted[i].seg_offset == at,
                        "segment %llu: piece at %llu, expected %llu (gap or overlap)",
                        (unsigned long long)s, (unsigned long long)sorted[i].seg_offset,
                        (unsigned long long)at))
                break;
            at += sorted[i].len;
        }
        while (i < p->n_pieces && sorted[i].seg == s)
            i++;
        CHECKF(at == a->segs[s].len, "segment %llu: covered %llu of %llu bytes",
               (unsigned long long)s, (unsigned long long)at,
               (unsigned long long)a->segs[s].len);
    }
    free(sorted);
    return __atomic_load_n(&test_failures, __ATOMIC_RELAXED) - before;
}

/* A random plan request; segs is allocated and owned by the caller. */
static void random_args(test_rng *r, plan_args *a, kvl_segment **segs_out)
{
    size_t n = (size_t)rng_log(r, 1, 200);
    kvl_segment *segs = calloc(n, sizeof *segs);
    uint32_t layers = (uint32_t)rng_range(r, 0, 40);
    int shape = (int)rng_range(r, 0, 3); /* random order / sorted / one layer / reversed */
    for (size_t i = 0; i < n; i++) {
        segs[i].src_region = rng_range(r, 1, 9);
        segs[i].src_offset = rng_u64(r) >> 20;
        segs[i].dst_region = rng_range(r, 1, 9);
        segs[i].dst_offset = rng_u64(r) >> 20;
        segs[i].len = rng_log(r, 1, 10 * MiB);
        segs[i].layer = shape == 2 ? layers : (uint32_t)rng_range(r, 0, layers);
    }
    if (shape == 1 || shape == 3)
        for (size_t i = 1; i < n; i++) /* insertion sort: n is small */
            for (size_t j = i; j > 0 && (shape == 1 ? segs[j - 1].layer > segs[j].layer
                                                    : segs[j - 1].layer < segs[j].layer);
                 j--) {
                kvl_segment t = segs[j];
                segs[j] = segs[j - 1];
                segs[j - 1] = t;
            }
    a->segs = segs;
    a->n_segs = n;
    a->n_paths = (uint32_t)rng_range(r, 1, 8);
    a->chunk_bytes = rng_log(r, 4 * KiB, 64 * MiB);
    /* Mostly page multiples, sometimes anything (including 0 and 1). */
    a->min_chunk_bytes = rng_range(r, 0, 3) ? round_up(rng_log(r, 1, a->chunk_bytes), ALIGN)
                                            : rng_range(r, 0, a->chunk_bytes);
    a->min_chunk_bytes = min_u64(a->min_chunk_bytes, a->chunk_bytes);
    a->max_pieces = (uint32_t)rng_range(r, 1, 16);
    *segs_out = segs;
}

static kvl_err make(const plan_args *a, kvl_plan *p)
{
    return kvl_plan_make(a->segs, a->n_segs, a->n_paths, a->chunk_bytes, a->min_chunk_bytes,
                         a->max_pieces, p);
}

static void test_random(void)
{
    test_rng r = {0x706c616e6e6572ull};
    unsigned long chunks = 0;
    for (int it = 0; it < 3000; it++) {
        plan_args a;
        kvl_segment *segs;
        random_args(&r, &a, &segs);
        if (!CHECK(segs))
            return;
        kvl_plan p;
        kvl_err e = make(&a, &p);
        if (CHECKF(e == KVL_OK, "iteration %d: %d %s", it, e, kvl_last_error())) {
            if (verify_plan(&a, &p))
                fprintf(stderr, "    in iteration %d: %zu segs, %u paths, chunk %llu, "
                                "min %llu, max_pieces %u\n",
                        it, a.n_segs, a.n_paths, (unsigned long long)a.chunk_bytes,
                        (unsigned long long)a.min_chunk_bytes, a.max_pieces);
            chunks += p.n_chunks;
        }
        kvl_plan_free(&p);
        free(segs);
    }
    printf("random plans: 3000, %lu chunks checked\n", chunks);
}

/* One segment of S bytes: target = clamp(roundup_4KiB(ceil(S / (C*P))),
 * min_chunk, chunk_bytes) when min_chunk is a page multiple, and the chunk
 * count follows from it. */
static void check_single(uint64_t S, uint32_t P, uint64_t chunk_bytes, uint64_t min_chunk)
{
    kvl_segment seg = {.src_region = 1, .dst_region = 2, .len = S, .layer = 3};
    plan_args a = {&seg, 1, P, chunk_bytes, min_chunk, 16};
    kvl_plan p;
    if (!CHECK(make(&a, &p) == KVL_OK))
        return;
    uint64_t want =
        min_u64(chunk_bytes, max_u64(min_chunk, round_up(ceil_div(S, (uint64_t)KVL_CHUNKS_PER_PATH * P), ALIGN)));
    CHECKF(p.chunk_target == want,
           "S=%llu P=%u chunk=%llu min=%llu: target %llu, rule gives %llu",
           (unsigned long long)S, P, (unsigned long long)chunk_bytes,
           (unsigned long long)min_chunk, (unsigned long long)p.chunk_target,
           (unsigned long long)want);
    CHECK_EQ_U64(p.n_chunks, ceil_div(S, p.chunk_target));
    CHECK_EQ_U64(p.n_layers, 4);
    verify_plan(&a, &p);
    kvl_plan_free(&p);
}

static void test_single_segment(void)
{
    /* Exact: S = C*P pages per chunk -> exactly C chunks per path. */
    for (uint32_t P = 1; P <= 8; P++) {
        for (uint64_t pages = 1; pages <= 64; pages *= 2) {
            uint64_t S = (uint64_t)KVL_CHUNKS_PER_PATH * P * pages * ALIGN;
            kvl_segment seg = {.len = S};
            kvl_plan p;
            if (CHECK(kvl_plan_make(&seg, 1, P, 64 * MiB, 4 * KiB, 16, &p) == KVL_OK))
                CHECKF(p.n_chunks == (uint64_t)KVL_CHUNKS_PER_PATH * P && p.chunk_target == pages * ALIGN,
                       "S=%llu P=%u: %zu chunks of %llu, expected %u of %llu",
                       (unsigned long long)S, P, p.n_chunks,
                       (unsigned long long)p.chunk_target, KVL_CHUNKS_PER_PATH * P,
                       (unsigned long long)(pages * ALIGN));
            kvl_plan_free(&p);
        }
    }
    /* min_chunk wins for small transfers: a 1 MiB transfer over 8 paths with
     * a 256 KiB floor gets 4 chunks, not 32. */
    {
        kvl_segment seg = {.len = 1 * MiB};
        kvl_plan p;
        if (CHECK(kvl_plan_make(&seg, 1, 8, 64 * MiB, 256 * KiB, 16, &p) == KVL_OK))
            CHECK(p.n_chunks == 4 && p.chunk_target == 256 * KiB);
        kvl_plan_free(&p);
    }
    /* chunk_bytes wins for large ones. */
    {
        kvl_segment seg = {.len = 1024 * MiB};
        kvl_plan p;
        if (CHECK(kvl_plan_make(&seg, 1, 2, 16 * MiB, 1 * MiB, 16, &p) == KVL_OK))
            CHECK(p.n_chunks == 64 && p.chunk_target == 16 * MiB);
        kvl_plan_free(&p);
    }
    /* A chunk_bytes below a page is honoured exactly (not rounded up). */
    {
        kvl_segment seg = {.len = 10000};
        kvl_plan p;
        if (CHECK(kvl_plan_make(&seg, 1, 1, 1000, 0, 16, &p) == KVL_OK))
            CHECK(p.n_chunks == 10 && p.chunk_target == 1000 && p.chunks[9].bytes == 1000);
        kvl_plan_free(&p);
    }
    /* One byte. */
    {
        kvl_segment seg = {.len = 1};
        kvl_plan p;
        if (CHECK(kvl_plan_make(&seg, 1, 8, 64 * MiB, 0, 1, &p) == KVL_OK))
            CHECK(p.n_chunks == 1 && p.n_pieces == 1 && p.chunks[0].bytes == 1);
        kvl_plan_free(&p);
    }
    /* Randomised, min_chunk a page multiple so the documented rule is exact. */
    test_rng r = {0x73696e676c65ull};
    for (int it = 0; it < 2000; it++) {
        uint64_t chunk = rng_log(&r, 4 * KiB, 64 * MiB);
        uint64_t min_chunk = min_u64(round_up(rng_log(&r, 1, chunk), ALIGN), chunk);
        check_single(rng_log(&r, 1, 256 * MiB), (uint32_t)rng_range(&r, 1, 8), chunk,
                     min_chunk);
    }
}

/* Layer-major packing with tiny max_pieces and many small segments. */
static void test_layers(void)
{
    /* Segments given in descending layers, two per layer: plan order must
     * be ascending by layer, caller order inside a layer. */
    kvl_segment segs[8];
    for (int i = 0; i < 8; i++)
        segs[i] = (kvl_segment){.len = 4096, .layer = (uint32_t)(3 - i / 2)};
    kvl_plan p;
    plan_args a = {segs, 8, 1, 4096, 4096, 1};
    if (CHECK(make(&a, &p) == KVL_OK)) {
        static const uint32_t want[8] = {6, 7, 4, 5, 2, 3, 0, 1};
        CHECK(p.n_chunks == 8);
        for (int i = 0; i < 8 && i < (int)p.n_pieces; i++) {
            CHECKF(p.order[i] == want[i], "order[%d] = %u, expected %u", i, p.order[i],
                   want[i]);
            CHECKF(p.pieces[i].seg == want[i], "piece %d is seg %llu, expected %u", i,
                   (unsigned long long)p.pieces[i].seg, want[i]);
        }
        verify_plan(&a, &p);
    }
    kvl_plan_free(&p);

    /* Sparse layers: n_layers is max + 1 even when most layers are empty. */
    kvl_segment sparse[2] = {{.len = 10, .layer = 39}, {.len = 10, .layer = 0}};
    if (CHECK(kvl_plan_make(sparse, 2, 1, 4096, 0, 16, &p) == KVL_OK)) {
        CHECK(p.n_layers == 40);
        CHECK(p.n_chunks == 1 && p.chunks[0].layer_first == 0 && p.chunks[0].layer_last == 39);
    }
    kvl_plan_free(&p);
}

static void expect_invalid(kvl_err e, const char *what)
{
    CHECKF(e == KVL_ERR_INVALID_ARG, "%s: got %d (%s), expected KVL_ERR_INVALID_ARG", what, e,
           kvl_err_name(e));
    const char *msg = kvl_last_error();
    CHECKF(msg && msg[0], "%s: kvl_last_error() is empty", what);
}

static void test_errors(void)
{
    kvl_segment segs[3] = {{.len = 100}, {.len = 0}, {.len = 5}};
    kvl_plan p;
    memset(&p, 0x5a, sizeof p);
    expect_invalid(kvl_plan_make(segs, 0, 1, 4096, 0, 4, &p), "n_segs = 0");
    /* A failed call leaves a plan that kvl_plan_free accepts. */
    CHECK(p.chunks == NULL && p.pieces == NULL && p.order == NULL && p.n_chunks == 0);
    kvl_plan_free(&p);
    expect_invalid(kvl_plan_make(NULL, 1, 1, 4096, 0, 4, &p), "segs = NULL");
    expect_invalid(kvl_plan_make(segs, 3, 1, 4096, 0, 4, &p), "zero-length segment");
    CHECKF(strstr(kvl_last_error(), "[1]") != NULL, "message should name segments[1]: %s",
           kvl_last_error());
    expect_invalid(kvl_plan_make(segs, 1, 0, 4096, 0, 4, &p), "n_paths = 0");
    expect_invalid(kvl_plan_make(segs, 1, 1, 0, 0, 4, &p), "chunk_bytes = 0");
    expect_invalid(kvl_plan_make(segs, 1, 1, 4096, 0, 0, &p), "max_pieces = 0");
    expect_invalid(kvl_plan_make(segs, 1, 1, 4096, 0, 4, NULL), "out = NULL");
    kvl_segment huge[2] = {{.len = UINT64_MAX / 2 + 1}, {.len = UINT64_MAX / 2 + 1}};
    expect_invalid(kvl_plan_make(huge, 2, 1, 4096, 0, 4, &p), "total overflows");
    kvl_segment top[1] = {{.len = 1, .layer = UINT32_MAX}};
    expect_invalid(kvl_plan_make(top, 1, 1, 4096, 0, 4, &p), "layer UINT32_MAX");
    kvl_plan_free(&p);

    /* kvl_plan_free: zeroed plan, NULL, and twice in a row. */
    kvl_plan z;
    memset(&z, 0, sizeof z);
    kvl_plan_free(&z);
    kvl_plan_free(NULL);
    if (CHECK(kvl_plan_make(segs, 1, 1, 4096, 0, 4, &z) == KVL_OK)) {
        kvl_plan_free(&z);
        CHECK(z.chunks == NULL && z.pieces == NULL && z.order == NULL && z.n_chunks == 0);
        kvl_plan_free(&z);
    }
}

/* Several threads planning unsorted lists at once: the planner's sort uses
 * shared state under a lock, and each plan must still be its own. */
typedef struct thread_arg {
    uint64_t seed;
    unsigned long bad;
} thread_arg;

static void *plan_thread(void *arg)
{
    thread_arg *t = arg;
    test_rng r = {t->seed};
    for (int it = 0; it < 150; it++) {
        plan_args a;
        kvl_segment *segs;
        random_args(&r, &a, &segs);
        kvl_plan p;
        if (make(&a, &p) != KVL_OK)
            t->bad++;
        else
            t->bad += verify_plan(&a, &p);
        kvl_plan_free(&p);
        free(segs);
    }
    return NULL;
}

static void test_threads(void)
{
    enum { N = 4 };
    pthread_t th[N];
    thread_arg args[N];
    for (int i = 0; i < N; i++) {
        args[i] = (thread_arg){.seed = 0x7468726561640000ull + (uint64_t)i, .bad = 0};
        CHECK(pthread_create(&th[i], NULL, plan_thread, &args[i]) == 0);
    }
    for (int i = 0; i < N; i++) {
        pthread_join(th[i], NULL);
        CHECKF(args[i].bad == 0, "thread %d: %lu failures", i, args[i].bad);
    }
}

int main(void)
{
    double t0 = test_now_s();
    test_errors();
    test_layers();
    test_single_segment();
    test_random();
    test_threads();
    return test_report("test_planner", t0);
}
