/* xfer.c: transfer objects: validation and planning at submit, progress
 * bookkeeping shared between the engine (writer) and callers (waiters).
 *
 * A transfer carries two references: the caller's handle and the engine's.
 * The engine drops its own once the transfer has finished and no frame or
 * receive touches its memory any more (sched.c, kvl_sched_reap).
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#define MAX_LAYERS KVL_MAX_LAYERS

int kvl_xfer_running(kvl_xfer *x)
{
    /* written only by the engine thread, which is the only caller */
    return x->prog.fin == KVL_XFER_RUNNING;
}

static void xfer_free(kvl_xfer *x)
{
    kvl_plan_free(&x->plan);
    free(x->segs);
    free(x->local_ptr);
    free(x->held);
    free(x->keys);
    free(x->key_used);
    free(x->notify);
    free(x->cstate);
    free(x->attempt);
    free(x->cpath);
    free(x->hpath);
    free(x->pattempt);
    free(x->hattempt);
    free(x->fails);
    free(x->powner);
    free(x->retry);
    kvl_progress_destroy(&x->prog);
    free(x);
}

kvl_err kvl_xfer_cancel(kvl_xfer *x, const char *why)
{
    if (!x)
        return kvl_fail(KVL_ERR_INVALID_ARG, "cancel: no transfer");
    kvl_cmd *cmd = calloc(1, sizeof *cmd);
    if (!cmd)
        return kvl_fail(KVL_ERR_NOMEM, "cancel: out of memory");
    atomic_fetch_add(&x->refs, 1); /* the command's, released by the engine */
    cmd->type = KVL_CMD_CANCEL;
    cmd->xfer = x;
    snprintf(cmd->error, sizeof cmd->error, "%s", why ? why : "");
    kvl_engine_post(x->agent, cmd);
    return KVL_OK;
}

void kvl_xfer_release(kvl_xfer *x)
{
    if (x && atomic_fetch_sub(&x->refs, 1) == 1)
        xfer_free(x);
}

/* Holds a reference on a local region for the transfer's lifetime, once per
 * distinct region. */
static kvl_err hold_local(kvl_agent *a, kvl_xfer *x, uint64_t id, uint64_t off, uint64_t len,
                          const char *what, kvl_region **out)
{
    for (size_t i = x->n_held; i-- > 0;) {
        kvl_region *r = x->held[i];
        if (r->id == id) {
            if (off > r->size || len > r->size - off)
                return kvl_fail(KVL_ERR_OUT_OF_BOUNDS,
                                "%s: bytes [%llu, %llu) lie outside local region %llu '%s' of "
                                "%llu bytes",
                                what, (unsigned long long)off, (unsigned long long)(off + len),
                                (unsigned long long)id, r->name, (unsigned long long)r->size);
            *out = r;
            return KVL_OK;
        }
    }
    kvl_region *r;
    kvl_err e = kvl_regions_acquire(&a->regions, id, off, len, 0, what, &r);
    if (e)
        return e;
    x->held[x->n_held++] = r;
    *out = r;
    return KVL_OK;
}

static const kvl_region_info *find_remote(kvl_peer *p, uint64_t id)
{
    return kvl_region_table_find(p->regions, p->n_regions, id);
}

int kvl_region_key_cmp(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = ((const kvl_rkey_entry *)b)->id;
    return x < y ? -1 : x > y;
}

static int by_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Copies the access key of every remote region the segments name into x
 * (sorted by id, each once): chunk frames carry them.  Segments name few
 * regions, mostly in runs (a paged KV push: one region, or one per layer),
 * so only the id of each run is sorted, not one per segment. */
static kvl_err take_keys(kvl_peer *p, kvl_xfer *x, int op, const kvl_segment *segs, size_t n)
{
    uint64_t *ids = malloc(n * sizeof *ids);
    size_t k = 0;
    for (size_t i = 0; ids && i < n; i++) {
        uint64_t id = op == KVL_OP_PUSH ? segs[i].dst_region : segs[i].src_region;
        if (k == 0 || ids[k - 1] != id)
            ids[k++] = id;
    }
    if (ids)
        qsort(ids, k, sizeof *ids, by_u64);
    x->keys = ids ? calloc(k ? k : 1, sizeof *x->keys) : NULL;
    if (!x->keys) {
        free(ids);
        return kvl_fail(KVL_ERR_NOMEM, "submit: out of memory for access keys");
    }
    size_t d = 0;
    for (size_t i = 0; i < k; i++)
        if (d == 0 || x->keys[d - 1].id != ids[i])
            x->keys[d++].id = ids[i];
    free(ids);
    k = d;
    x->n_keys = k;
    x->key_used = calloc(k, sizeof *x->key_used);
    if (!x->key_used)
        return kvl_fail(KVL_ERR_NOMEM, "submit: out of memory for access keys");
    kvl_err e = KVL_OK;
    pthread_mutex_lock(&p->mu);
    for (size_t i = 0, j = 0; i < k && !e; i++) {
        while (j < p->n_keys && p->keys[j].id < x->keys[i].id)
            j++;
        if (j < p->n_keys && p->keys[j].id == x->keys[i].id) {
            memcpy(x->keys[i].key, p->keys[j].key, KVL_KEY_BYTES);
            continue;
        }
        const kvl_region_info *r = find_remote(p, x->keys[i].id);
        e = kvl_fail(KVL_ERR_ACCESS_DENIED,
                     "peer '%s' region %llu '%s': no access key. A region's owner hands its "
                     "key out in its metadata: pass metadata the peer made after it "
                     "registered the region to add_peer() again",
                     p->name, (unsigned long long)x->keys[i].id, r ? r->name : "");
    }
    pthread_mutex_unlock(&p->mu);
    return e;
}

/* 1 if a payload of these segments is staged at either end (GPU memory, or
 * stage_host_memory here): decides the chunk size only, so a region the
 * peer's table lacks yet is not an error here (check_remote says so). */
static int staged_anywhere(kvl_agent *a, kvl_peer *p, int op, const kvl_segment *segs,
                           size_t n)
{
    if (a->cfg.stage_host_memory)
        return 1;
    int push = op == KVL_OP_PUSH, staged = 0;
    for (size_t i = 0; i < n && !staged; i++)
        staged = kvl_regions_mem(&a->regions, push ? segs[i].src_region : segs[i].dst_region) ==
                 KVL_MEM_CUDA;
    pthread_mutex_lock(&p->mu);
    for (size_t i = 0; i < n && !staged; i++) {
        const kvl_region_info *r = find_remote(p, push ? segs[i].dst_region : segs[i].src_region);
        staged = r && r->mem == KVL_MEM_CUDA;
    }
    pthread_mutex_unlock(&p->mu);
    return staged;
}

/* Checks the remote side of every segment against the peer's region table
 * as it stands (from the handshake or the last kvl_peer_refresh).  A region
 * the table lacks fails at once: submit never waits for the peer, so the
 * caller refreshes (blocking, in its own thread) and submits again. */
static kvl_err check_remote(kvl_peer *p, int op, kvl_xfer *x, const kvl_segment *segs,
                            size_t n)
{
    uint32_t need = op == KVL_OP_PUSH ? KVL_REMOTE_WRITE : KVL_REMOTE_READ;
    const char *side = op == KVL_OP_PUSH ? "dst" : "src";
    pthread_mutex_lock(&p->mu);
    kvl_err e = KVL_OK;
    for (size_t i = 0; i < n && !e; i++) {
        uint64_t id = op == KVL_OP_PUSH ? segs[i].dst_region : segs[i].src_region;
        uint64_t off = op == KVL_OP_PUSH ? segs[i].dst_offset : segs[i].src_offset;
        const kvl_region_info *r = find_remote(p, id);
        if (!r)
            e = kvl_fail(KVL_ERR_UNKNOWN_REGION,
                         "segments[%zu].%s_region: peer '%s' has no region %llu as of its "
                         "last region table (kvl_peer_refresh asks for the current one)",
                         i, side, p->name, (unsigned long long)id);
        else if (off > r->size || segs[i].len > r->size - off)
            e = kvl_fail(KVL_ERR_OUT_OF_BOUNDS,
                         "segments[%zu].%s: bytes [%llu, %llu) lie outside peer '%s' "
                         "region %llu '%s' of %llu bytes",
                         i, side, (unsigned long long)off,
                         (unsigned long long)(off + segs[i].len), p->name,
                         (unsigned long long)id, r->name, (unsigned long long)r->size);
        else if ((r->rights & need) != need)
            e = kvl_fail(KVL_ERR_ACCESS_DENIED,
                         "segments[%zu].%s_region: peer '%s' region %llu '%s' was "
                         "registered without %s",
                         i, side, p->name, (unsigned long long)id, r->name,
                         need == KVL_REMOTE_WRITE ? "remote_write=True" : "remote_read=True");
    }
    pthread_mutex_unlock(&p->mu);
    return e ? e : take_keys(p, x, op, segs, n);
}

/* ---- the caller's waits (progress.c), in the transfer's own words ---- */

static kvl_err xfer_timeout(const kvl_progress *p, int what, uint32_t layer, uint32_t timeout_ms)
{
    const kvl_xfer *x = p->owner;
    if (what == KVL_WAIT_LAYER)
        return kvl_fail(KVL_ERR_TIMEOUT, "layer %u of transfer %llu not ready after %u ms", layer,
                        (unsigned long long)x->id, timeout_ms);
    if (what == KVL_WAIT_EVENT)
        return kvl_fail(KVL_ERR_TIMEOUT, "no chunk of transfer %llu finished within %u ms",
                        (unsigned long long)x->id, timeout_ms);
    return kvl_fail(KVL_ERR_TIMEOUT, "transfer %llu still running after %u ms (%llu of %llu bytes)",
                    (unsigned long long)x->id, timeout_ms, (unsigned long long)p->bytes_done,
                    (unsigned long long)p->bytes_total);
}

static kvl_err xfer_failed(const kvl_progress *p)
{
    return kvl_fail((kvl_err)p->err, "%s", kvl_progress_why(p));
}

static kvl_err xfer_no_layer(const kvl_progress *p, uint32_t layer)
{
    return kvl_fail(KVL_ERR_INVALID_ARG, "layer %u: transfer %llu carries no bytes of it", layer,
                    (unsigned long long)((const kvl_xfer *)p->owner)->id);
}

static const kvl_progress_msgs xfer_msgs = {xfer_timeout, xfer_failed, xfer_no_layer};

static kvl_err alloc_state(kvl_xfer *x, uint64_t bytes_total)
{
    size_t nc = x->plan.n_chunks, nl = x->plan.n_layers;
    kvl_progress *pr = &x->prog;
    if (kvl_progress_alloc(pr, (uint32_t)nc, (uint32_t)nl, bytes_total))
        return kvl_fail(KVL_ERR_NOMEM, "submit: out of memory for %zu chunks", nc);
    x->cstate = calloc(nc, 1);
    x->attempt = calloc(nc, sizeof *x->attempt);
    x->cpath = calloc(nc, 1);
    x->hpath = malloc(nc);
    x->pattempt = calloc(nc, sizeof *x->pattempt);
    x->hattempt = calloc(nc, sizeof *x->hattempt);
    x->fails = calloc(nc, 1);
    x->powner = calloc(nc, sizeof *x->powner);
    x->retry = calloc(nc, sizeof *x->retry);
    if (!x->cstate || !x->attempt || !x->cpath || !x->retry || !x->hpath || !x->pattempt ||
        !x->hattempt || !x->fails || !x->powner)
        return kvl_fail(KVL_ERR_NOMEM, "submit: out of memory for %zu chunks", nc);
    memset(x->hpath, KVL_NO_PATH, nc);
    /* A layer no segment names is absent; the plan is layer-major, so a
     * chunk carries bytes of every present layer in its range. */
    memset(pr->layer_done, KVL_LAYER_ABSENT, nl);
    for (size_t i = 0; i < x->n_segs; i++)
        pr->layer_done[x->segs[i].layer] = KVL_LAYER_PENDING;
    for (size_t ci = 0; ci < nc; ci++) {
        pr->chunk_lf[ci] = x->plan.chunks[ci].layer_first;
        pr->chunk_ll[ci] = x->plan.chunks[ci].layer_last;
    }
    kvl_progress_start(pr);
    return KVL_OK;
}

kvl_err kvl_xfer_submit(kvl_agent *a, kvl_peer *p, int op, const kvl_segment *segs,
                        size_t n_segs, const void *notify, size_t notify_len,
                        uint32_t timeout_ms, kvl_xfer **out)
{
    kvl_clear_error();
    if (!a || !p || !out)
        return kvl_fail(KVL_ERR_INVALID_ARG, "submit: agent, peer and out must not be NULL");
    if (atomic_load(&a->closed))
        return kvl_fail(KVL_ERR_CLOSED, "submit: the agent is closed");
    if (op != KVL_OP_PUSH && op != KVL_OP_PULL)
        return kvl_fail(KVL_ERR_INVALID_ARG, "submit: op must be push or pull, not %d", op);
    if (notify_len > KVL_MAX_TAG || (notify_len && !notify))
        return kvl_fail(KVL_ERR_INVALID_ARG, "notify: the tag must be at most %d bytes",
                        KVL_MAX_TAG);
    if (p->replaced)
        return kvl_fail(KVL_ERR_UNKNOWN_PEER,
                        "peer '%s' was replaced by a newer connection; look it up again",
                        p->name);
    for (size_t i = 0; i < n_segs; i++)
        if (segs[i].layer >= MAX_LAYERS)
            return kvl_fail(KVL_ERR_INVALID_ARG, "segments[%zu].layer %u exceeds the %d limit",
                            i, segs[i].layer, MAX_LAYERS - 1);
    /* every path down is no refusal: the transfer waits in the engine for
     * one to come back, until its deadline (kvl_sched_check_reachable) */
    if (atomic_load(&p->gone))
        return kvl_fail(KVL_ERR_UNREACHABLE, "peer '%s' %s", p->name, p->gone_why);

    kvl_xfer *x = calloc(1, sizeof *x);
    if (!x)
        return kvl_fail(KVL_ERR_NOMEM, "submit: out of memory");
    kvl_progress_init(&x->prog, &xfer_msgs, x, 1);
    atomic_init(&x->refs, 2);
    x->op = op;
    x->peer = p;
    x->agent = a;
    /* staged payloads (GPU memory) go in smaller chunks, so the copy of one
     * overlaps the socket time of others (docs/api.md, "GPU memory") */
    uint64_t chunk = a->cfg.chunk_bytes, min_chunk = a->cfg.min_chunk_bytes;
    if (staged_anywhere(a, p, op, segs, n_segs) && a->cfg.stage_chunk_bytes &&
        a->cfg.stage_chunk_bytes < chunk) {
        chunk = a->cfg.stage_chunk_bytes;
        if (min_chunk > chunk)
            min_chunk = chunk;
    }
    kvl_err e = kvl_plan_make(segs, n_segs, p->n_paths, chunk, min_chunk, KVL_MAX_PIECES,
                              &x->plan);
    if (e)
        goto fail;
    if (x->plan.n_chunks > KVL_MAX_XFER_CHUNKS) {
        e = kvl_fail(KVL_ERR_INVALID_ARG,
                     "segments: the transfer needs %zu chunks of %llu bytes, more than the %d "
                     "a transfer may have; split it or raise chunk_bytes / min_chunk_bytes",
                     x->plan.n_chunks, (unsigned long long)x->plan.chunk_target,
                     KVL_MAX_XFER_CHUNKS);
        goto fail;
    }
    e = KVL_ERR_NOMEM;
    x->segs = malloc(n_segs * sizeof *x->segs);
    x->local_ptr = malloc(n_segs * sizeof *x->local_ptr);
    x->held = malloc(n_segs * sizeof *x->held);
    if (!x->segs || !x->local_ptr || !x->held) {
        kvl_fail(e, "submit: out of memory for %zu segments", n_segs);
        goto fail;
    }
    memcpy(x->segs, segs, n_segs * sizeof *segs);
    x->n_segs = n_segs;
    for (size_t i = 0; i < n_segs; i++) {
        char what[64];
        int push = op == KVL_OP_PUSH;
        snprintf(what, sizeof what, "segments[%zu].%s", i, push ? "src" : "dst");
        kvl_region *r = NULL;
        uint64_t id = push ? segs[i].src_region : segs[i].dst_region;
        uint64_t off = push ? segs[i].src_offset : segs[i].dst_offset;
        if ((e = hold_local(a, x, id, off, segs[i].len, what, &r)))
            goto fail;
        if (!push && (r->rights & KVL_LOCAL_READONLY)) {
            e = kvl_fail(KVL_ERR_ACCESS_DENIED,
                         "%s_region: local region %llu '%s' is read-only memory; pull into a "
                         "writable buffer",
                         what, (unsigned long long)id, r->name);
            goto fail;
        }
        x->local_ptr[i] = r->base + off;
        int k = kvl_stage_kind(a, r->mem);
        if (k > x->stage)
            x->stage = k;
    }
    if ((e = check_remote(p, op, x, segs, n_segs)))
        goto fail;
    uint64_t bytes_total = 0;
    for (size_t i = 0; i < n_segs; i++)
        bytes_total += segs[i].len;
    if ((e = alloc_state(x, bytes_total)))
        goto fail;
    if (notify_len) {
        x->notify = malloc(notify_len);
        if (!x->notify) {
            e = kvl_fail(KVL_ERR_NOMEM, "submit: out of memory");
            goto fail;
        }
        memcpy(x->notify, notify, notify_len);
        x->notify_len = (uint32_t)notify_len;
    }
    kvl_cmd *cmd = calloc(1, sizeof *cmd);
    if (!cmd) {
        e = kvl_fail(KVL_ERR_NOMEM, "submit: out of memory");
        goto fail;
    }
    uint64_t now = kvl_now_ns();
    x->deadline_ns = timeout_ms ? now + (uint64_t)timeout_ms * 1000000ull : 0;
    x->bytes_pending = bytes_total;
    x->t_submit_ns = now;
    cmd->type = KVL_CMD_SUBMIT;
    cmd->xfer = x;
    pthread_mutex_lock(&a->mu);
    x->id = ++a->next_xfer_id;
    pthread_mutex_unlock(&a->mu);
    kvl_engine_post(a, cmd);
    *out = x;
    return KVL_OK;
fail:
    for (size_t i = 0; i < x->n_held; i++)
        kvl_regions_release(&a->regions, x->held[i]);
    xfer_free(x);
    return e;
}

void kvl_xfer_announce(kvl_xfer *x, kvl_buf *b, uint64_t now)
{
    size_t nc = x->plan.n_chunks;
    uint64_t left_ms = 0;
    if (x->deadline_ns)
        left_ms = x->deadline_ns > now ? (x->deadline_ns - now) / 1000000ull + 1 : 1;
    kvl_msg_announce m = {
        .xfer = x->id,
        .bytes = x->prog.bytes_total, /* fixed at submit */
        .n_chunks = (uint32_t)nc,
        .n_layers = x->plan.n_layers,
        .timeout_ms = left_ms > UINT32_MAX ? UINT32_MAX : (uint32_t)left_ms,
        .tag_len = x->notify_len,
        .tag = x->notify,
    };
    kvl_frame_start(b);
    kvl_enc_announce(b, &m, x->prog.chunk_lf, x->prog.chunk_ll); /* fixed at submit */
    kvl_frame_finish(b, KVL_F_ANNOUNCE, 0);
}

void kvl_xfer_chunk_done(kvl_xfer *x, uint32_t ci, uint32_t path, uint64_t now)
{
    kvl_progress_chunk_done(&x->prog, ci, path, x->plan.chunks[ci].bytes, now);
}

void kvl_xfer_set_failed(kvl_xfer *x, kvl_err err, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    kvl_progress_vfail(&x->prog, err, fmt, ap);
    va_end(ap);
}

void kvl_xfer_publish(kvl_xfer *x) { kvl_progress_publish(&x->prog); }

kvl_err kvl_xfer_wait(kvl_xfer *x, uint32_t timeout_ms)
{
    return kvl_progress_wait(&x->prog, timeout_ms);
}

kvl_err kvl_xfer_wait_layer(kvl_xfer *x, uint32_t layer, uint32_t timeout_ms)
{
    return kvl_progress_wait_layer(&x->prog, layer, timeout_ms);
}

kvl_err kvl_xfer_next_event(kvl_xfer *x, uint32_t timeout_ms, kvl_chunk_event *ev)
{
    return kvl_progress_next_event(&x->prog, timeout_ms, ev);
}

kvl_err kvl_xfer_info_get(kvl_xfer *x, kvl_xfer_info *out)
{
    kvl_clear_error();
    kvl_progress_snap s;
    kvl_progress_get(&x->prog, &s, out->message, sizeof out->message);
    out->id = x->id;
    out->state = s.state;
    out->err = s.err;
    out->bytes_total = s.bytes_total;
    out->bytes_done = s.bytes_done;
    out->chunks_total = s.chunks_total;
    out->chunks_done = s.chunks_done;
    out->layers = s.layers;
    out->retries = atomic_load_explicit(&x->retries, memory_order_relaxed);
    out->t_submit_ns = x->t_submit_ns;
    out->t_first_byte_ns = s.t_first_byte_ns;
    out->t_first_layer_ns = s.t_first_layer_ns;
    out->t_done_ns = s.t_done_ns;
    return KVL_OK;
}
