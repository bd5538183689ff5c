/* staging.c: payload bytes of memory the sockets cannot touch, through host
 * memory (docs/api.md, "GPU memory").
 *
 * A TCP stream sends from and receives into registered memory directly;
 * device memory it cannot read or write.  A chunk frame whose source is
 * staged has its pieces gathered into the sending endpoint's host slot
 * right before its payload starts (stream.c); a payload whose destination
 * is staged is received into the receiving connection's slot and, once its
 * crc32c verified over the slot, scattered to its pieces and the copy
 * synchronised before it is acknowledged (proto.c).
 *
 * Slots come from a per-agent pool and go back to it as soon as their
 * payload has left (sent, or for a UCX put flushed) or been placed.  A
 * stream carries one payload at a time each way, and only its head frame is
 * staged, so at most two slots per data connection are out at once: the
 * next frame on a connection waits for the one before it, and nothing
 * waits for a slot.  Idle slots are kept for reuse up to
 * cfg.stage_pool_bytes (pinned allocations are slow); beyond that, a slot
 * given back is freed.
 *
 * The copy is cudaMemcpy (cudaMemcpyDefault: it tells device from host by
 * unified addressing) for KVL_STAGE_CUDA and memcpy for KVL_STAGE_MEMCPY,
 * which Config(stage_host_memory=True) routes host regions through so the
 * very same code runs in CI without a GPU.  Copies run on the engine thread;
 * the pool takes its own lock (endpoints are also freed at teardown).
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

int kvl_stage_kind(const kvl_agent *a, uint32_t mem)
{
    if (mem == KVL_MEM_CUDA)
        return KVL_STAGE_CUDA;
    return a->cfg.stage_host_memory ? KVL_STAGE_MEMCPY : KVL_STAGE_NONE;
}

static void slot_free(kvl_stage_buf *b)
{
    if (b->pinned)
        kvl_cuda_host_free(b->p);
    else
        free(b->p);
    free(b);
}

/* A new slot of len bytes, pinned when the copies are CUDA's (a pageable
 * buffer would make cudaMemcpy bounce through a driver buffer of its own). */
static kvl_stage_buf *slot_new(int kind, size_t len)
{
    kvl_stage_buf *b = calloc(1, sizeof *b);
    if (!b)
        return NULL;
    if (kind == KVL_STAGE_CUDA) {
        b->p = kvl_cuda_host_alloc(len);
        b->pinned = b->p != NULL;
    }
    if (!b->p) /* no pinned memory to be had: pageable still works, slower */
        b->p = malloc(len);
    if (!b->p) {
        free(b);
        return NULL;
    }
    b->cap = len;
    return b;
}

kvl_err kvl_stage_take(kvl_agent *a, int kind, size_t len, kvl_stage_buf **out)
{
    int want_pinned = kind == KVL_STAGE_CUDA;
    kvl_stage_buf *got = NULL, **best = NULL;
    pthread_mutex_lock(&a->stage_mu);
    /* the smallest idle slot that fits (slots are mostly one chunk size) */
    for (kvl_stage_buf **pp = &a->stage_idle; *pp; pp = &(*pp)->next)
        if ((*pp)->cap >= len && ((*pp)->pinned || !want_pinned) &&
            (!best || (*pp)->cap < (*best)->cap))
            best = pp;
    if (best) {
        got = *best;
        *best = got->next;
        a->stage_idle_bytes -= got->cap;
    }
    pthread_mutex_unlock(&a->stage_mu);
    if (!got && !(got = slot_new(kind, len)))
        return kvl_fail(KVL_ERR_NOMEM, "staging: out of memory for a %zu-byte slot", len);
    got->next = NULL;
    *out = got;
    return KVL_OK;
}

void kvl_stage_give(kvl_agent *a, kvl_stage_buf *b)
{
    if (!b)
        return;
    pthread_mutex_lock(&a->stage_mu);
    int keep = a->stage_idle_bytes + b->cap <= a->cfg.stage_pool_bytes;
    if (keep) {
        b->next = a->stage_idle;
        a->stage_idle = b;
        a->stage_idle_bytes += b->cap;
    }
    pthread_mutex_unlock(&a->stage_mu);
    if (!keep)
        slot_free(b);
}

void kvl_stage_pool_destroy(kvl_agent *a)
{
    while (a->stage_idle) {
        kvl_stage_buf *b = a->stage_idle;
        a->stage_idle = b->next;
        slot_free(b);
    }
    a->stage_idle_bytes = 0;
}

static kvl_err copy(int kind, void *dst, const void *src, size_t len)
{
    if (kind == KVL_STAGE_CUDA)
        return kvl_cuda_copy(dst, src, len);
    memcpy(dst, src, len);
    return KVL_OK;
}

kvl_err kvl_stage_gather(kvl_stage_buf *b, int kind, const struct iovec *src, int n, size_t len)
{
    kvl_err e = len <= b->cap ? KVL_OK
                              : kvl_fail(KVL_ERR_INVALID_ARG, "staging: the slot is too small");
    size_t at = 0;
    for (int i = 0; !e && i < n; i++) {
        if (src[i].iov_len > len - at)
            return kvl_fail(KVL_ERR_INVALID_ARG, "staging: pieces hold more than the payload");
        e = copy(kind, b->p + at, src[i].iov_base, src[i].iov_len);
        at += src[i].iov_len;
    }
    if (!e && at != len)
        return kvl_fail(KVL_ERR_INVALID_ARG, "staging: pieces hold %zu bytes, the payload %zu",
                        at, len);
    return e;
}

kvl_err kvl_stage_scatter(const kvl_stage_buf *b, int kind, const struct iovec *dst, int n)
{
    size_t at = 0;
    kvl_err e = KVL_OK;
    for (int i = 0; !e && i < n; i++) {
        if (dst[i].iov_len > b->cap - at)
            return kvl_fail(KVL_ERR_INVALID_ARG, "staging: pieces hold more than the slot");
        e = copy(kind, dst[i].iov_base, b->p + at, dst[i].iov_len);
        at += dst[i].iov_len;
    }
    /* the bytes are in device memory before anyone hears the chunk is done */
    if (!e && kind == KVL_STAGE_CUDA)
        e = kvl_cuda_sync();
    return e;
}
