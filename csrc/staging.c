/* staging.c: payload bytes of memory the sockets cannot touch, through host
 * memory (docs/api.md, "GPU memory").
 *
 * A TCP stream sends from and receives into registered memory directly;
 * device memory it cannot read or write.  A chunk frame whose source is
 * staged has its pieces gathered into the sending endpoint's host slot
 * right before its payload starts (stream.c); a payload whose destination
 * is staged is received into the receiving connection's slot and, once its
 * crc32c verified over the slot, scattered to its pieces and the copy
 * synchronised before it is acknowledged (proto.c).  A stream carries one
 * payload at a time each way, so one slot per connection and direction is
 * all the staging there is: bounded by the connections, never waiting.
 *
 * The copy is cudaMemcpy (cudaMemcpyDefault: it tells device from host by
 * unified addressing) for KVL_STAGE_CUDA and memcpy for KVL_STAGE_MEMCPY,
 * which Config(stage_host_memory=True) routes host regions through so the
 * very same code runs in CI without a GPU.  Engine thread only.
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

void kvl_stage_free(kvl_stage_buf *b)
{
    if (b->pinned)
        kvl_cuda_host_free(b->p);
    else
        free(b->p);
    memset(b, 0, sizeof *b);
}

/* b holds len bytes, pinned when the copies are CUDA's (a pageable buffer
 * would make cudaMemcpy bounce through a driver buffer of its own). */
static kvl_err reserve(kvl_stage_buf *b, int kind, size_t len)
{
    int want_pinned = kind == KVL_STAGE_CUDA;
    if (b->p && b->cap >= len && (b->pinned || !want_pinned))
        return KVL_OK;
    kvl_stage_free(b);
    if (want_pinned) {
        b->p = kvl_cuda_host_alloc(len);
        b->pinned = b->p != NULL;
    }
    if (!b->p) /* no pinned memory to be had: pageable still works, slower */
        b->p = malloc(len);
    if (!b->p)
        return kvl_fail(KVL_ERR_NOMEM, "staging: out of memory for a %zu-byte slot", len);
    b->cap = len;
    return KVL_OK;
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
    kvl_err e = reserve(b, kind, len);
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

kvl_err kvl_stage_prepare(kvl_stage_buf *b, int kind, size_t len) { return reserve(b, kind, len); }

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
