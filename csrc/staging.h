/* staging.h: payloads of memory the stream cannot touch, via host slots (staging.c). */
#ifndef KVLINK_STAGING_H_
#define KVLINK_STAGING_H_

#include "base.h"

/* ---- staging.c: payloads of memory the sockets cannot touch, via host slots ---- */
enum { KVL_STAGE_NONE = 0, KVL_STAGE_MEMCPY = 1, KVL_STAGE_CUDA = 2 };
/* One slot of host memory: one payload's bytes while it is staged. */
typedef struct kvl_stage_buf {
    uint8_t *p;
    size_t cap;
    int pinned; /* from kvl_cuda_host_alloc */
    struct kvl_stage_buf *next; /* in the agent's idle list */
} kvl_stage_buf;
/* How payloads of a region of memory type mem move: KVL_STAGE_CUDA for
 * device memory, KVL_STAGE_MEMCPY for host memory under
 * cfg.stage_host_memory (tests, overhead measurements), else NONE. */
int kvl_stage_kind(const kvl_agent *a, uint32_t mem);
/* A slot of at least len bytes from a's pool (a new one when none idle
 * fits), pinned for KVL_STAGE_CUDA where the runtime gives pinned memory;
 * the caller owns it until kvl_stage_give.  KVL_ERR_NOMEM.  Thread-safe. */
kvl_err kvl_stage_take(kvl_agent *a, int kind, size_t len, kvl_stage_buf **out);
/* Gives b (NULL: nothing) back to a's pool: kept idle up to
 * cfg.stage_pool_bytes, freed beyond.  Thread-safe. */
void kvl_stage_give(kvl_agent *a, kvl_stage_buf *b);
/* Frees every idle slot: agent teardown, after every connection is gone. */
void kvl_stage_pool_destroy(kvl_agent *a);
/* Copies the n pieces of src (len bytes in all, at most b->cap) into b.
 * Blocks for the copies.  Errors: a CUDA copy failed (kvl_last_error says
 * which). */
kvl_err kvl_stage_gather(kvl_stage_buf *b, int kind, const struct iovec *src, int n, size_t len);
/* Copies b's first bytes out to the n pieces of dst and, for CUDA, waits
 * until they are in device memory. */
kvl_err kvl_stage_scatter(const kvl_stage_buf *b, int kind, const struct iovec *dst, int n);

#endif
