/* planner.c: turns a transfer's segments into chunks.
 *
 * Chunks are the unit of scheduling, verification and retry.  The plan is
 * layer-major (segments stably sorted by layer) so early layers finish first,
 * and the chunk size shrinks for small transfers so that every path gets
 * several chunks (tail balance) and the first layer is spread over all paths
 * (time to first layer), but never below min_chunk_bytes, where per-chunk
 * costs start to show (see docs/BENCHMARKS.md, chunk-size sweep).
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define ALIGN 4096u         /* chunk sizes stay page multiples */

/* Sort keys: layer in the high half, the segment's index in the low half,
 * so plain qsort (no context argument, no shared state) is stable. */
static int by_key(const void *a, const void *b)
{
    uint64_t ka = *(const uint64_t *)a, kb = *(const uint64_t *)b;
    return ka < kb ? -1 : ka > kb;
}

static uint64_t ceil_div(uint64_t a, uint64_t b) { return a / b + (a % b != 0); }

static kvl_err sort_segments(const kvl_segment *segs, size_t n, uint32_t *order)
{
    int sorted = 1;
    for (size_t i = 0; i < n; i++) {
        order[i] = (uint32_t)i;
        if (i && segs[i].layer < segs[i - 1].layer)
            sorted = 0;
    }
    if (sorted)
        return KVL_OK;
    uint64_t *keys = malloc(n * sizeof *keys);
    if (!keys)
        return kvl_fail(KVL_ERR_NOMEM, "plan: out of memory sorting %zu segments", n);
    for (size_t i = 0; i < n; i++)
        keys[i] = (uint64_t)segs[i].layer << 32 | i;
    qsort(keys, n, sizeof *keys, by_key);
    for (size_t i = 0; i < n; i++)
        order[i] = (uint32_t)keys[i];
    free(keys);
    return KVL_OK;
}

static uint64_t pick_target(const kvl_segment *segs, const uint32_t *order, size_t n,
                            uint64_t total, uint32_t n_paths, uint64_t chunk_bytes,
                            uint64_t min_chunk)
{
    uint64_t target = chunk_bytes;
    uint64_t spread = ceil_div(total, (uint64_t)n_paths * KVL_CHUNKS_PER_PATH);
    if (spread < target)
        target = spread;
    uint32_t first_layer = segs[order[0]].layer;
    if (segs[order[n - 1]].layer != first_layer) {
        uint64_t first_bytes = 0;
        for (size_t i = 0; i < n && segs[order[i]].layer == first_layer; i++)
            first_bytes += segs[order[i]].len;
        uint64_t per_path = ceil_div(first_bytes, n_paths);
        if (per_path < target)
            target = per_path;
    }
    if (target < min_chunk)
        target = min_chunk;
    target = ceil_div(target, ALIGN) * ALIGN;
    if (target > chunk_bytes)
        target = chunk_bytes;
    return target ? target : 1;
}

static int grow(void **p, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap)
        return 0;
    size_t ncap = *cap ? *cap * 2 : 64;
    while (ncap < need)
        ncap *= 2;
    void *np = realloc(*p, ncap * elem);
    if (!np)
        return -1;
    *p = np;
    *cap = ncap;
    return 0;
}

kvl_err kvl_plan_make(const kvl_segment *segs, size_t n_segs, uint32_t n_paths,
                      uint64_t chunk_bytes, uint64_t min_chunk_bytes, uint32_t max_pieces,
                      kvl_plan *out)
{
    kvl_clear_error();
    if (!out)
        return kvl_fail(KVL_ERR_INVALID_ARG, "plan: out is NULL");
    memset(out, 0, sizeof *out);
    if (!segs || n_segs == 0)
        return kvl_fail(KVL_ERR_INVALID_ARG, "segments: a transfer needs at least one segment");
    if (n_segs > UINT32_MAX)
        return kvl_fail(KVL_ERR_INVALID_ARG, "segments: at most %u segments per transfer",
                        UINT32_MAX);
    if (n_paths == 0 || chunk_bytes == 0 || max_pieces == 0)
        return kvl_fail(KVL_ERR_INVALID_ARG,
                        "plan: n_paths, chunk_bytes and max_pieces must be positive");
    if (min_chunk_bytes > chunk_bytes)
        min_chunk_bytes = chunk_bytes;

    uint64_t total = 0;
    uint32_t max_layer = 0;
    for (size_t i = 0; i < n_segs; i++) {
        if (segs[i].len == 0)
            return kvl_fail(KVL_ERR_INVALID_ARG, "segments[%zu]: length is 0", i);
        if (total + segs[i].len < total)
            return kvl_fail(KVL_ERR_INVALID_ARG, "segments: total length overflows 64 bits");
        total += segs[i].len;
        if (segs[i].layer > max_layer)
            max_layer = segs[i].layer;
    }
    if (max_layer == UINT32_MAX)
        return kvl_fail(KVL_ERR_INVALID_ARG, "segments: layer %u is too large", max_layer);

    uint32_t *order = malloc(n_segs * sizeof *order);
    if (!order)
        return kvl_fail(KVL_ERR_NOMEM, "plan: out of memory for %zu segments", n_segs);
    kvl_err e = sort_segments(segs, n_segs, order);
    if (e) {
        free(order);
        return e;
    }
    uint64_t target = pick_target(segs, order, n_segs, total, n_paths, chunk_bytes,
                                  min_chunk_bytes);

    kvl_chunk *chunks = NULL;
    kvl_piece *pieces = NULL;
    size_t n_chunks = 0, n_pieces = 0, cap_chunks = 0, cap_pieces = 0;
    kvl_chunk *cur = NULL;
    for (size_t k = 0; k < n_segs; k++) {
        const kvl_segment *s = &segs[order[k]];
        uint64_t off = 0;
        while (off < s->len) {
            if (!cur) {
                if (grow((void **)&chunks, &cap_chunks, n_chunks + 1, sizeof *chunks))
                    goto nomem;
                cur = &chunks[n_chunks++];
                memset(cur, 0, sizeof *cur);
                cur->first_piece = n_pieces;
                cur->layer_first = s->layer;
            }
            uint64_t take = s->len - off;
            if (take > target - cur->bytes)
                take = target - cur->bytes;
            if (grow((void **)&pieces, &cap_pieces, n_pieces + 1, sizeof *pieces))
                goto nomem;
            pieces[n_pieces++] = (kvl_piece){.seg = order[k], .seg_offset = off, .len = take};
            cur->n_pieces++;
            cur->bytes += take;
            cur->layer_last = s->layer;
            off += take;
            if (cur->bytes == target || cur->n_pieces == max_pieces)
                cur = NULL;
        }
    }
    out->chunks = chunks;
    out->n_chunks = n_chunks;
    out->pieces = pieces;
    out->n_pieces = n_pieces;
    out->order = order;
    out->chunk_target = target;
    out->n_layers = max_layer + 1;
    return KVL_OK;
nomem:
    free(chunks);
    free(pieces);
    free(order);
    return kvl_fail(KVL_ERR_NOMEM, "plan: out of memory");
}

void kvl_plan_free(kvl_plan *plan)
{
    if (!plan)
        return;
    free(plan->chunks);
    free(plan->pieces);
    free(plan->order);
    memset(plan, 0, sizeof *plan);
}
