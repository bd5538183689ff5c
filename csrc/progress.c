/* progress.c: a transfer's progress, layers, chunk events and outcome, with
 * the waits on them (progress.h); the sender's and the receiver's handles
 * both embed one. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

void kvl_progress_init(kvl_progress *p, const kvl_progress_msgs *msgs, void *owner, int deferred)
{
    memset(p, 0, sizeof *p);
    pthread_mutex_init(&p->mu, NULL);
    kvl_cond_init(&p->cv);
    p->msgs = msgs;
    p->owner = owner;
    p->deferred = deferred;
    p->fin = p->state = KVL_XFER_RUNNING;
}

static void free_arrays(kvl_progress *p)
{
    free(p->chunk_lf);
    free(p->chunk_ll);
    free(p->layer_left);
    free(p->layer_done);
    free(p->events);
    p->chunk_lf = p->chunk_ll = p->layer_left = NULL;
    p->layer_done = NULL;
    p->events = NULL;
    p->n_events = p->ev_read = 0;
}

kvl_err kvl_progress_alloc(kvl_progress *p, uint32_t n_chunks, uint32_t n_layers,
                           uint64_t bytes_total)
{
    size_t nc = n_chunks ? n_chunks : 1, nl = n_layers ? n_layers : 1;
    p->chunk_lf = malloc(nc * sizeof *p->chunk_lf);
    p->chunk_ll = malloc(nc * sizeof *p->chunk_ll);
    p->events = calloc(nc, sizeof *p->events);
    p->layer_left = calloc(nl, sizeof *p->layer_left);
    p->layer_done = calloc(nl, 1); /* KVL_LAYER_PENDING */
    if (!p->chunk_lf || !p->chunk_ll || !p->events || !p->layer_left || !p->layer_done)
        return kvl_fail(KVL_ERR_NOMEM, "out of memory for the progress of %u chunks", n_chunks);
    p->chunks_total = n_chunks;
    p->n_layers = n_layers;
    p->bytes_total = bytes_total;
    return KVL_OK;
}

void kvl_progress_start(kvl_progress *p)
{
    for (uint32_t ci = 0; ci < p->chunks_total; ci++)
        for (uint32_t l = p->chunk_lf[ci]; l <= p->chunk_ll[ci]; l++)
            if (p->layer_done[l] != KVL_LAYER_ABSENT)
                p->layer_left[l]++;
    for (uint32_t l = 0; l < p->n_layers; l++)
        if (p->layer_done[l] == KVL_LAYER_PENDING && !p->layer_left[l])
            p->layer_done[l] = KVL_LAYER_DONE;
    while (p->layers_ready < p->n_layers && p->layer_done[p->layers_ready] != KVL_LAYER_PENDING)
        p->layers_ready++;
}

void kvl_progress_destroy(kvl_progress *p)
{
    free_arrays(p);
    free(p->message);
    p->message = NULL;
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
}

/* ---- the writer ---- */

void kvl_progress_chunk_done(kvl_progress *p, uint32_t ci, uint32_t path, uint64_t bytes,
                             uint64_t now)
{
    pthread_mutex_lock(&p->mu);
    kvl_chunk_event *ev = &p->events[p->n_events++];
    ev->chunk = ci;
    ev->path = path;
    ev->bytes = bytes;
    ev->t_ns = now;
    ev->layer_first = 0;
    ev->layer_count = 0;
    /* Inner layers close with the chunk, its end layers when their other
     * chunks are done; the event reports [first, last] closed, layers
     * between them that are absent counting as complete. */
    for (uint32_t l = p->chunk_lf[ci]; l <= p->chunk_ll[ci]; l++) {
        if (p->layer_done[l] == KVL_LAYER_ABSENT || --p->layer_left[l])
            continue;
        p->layer_done[l] = KVL_LAYER_DONE;
        if (l == 0)
            p->t_first_layer_ns = now;
        if (!ev->layer_count)
            ev->layer_first = l;
        ev->layer_count = l - ev->layer_first + 1;
    }
    while (p->layers_ready < p->n_layers && p->layer_done[p->layers_ready] != KVL_LAYER_PENDING)
        p->layers_ready++;
    p->bytes_done += bytes;
    p->chunks_done++;
    if (!p->t_first_byte_ns)
        p->t_first_byte_ns = now;
    if (p->chunks_done == p->chunks_total && p->fin == KVL_XFER_RUNNING) {
        p->fin = KVL_XFER_DONE;
        p->t_done_ns = now;
        if (!p->deferred)
            p->state = p->fin;
    }
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

void kvl_progress_vfail(kvl_progress *p, kvl_err err, const char *fmt, va_list ap)
{
    pthread_mutex_lock(&p->mu);
    if (p->fin == KVL_XFER_RUNNING) {
        p->message = malloc(KVL_PROGRESS_MSG_BYTES);
        if (p->message)
            vsnprintf(p->message, KVL_PROGRESS_MSG_BYTES, fmt, ap);
        p->fin = KVL_XFER_FAILED;
        p->err = (uint32_t)err;
        p->t_done_ns = kvl_now_ns();
        if (!p->deferred)
            p->state = p->fin;
        pthread_cond_broadcast(&p->cv);
    }
    pthread_mutex_unlock(&p->mu);
}

void kvl_progress_fail(kvl_progress *p, kvl_err err, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    kvl_progress_vfail(p, err, fmt, ap);
    va_end(ap);
}

void kvl_progress_publish(kvl_progress *p)
{
    pthread_mutex_lock(&p->mu);
    p->state = p->fin;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

void kvl_progress_shrink(kvl_progress *p)
{
    pthread_mutex_lock(&p->mu);
    if (p->state == KVL_XFER_FAILED)
        free_arrays(p);
    pthread_mutex_unlock(&p->mu);
}

/* ---- waiters ---- */

static int finished(void *obj, uint32_t unused)
{
    (void)unused;
    return ((kvl_progress *)obj)->state != KVL_XFER_RUNNING;
}

/* the state first: a shrunk handle has no layer_done */
static int layer_ready(void *obj, uint32_t layer)
{
    kvl_progress *p = obj;
    return p->state != KVL_XFER_RUNNING || p->layer_done[layer] == KVL_LAYER_DONE;
}

static int event_ready(void *obj, uint32_t unused)
{
    kvl_progress *p = obj;
    (void)unused;
    return p->ev_read < p->n_events || p->state != KVL_XFER_RUNNING;
}

/* With mu held: waits for pred; 0 when it holds, else the timeout's error. */
static kvl_err wait_for(kvl_progress *p, int (*pred)(void *, uint32_t), int what,
                        uint32_t layer, uint32_t timeout_ms)
{
    if (kvl_cond_wait_until(&p->cv, &p->mu, pred, p, layer, timeout_ms))
        return p->msgs->timeout(p, what, layer, timeout_ms);
    return KVL_OK;
}

/* The published outcome, with mu held. */
static kvl_err outcome(kvl_progress *p)
{
    return p->state == KVL_XFER_DONE ? KVL_OK : p->msgs->failed(p);
}

kvl_err kvl_progress_wait(kvl_progress *p, uint32_t timeout_ms)
{
    kvl_clear_error();
    pthread_mutex_lock(&p->mu);
    kvl_err e = wait_for(p, finished, KVL_WAIT_DONE, 0, timeout_ms);
    if (!e)
        e = outcome(p);
    pthread_mutex_unlock(&p->mu);
    return e;
}

kvl_err kvl_progress_wait_layer(kvl_progress *p, uint32_t layer, uint32_t timeout_ms)
{
    kvl_clear_error();
    pthread_mutex_lock(&p->mu);
    kvl_err e;
    if (layer >= p->n_layers || (p->layer_done && p->layer_done[layer] == KVL_LAYER_ABSENT))
        e = p->msgs->no_layer(p, layer);
    else if (!(e = wait_for(p, layer_ready, KVL_WAIT_LAYER, layer, timeout_ms)))
        e = p->layer_done && p->layer_done[layer] == KVL_LAYER_DONE ? KVL_OK : outcome(p);
    pthread_mutex_unlock(&p->mu);
    return e;
}

kvl_err kvl_progress_next_event(kvl_progress *p, uint32_t timeout_ms, kvl_chunk_event *ev)
{
    kvl_clear_error();
    pthread_mutex_lock(&p->mu);
    kvl_err e = wait_for(p, event_ready, KVL_WAIT_EVENT, 0, timeout_ms);
    if (!e && p->ev_read < p->n_events)
        *ev = p->events[p->ev_read++];
    else if (!e && p->state == KVL_XFER_DONE)
        e = kvl_fail(KVL_ERR_END, "all chunk events taken");
    else if (!e)
        e = outcome(p);
    pthread_mutex_unlock(&p->mu);
    return e;
}

/* ---- readers ---- */

void kvl_progress_get(kvl_progress *p, kvl_progress_snap *out, char *message, size_t cap)
{
    pthread_mutex_lock(&p->mu);
    *out = (kvl_progress_snap){
        .state = (uint32_t)p->state,
        .err = p->err,
        .bytes_total = p->bytes_total,
        .bytes_done = p->bytes_done,
        .chunks_total = p->chunks_total,
        .chunks_done = p->chunks_done,
        .layers = p->n_layers,
        .layers_ready = p->layers_ready,
        .t_first_byte_ns = p->t_first_byte_ns,
        .t_first_layer_ns = p->t_first_layer_ns,
        .t_done_ns = p->t_done_ns,
    };
    if (message && cap)
        snprintf(message, cap, "%s", p->message ? p->message : "");
    pthread_mutex_unlock(&p->mu);
}

int kvl_progress_layer_done(kvl_progress *p, uint32_t layer)
{
    pthread_mutex_lock(&p->mu);
    int done = layer < p->n_layers && p->layer_done && p->layer_done[layer] == KVL_LAYER_DONE;
    pthread_mutex_unlock(&p->mu);
    return done;
}

int kvl_progress_finished(kvl_progress *p)
{
    pthread_mutex_lock(&p->mu);
    int done = p->state != KVL_XFER_RUNNING;
    pthread_mutex_unlock(&p->mu);
    return done;
}

const char *kvl_progress_why(const kvl_progress *p)
{
    return p->message ? p->message : "failed (out of memory for why)";
}
