/* progress.h: a transfer's progress as its waiters see it, one for both
 * handles: the initiator's (kvl_xfer, xfer.c) and the receiver's of a push
 * (kvl_inxfer, inbound.c).
 *
 * One writer, the engine thread, reports chunks verified and the outcome;
 * any number of caller threads wait on it (done, a layer, the next chunk
 * event) and take snapshots.  Everything marked "under mu" is read and
 * written with mu held; the owner may keep its own fields under mu too.
 *
 * A chunk carries layers [chunk_lf, chunk_ll].  The sender marks the layers
 * it has no bytes of ABSENT before kvl_progress_start (a wait on one is the
 * caller's mistake) and a chunk's range skips them; the receiver counts
 * every layer in a chunk's range.  A layer no chunk covers is DONE.
 *
 * The outcome has two steps: fin is decided (first error wins), state is
 * what waiters see.  deferred = 0 makes them the same step (the receiver);
 * deferred = 1 keeps state RUNNING until kvl_progress_publish (the sender:
 * "done" must mean its regions are released, so deregister() succeeds).
 */
#ifndef KVL_PROGRESS_H
#define KVL_PROGRESS_H

#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>

#include "kvlink.h"

enum { KVL_LAYER_PENDING = 0, KVL_LAYER_DONE = 1, KVL_LAYER_ABSENT = 2 };
enum { KVL_WAIT_DONE, KVL_WAIT_LAYER, KVL_WAIT_EVENT }; /* what a timed-out wait waited for */

#define KVL_PROGRESS_MSG_BYTES 512 /* the message arrays of kvl_xfer_info, kvl_inbound_info */

struct kvl_progress;

/* The owner's wording of a wait's failure, so each handle keeps its own
 * messages.  Called with mu held (any field readable), on the waiter's
 * thread; each returns kvl_fail(...)'s code. */
typedef struct kvl_progress_msgs {
    kvl_err (*timeout)(const struct kvl_progress *p, int what, uint32_t layer,
                       uint32_t timeout_ms);    /* KVL_ERR_TIMEOUT */
    kvl_err (*failed)(const struct kvl_progress *p); /* p->err, with kvl_progress_why(p) */
    kvl_err (*no_layer)(const struct kvl_progress *p, uint32_t layer); /* KVL_ERR_INVALID_ARG */
} kvl_progress_msgs;

typedef struct kvl_progress {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    const kvl_progress_msgs *msgs;
    void *owner;               /* the handle embedding this one, for msgs */
    int deferred;              /* state follows fin only at kvl_progress_publish */
    int fin;                   /* kvl_xfer_state decided; written under mu by the engine,
                                  which alone may read it without mu */
    /* under mu */
    int state;                 /* kvl_xfer_state as waiters see it */
    uint32_t err;              /* kvl_err once fin is FAILED */
    char *message;             /* its text (KVL_PROGRESS_MSG_BYTES), NULL before or out of
                                  memory: a push's handle costs what it announced */
    uint64_t bytes_total, bytes_done;
    uint32_t chunks_total, chunks_done;
    uint32_t n_layers, layers_ready; /* layers 0..layers_ready-1 are done (or absent) */
    uint64_t t_first_byte_ns, t_first_layer_ns, t_done_ns;
    uint32_t *chunk_lf, *chunk_ll; /* per chunk: its layers; set before start, then fixed */
    uint32_t *layer_left;      /* per layer: chunks carrying it not yet verified */
    uint8_t *layer_done;       /* per layer: KVL_LAYER_*; NULL once shrunk */
    kvl_chunk_event *events;   /* verified chunks in verification order */
    uint32_t n_events, ev_read;
} kvl_progress;

/* ---- set-up and teardown (the creating thread, before anyone else sees p) ---- */

/* An empty handle, RUNNING, no chunks.  msgs must outlive p.  Cannot fail. */
void kvl_progress_init(kvl_progress *p, const kvl_progress_msgs *msgs, void *owner,
                       int deferred);
/* Allocates the per-chunk and per-layer arrays (all layers PENDING).  Returns
 * KVL_ERR_NOMEM (with the message set) when out of memory; kvl_progress_destroy
 * frees what was allocated. */
kvl_err kvl_progress_alloc(kvl_progress *p, uint32_t n_chunks, uint32_t n_layers,
                           uint64_t bytes_total);
/* After chunk_lf/chunk_ll (and any ABSENT layer) are set: counts each
 * layer's chunks and marks the layers no chunk covers DONE.  Does not block. */
void kvl_progress_start(kvl_progress *p);
/* Frees every array and the message and destroys the lock: no waiter may
 * remain (the owner's last reference). */
void kvl_progress_destroy(kvl_progress *p);

/* ---- the writer (engine thread); each wakes every waiter ---- */

/* Chunk ci verified at now on path: its event is queued and the layers it
 * was the last chunk of close; the last chunk decides fin = DONE.  Does not
 * block beyond mu.  Not after fin is decided, nor twice for one chunk. */
void kvl_progress_chunk_done(kvl_progress *p, uint32_t ci, uint32_t path, uint64_t bytes,
                             uint64_t now);
/* Decides fin = FAILED with err and the formatted text unless fin is
 * decided already (the first outcome wins).  Does not block beyond mu. */
void kvl_progress_fail(kvl_progress *p, kvl_err err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
void kvl_progress_vfail(kvl_progress *p, kvl_err err, const char *fmt, va_list ap)
    __attribute__((format(printf, 3, 0)));
/* deferred: waiters see fin from now on. */
void kvl_progress_publish(kvl_progress *p);
/* Once FAILED: frees the per-chunk and per-layer arrays (a failed handle
 * nobody took yet keeps what reports the failure only).  Any thread. */
void kvl_progress_shrink(kvl_progress *p);

/* ---- waiters and readers (any thread, thread-safe) ---- */

/* Each blocks up to timeout_ms (0: answers at once) and returns KVL_OK,
 * the failure (msgs->failed) or KVL_ERR_TIMEOUT (msgs->timeout), with the
 * thread's last error set; every one wakes when the outcome is published.
 * wait: until the outcome is published. */
kvl_err kvl_progress_wait(kvl_progress *p, uint32_t timeout_ms);
/* Until every chunk carrying layer is verified (KVL_OK, also after a later
 * failure) or the outcome is published; KVL_ERR_INVALID_ARG (msgs->no_layer)
 * for a layer beyond n_layers or ABSENT, at once. */
kvl_err kvl_progress_wait_layer(kvl_progress *p, uint32_t layer, uint32_t timeout_ms);
/* Takes the next chunk event (into *ev) in verification order; KVL_ERR_END
 * once all are taken and the outcome is DONE (FAILED: the failure). */
kvl_err kvl_progress_next_event(kvl_progress *p, uint32_t timeout_ms, kvl_chunk_event *ev);

/* A snapshot of the counters shared by both handles' info structs. */
typedef struct kvl_progress_snap {
    uint32_t state, err;
    uint64_t bytes_total, bytes_done;
    uint32_t chunks_total, chunks_done, layers, layers_ready;
    uint64_t t_first_byte_ns, t_first_layer_ns, t_done_ns;
} kvl_progress_snap;

/* Copies the counters, and the message into message (cap bytes, "" when
 * none) unless message is NULL.  Does not block beyond mu. */
void kvl_progress_get(kvl_progress *p, kvl_progress_snap *out, char *message, size_t cap);
/* 1 if layer is done (0 beyond n_layers, or once shrunk).  Does not block
 * beyond mu. */
int kvl_progress_layer_done(kvl_progress *p, uint32_t layer);
/* 1 once the outcome is published.  Does not block beyond mu. */
int kvl_progress_finished(kvl_progress *p);
/* The failure's text, never NULL.  With mu held, or on the engine thread
 * once fin is FAILED (the text never changes after). */
const char *kvl_progress_why(const kvl_progress *p);

#endif
