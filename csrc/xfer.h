/* xfer.h: a transfer: validate, plan, queue, and its caller-side handle (xfer.c). */
#ifndef KVLINK_XFER_H_
#define KVLINK_XFER_H_

#include "base.h"

/* ---- xfer.c ---- */
/* Chunk ci verified: progress, layer and event bookkeeping, wakes waiters. */
void kvl_xfer_chunk_done(kvl_xfer *x, uint32_t ci, uint32_t path, uint64_t now);
/* Marks the transfer failed (first error wins) and wakes waiters. */
void kvl_xfer_set_failed(kvl_xfer *x, kvl_err err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
int kvl_xfer_running(kvl_xfer *x);
/* Builds x's ANNOUNCE frame (a push's tag, size and chunk-to-layer map). */
void kvl_xfer_announce(kvl_xfer *x, kvl_buf *b, uint64_t now);
/* Makes the outcome visible to callers (info.state) and wakes them. */
void kvl_xfer_publish(kvl_xfer *x);

#endif
