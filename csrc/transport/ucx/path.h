/* path.h: the UCX side of one kvlink data path (docs/ucx.md, "What the
 * engine integration has to do", steps 2-5).
 *
 * A data path stays one TCP connection (csrc/transport/tcp/): it carries the
 * handshake, the UCX set-up frames, every frame's header and body, the crc32c
 * trailers and the ACKs.  When the set-up succeeded, a kvl_ucx_path beside
 * the TCP endpoint (ep->ucx) carries the payload bytes of DATA frames by UCX
 * put.  A path whose set-up was refused or failed keeps carrying payloads
 * in-stream: that is the per-path TCP fallback, on the same NIC.
 *
 * Threads: kvl_ucx_path_offer runs on the thread that opens the connection
 * (add_peer's helper threads, the prober), on a detached endpoint nothing
 * else touches; everything else runs on the engine thread.
 */
#ifndef KVLINK_UCX_PATH_H
#define KVLINK_UCX_PATH_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "internal.h"

typedef struct kvl_ucx_path kvl_ucx_path;
struct kvl_ucx_rkey;

/* transport ops (transport.h: remote_offer, remote_check, remote_note, remote_answer) */
kvl_err kvl_ucx_path_offer(kvl_ep *ep, const char *local, uint64_t deadline_ns);
int kvl_ucx_path_check(kvl_ep *ep, const kvl_region_info *regions, size_t n);
void kvl_ucx_path_sync(kvl_ep *ep);
int kvl_ucx_path_keys(kvl_ep *ep, const uint8_t *body, size_t len);
int kvl_ucx_path_note(const kvl_ep *ep, char *note, size_t len);
int kvl_ucx_path_answer(kvl_ep *ep, const uint8_t *body, size_t len, int proven);

/* Engine thread, when ep is attached (or its set-up just succeeded): the
 * worker's fd joins the engine's epoll.  -1 on failure (ep stays TCP). */
int kvl_ucx_path_watch(kvl_ep *ep);
/* Engine thread: the worker's fd of the path whose pseudo endpoint is wk
 * fired: progress it, then let the data endpoint go on (a frame waiting for
 * its flush). */
void kvl_ucx_path_on_event(kvl_ep *wk);
/* Engine thread: closes the UCP endpoint at once (force: nothing more lands
 * or is read through it; bounded by timeout_ms), unmaps, frees the worker.
 * Before the memory the frames of ep read from is let go of. */
void kvl_ucx_path_free(kvl_ep *ep, uint32_t timeout_ms);

/* 1 if every piece's region has a key on this path (the frame may go
 * one-sided), else 0 (it goes in-stream: docs/ucx.md, per chunk fallback). */
int kvl_ucx_path_covers(const kvl_ucx_path *u, const kvl_wire_piece *dst, uint32_t n);
/* Posts the puts of one frame: payload iovecs src (n_src) to the pieces dst
 * (n_dst, same total len), folds the source into *crc, starts a flush:
 * *seq is its number.  KVL_OK, or an error with the reason (the path's UCX
 * endpoint is unusable then). */
kvl_err kvl_ucx_path_post(kvl_ucx_path *u, const struct iovec *src, int n_src,
                          const kvl_wire_piece *dst, uint32_t n_dst, uint64_t len, uint32_t *crc,
                          uint64_t *seq);
/* 1 once the flush numbered seq completed; 0 while not; -1 if the UCX
 * endpoint failed (why: the reason). */
int kvl_ucx_path_flushed(kvl_ucx_path *u, uint64_t seq, char *why, size_t why_len);
/* Engine thread: progresses the worker until flush seq completed or
 * deadline_ns passed: 1 done, 0 timed out, -1 failed. */
int kvl_ucx_path_wait_flush(kvl_ucx_path *u, uint64_t seq, uint64_t deadline_ns);

#endif
