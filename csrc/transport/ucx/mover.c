/* mover.c: the UCX mover (transport.h; docs/ucx.md).
 *
 * One-sided: a data path stays one stream connection; it carries the
 * handshake, the MOVER_* set-up frames, every frame's header and body, the
 * crc32c trailers and the ACKs.  When the set-up succeeded, DATA payloads go
 * by UCX put into the listener's regions, and READ_RESP payloads by put into
 * the initiator's (a READ_REQ with the DST flag names where); the trailer
 * follows the flush.  A path whose set-up was refused or failed keeps
 * carrying payloads in-stream: that is the per-path fallback, on the same NIC.
 *
 * Set-up (after the handshake, which proved the cluster secret):
 *   initiator: MOVER_OFFER(ucx: its worker address, a key for each of its
 *              host regions: pull destinations)           -- ucx_start
 *   listener:  MOVER_ACCEPT(ucx: its worker address, a key for every region
 *              peers may write) or MOVER_REFUSE(ucx: status, why)  -- ucx_answer
 *
 * Threads: ucx_start runs on the thread that opens the connection (add_peer's
 * helper threads, the prober), on a detached endpoint nothing else touches;
 * everything else runs on the engine thread (the mover has no
 * KVL_MV_RECEIVER_PULLED side and the stream keeps one-sided frames off its
 * I/O threads).
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "../../internal.h"
#include "msg.h"
#include "ucx.h"

typedef struct upkey {
    uint64_t region;
    uint64_t size; /* the region's size the key was packed with */
    kvl_ucx_rkey *k;
} upkey;

typedef struct kvl_ucx_path {
    kvl_agent *a;
    kvl_ep *ep;         /* the stream endpoint it rides on */
    char note[128];     /* what carries the payloads and why (paths()) */
    uint64_t t_event_ns; /* the worker's last event: progress for the path's samples */
    int watched;        /* the worker's fd is in the event loop (watch_fd) */
    kvl_ucx_worker *w;
    kvl_ucx_ep *uep;
    kvl_ucx_mem **maps; /* our regions mapped in w's context */
    uint64_t *map_ids;  /* ... their region ids, ascending */
    uint32_t n_maps, cap_maps;
    uint32_t need;      /* rights a region needs to be shown: KVL_REMOTE_WRITE at the
                           listener (push destinations), 0 at the initiator (pulls) */
    upkey *keys;        /* the peer's regions, by id ascending */
    uint32_t n_keys;
} kvl_ucx_path;

extern const kvl_mover_ops kvl_ucx_mover;

static kvl_ucx_path *U(kvl_mover *m) { return (kvl_ucx_path *)m; }
static const kvl_ucx_path *CU(const kvl_mover *m) { return (const kvl_ucx_path *)m; }

/* UCX's TCP moves a put in segments of TCP_TX_SEG_SIZE (8 KiB by default):
 * 1 MiB made put 3.6x faster here (docs/BENCHMARKS.md). */
static const char *const worker_opts[] = {"TCP_TX_SEG_SIZE", "1m", "TCP_RX_SEG_SIZE", "1m", NULL};

static void path_destroy(kvl_ucx_path *u, uint32_t timeout_ms)
{
    if (!u)
        return;
    if (u->watched) /* its event may be pending: the stream keeps the watch's memory */
        u->a->stream->unwatch_fd(u->ep, kvl_ucx_worker_fd(u->w));
    for (uint32_t i = 0; i < u->n_keys; i++)
        kvl_ucx_rkey_destroy(u->keys[i].k);
    free(u->keys);
    if (u->uep)
        kvl_ucx_ep_close(u->uep, 1, timeout_ms);
    for (uint32_t i = 0; i < u->n_maps; i++)
        kvl_ucx_mem_unmap(u->maps[i]);
    free(u->maps);
    free(u->map_ids);
    kvl_ucx_worker_destroy(u->w);
    free(u);
}

/* A worker on the device that holds local (an IPv4 address). */
static kvl_err path_new(kvl_agent *a, kvl_ep *ep, const char *local, kvl_ucx_path **out)
{
    *out = NULL;
    char dev[64];
    kvl_err e = kvl_ucx_netdev_of(local, dev, sizeof dev);
    if (e)
        return e;
    kvl_ucx_path *u = calloc(1, sizeof *u);
    if (!u)
        return kvl_fail(KVL_ERR_NOMEM, "UCX: out of memory");
    u->a = a;
    u->ep = ep;
    if ((e = kvl_ucx_worker_create(dev, worker_opts, &u->w))) {
        free(u);
        return e;
    }
    *out = u;
    return KVL_OK;
}

/* Unpacks the peer's keys (a decoded SETUP, ids ascending) on u->uep. */
static kvl_err take_keys(kvl_ucx_path *u, const kvl_ucx_setup *s)
{
    if (!s->n_keys)
        return KVL_OK;
    u->keys = calloc(s->n_keys, sizeof *u->keys);
    if (!u->keys)
        return kvl_fail(KVL_ERR_NOMEM, "UCX: out of memory for %u keys", s->n_keys);
    for (uint32_t i = 0; i < s->n_keys; i++) {
        const kvl_ucx_key_view *kv = &s->keys[i];
        kvl_err e = kvl_ucx_rkey_unpack(u->uep, kv->key, kv->key_len, kv->base, kv->size,
                                        &u->keys[i].k);
        if (e)
            return kvl_fail(e, "UCX: key of region %llu: %s", (unsigned long long)kv->region,
                            kvl_last_error());
        u->keys[i].region = kv->region;
        u->keys[i].size = kv->size;
        u->n_keys = i + 1;
    }
    return KVL_OK;
}

static const upkey *key_of(const kvl_ucx_path *u, uint64_t region)
{
    uint32_t lo = 0, hi = u->n_keys;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (u->keys[mid].region == region)
            return &u->keys[mid];
        if (u->keys[mid].region < region)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

static kvl_err map_regions(kvl_agent *a, kvl_ucx_path *u, uint32_t need, kvl_ucx_key_view **out,
                           uint32_t *n, uint8_t **blobs);

/* ---- initiator ---- */

/* Starts a MOVER_* frame of this mover: its kind byte first. */
static void frame_begin(kvl_buf *b)
{
    uint8_t k = KVL_MOVER_UCX;
    kvl_frame_start(b);
    kvl_buf_put(b, &k, 1);
}

static void note_set(kvl_ucx_path *u)
{
    snprintf(u->note, sizeof u->note, "UCX %s, %u remote keys, %u regions mapped",
             kvl_ucx_version(), u->n_keys, u->n_maps);
}

static kvl_err ucx_start(kvl_agent *a, kvl_ep *ep, const char *local, uint64_t deadline_ns,
                         kvl_mover **out, char *note, size_t note_len)
{
    const kvl_stream_ops *st = a->stream;
    *out = NULL;
    kvl_ucx_path *u = NULL;
    uint8_t addr[KVL_UCX_ADDR_MAX];
    size_t addr_len = 0;
    kvl_ucx_key_view *keys = NULL;
    uint8_t *blobs = NULL;
    uint32_t n_keys = 0;
    kvl_err e = path_new(a, ep, local, &u);
    if (!e)
        e = kvl_ucx_worker_address(u->w, addr, sizeof addr, &addr_len);
    /* our host regions, where the peer puts what we pull: any region may be a
     * pull's destination (registered later: in-stream until the path's next
     * set-up) */
    if (!e)
        e = map_regions(a, u, 0, &keys, &n_keys, &blobs);
    kvl_buf b = {0};
    frame_begin(&b);
    if (e) {
        /* no UCX here: say so to the listener, which keeps the path in-stream too */
        snprintf(note, note_len, "UCX not set up here: %s", kvl_last_error());
        path_destroy(u, 0);
        u = NULL;
        kvl_ucx_enc_setup(&b, NULL, 0, NULL, 0); /* addr_len 0: refused by the decoder */
    } else {
        if (kvl_ucx_enc_setup(&b, addr, (uint16_t)addr_len, keys, n_keys))
            b.oom = 1;
    }
    free(keys);
    free(blobs);
    kvl_frame_finish(&b, KVL_F_MOVER_OFFER, 0);
    e = b.oom ? kvl_fail(KVL_ERR_NOMEM, "MOVER_OFFER: out of memory")
              : st->send_all(ep, b.p, b.len, deadline_ns);
    kvl_buf_free(&b);
    if (e) {
        path_destroy(u, 0);
        return e;
    }
    /* the listener answers MOVER_REFUSE to an empty offer: read it too */
    uint8_t hdr[KVL_HDR_BYTES];
    kvl_frame_hdr h;
    if ((e = st->recv_all(ep, hdr, sizeof hdr, deadline_ns)) || (e = kvl_hdr_decode(hdr, &h))) {
        path_destroy(u, 0);
        return e;
    }
    if ((h.type != KVL_F_MOVER_ACCEPT && h.type != KVL_F_MOVER_REFUSE) || h.payload_len ||
        h.flags || h.body_len < 1) {
        path_destroy(u, 0);
        return kvl_fail(KVL_ERR_PROTOCOL, "the answer to MOVER_OFFER is frame type %u", h.type);
    }
    uint8_t *body = malloc(h.body_len);
    if (!body) {
        path_destroy(u, 0);
        return kvl_fail(KVL_ERR_NOMEM, "UCX: out of memory for an answer of %u bytes",
                        h.body_len);
    }
    if ((e = st->recv_all(ep, body, h.body_len, deadline_ns))) {
        free(body);
        path_destroy(u, 0);
        return e;
    }
    if (kvl_crc32c(0, body, h.body_len) != h.body_crc || body[0] != KVL_MOVER_UCX) {
        const char *why = body[0] != KVL_MOVER_UCX ? "not for the UCX mover"
                                                   : "body failed its crc32c check";
        free(body);
        path_destroy(u, 0);
        return kvl_fail(KVL_ERR_PROTOCOL, "UCX answer: %s", why);
    }
    if (h.type == KVL_F_MOVER_REFUSE) {
        uint32_t st_code = 0;
        char msg[256];
        e = kvl_ucx_dec_refuse(body + 1, h.body_len - 1, &st_code, msg);
        free(body);
        if (!e && u)
            snprintf(note, note_len, "the peer refused UCX: %s", msg);
        path_destroy(u, 0);
        return e; /* the path stays in-stream */
    }
    if (!u) { /* we offered nothing: an ACCEPT is a broken peer */
        free(body);
        return kvl_fail(KVL_ERR_PROTOCOL, "MOVER_ACCEPT to an empty offer");
    }
    kvl_ucx_setup s;
    if ((e = kvl_ucx_dec_setup(body + 1, h.body_len - 1, 1, &s))) {
        free(body);
        path_destroy(u, 0);
        return e;
    }
    /* from here on a failure leaves the path in-stream: the listener set up
     * its end and keeps it unused until the connection ends */
    kvl_err ue = kvl_ucx_ep_create(u->w, s.addr, s.addr_len, &u->uep);
    if (!ue)
        ue = take_keys(u, &s);
    kvl_ucx_setup_free(&s);
    free(body);
    if (ue) {
        snprintf(note, note_len, "UCX set-up failed, running TCP: %s", kvl_last_error());
        path_destroy(u, 0);
        return KVL_OK;
    }
    note_set(u);
    *out = (kvl_mover *)u;
    return KVL_OK;
}

static int ucx_check(kvl_mover *m, const kvl_region_info *regions, size_t n, char *note,
                     size_t note_len)
{
    kvl_ucx_path *u = U(m);
    /* A key for a region the table does not list (registered after the
     * table was read) stays: no chunk can name that region before the table
     * does, and then this check has not seen it -- but the put bounds are
     * the key's own, which the region table's bounds on every chunk keep
     * within (xfer.c), and a key smaller than the table's region would fail
     * a put with KVL_ERR_OUT_OF_BOUNDS, not place out of range. */
    for (uint32_t i = 0; i < u->n_keys; i++) {
        char why[sizeof u->note];
        if (kvl_region_learnt_ok(regions, n, u->keys[i].region, u->keys[i].size, "UCX", why,
                                 sizeof why))
            continue;
        kvl_log(u->a, KVL_LOG_WARNING, NULL, -1, "%s", why);
        snprintf(note, note_len, "%s", why);
        return -1;
    }
    return 0;
}

static void ucx_note(const kvl_mover *m, char *out, size_t len)
{
    snprintf(out, len, "%s", CU(m)->note);
}

/* ---- listener ---- */

static int refuse(kvl_agent *a, kvl_ep *ep, uint32_t status, const char *why)
{
    kvl_buf b = {0};
    frame_begin(&b);
    kvl_ucx_enc_refuse(&b, status, why);
    kvl_frame_finish(&b, KVL_F_MOVER_REFUSE, 0);
    kvl_tp_frame f = {.head = b};
    return a->stream->send(ep, &f) == 0 ? 0 : -1;
}

/* The address of ep's local end (dotted quad). */
static int local_ip(kvl_agent *a, const kvl_ep *ep, char *out, size_t len)
{
    struct sockaddr_storage l, p;
    if (a->stream->addrs(ep, &l, &p) != 0 || l.ss_family != AF_INET)
        return -1;
    const struct sockaddr_in *sa = (const struct sockaddr_in *)&l;
    return inet_ntop(AF_INET, &sa->sin_addr, out, (socklen_t)len) ? 0 : -1;
}

/* Maps every host region with the rights need (all host regions when 0)
 * into u's context; keys (ids ascending, as the region table is sorted) go
 * to *out (caller frees *out and *blobs). */
static kvl_err map_regions(kvl_agent *a, kvl_ucx_path *u, uint32_t need, kvl_ucx_key_view **out,
                           uint32_t *n, uint8_t **blobs)
{
    *out = NULL;
    *n = 0;
    *blobs = NULL;
    kvl_regions *t = &a->regions;
    pthread_mutex_lock(&t->mu);
    size_t cap = t->n ? t->n : 1;
    kvl_ucx_key_view *v = calloc(cap, sizeof *v);
    uint8_t *bl = calloc(cap, KVL_UCX_RKEY_MAX);
    u->maps = calloc(cap, sizeof *u->maps);
    u->map_ids = calloc(cap, sizeof *u->map_ids);
    u->cap_maps = (uint32_t)cap;
    u->need = need;
    kvl_err e = v && bl && u->maps && u->map_ids ? KVL_OK
                                                 : kvl_fail(KVL_ERR_NOMEM, "UCX: out of memory");
    for (size_t i = 0; !e && i < t->n && *n < KVL_UCX_MAX_KEYS; i++) {
        kvl_region *r = t->v[i];
        if ((r->rights & need) != need || r->mem != KVL_MEM_HOST)
            continue;
        uint8_t *key = bl + (size_t)*n * KVL_UCX_RKEY_MAX;
        uint32_t key_len = 0;
        if ((e = kvl_ucx_mem_map(u->w, r->base, r->size, &u->maps[u->n_maps], key, &key_len)))
            break;
        u->map_ids[u->n_maps++] = r->id;
        v[*n] = (kvl_ucx_key_view){.region = r->id,
                                   .base = (uint64_t)(uintptr_t)r->base,
                                   .size = r->size,
                                   .key = key,
                                   .key_len = (uint16_t)key_len};
        (*n)++;
    }
    pthread_mutex_unlock(&t->mu);
    *out = v;
    *blobs = bl;
    return e;
}

static int ucx_attach(kvl_mover *m, kvl_ep *ep);

static int ucx_answer(kvl_agent *a, kvl_ep *ep, const uint8_t *body, size_t len, int proven)
{
    if (!proven)
        return refuse(a, ep, KVL_ERR_AUTH,
                      "UCX is set up only between agents holding a cluster secret");
    if (a->cfg.transport != KVL_TRANSPORT_UCX) {
        char why[96];
        snprintf(why, sizeof why, "agent '%s' runs transport='%s'", a->name,
                 a->cfg.transport == KVL_TRANSPORT_TCP     ? "tcp"
                 : a->cfg.transport == KVL_TRANSPORT_FAULT ? "fault"
                                                           : "auto");
        return refuse(a, ep, KVL_ERR_INVALID_ARG, why);
    }
    kvl_ucx_setup s;
    if (kvl_ucx_dec_setup(body, len, 1, &s)) {
        char why[200];
        snprintf(why, sizeof why, "MOVER_OFFER: %s", kvl_last_error());
        return refuse(a, ep, KVL_ERR_PROTOCOL, why);
    }
    char ip[64];
    kvl_ucx_path *u = NULL;
    kvl_ucx_key_view *keys = NULL;
    uint8_t *blobs = NULL;
    uint32_t n_keys = 0;
    uint8_t addr[KVL_UCX_ADDR_MAX];
    size_t addr_len = 0;
    kvl_err e = local_ip(a, ep, ip, sizeof ip) ? kvl_fail(KVL_ERR_SYSTEM, "getsockname failed")
                                               : path_new(a, ep, ip, &u);
    if (!e)
        e = kvl_ucx_worker_address(u->w, addr, sizeof addr, &addr_len);
    if (!e)
        e = kvl_ucx_ep_create(u->w, s.addr, s.addr_len, &u->uep);
    if (!e) /* the initiator's regions: where READ_RESP payloads go by put */
        e = take_keys(u, &s);
    if (!e)
        e = map_regions(a, u, KVL_REMOTE_WRITE, &keys, &n_keys, &blobs);
    kvl_ucx_setup_free(&s);
    kvl_buf b = {0};
    if (!e) {
        frame_begin(&b);
        e = kvl_ucx_enc_setup(&b, addr, (uint16_t)addr_len, keys, n_keys);
        kvl_frame_finish(&b, KVL_F_MOVER_ACCEPT, 0);
        if (!e && b.oom)
            e = kvl_fail(KVL_ERR_NOMEM, "MOVER_ACCEPT: out of memory");
    }
    free(keys);
    free(blobs);
    if (e) {
        char why[200];
        snprintf(why, sizeof why, "UCX set-up failed at '%s': %s", a->name, kvl_last_error());
        kvl_buf_free(&b);
        path_destroy(u, a->cfg.connect_timeout_ms);
        return refuse(a, ep, e, why);
    }
    snprintf(u->note, sizeof u->note, "UCX %s, %u regions mapped, %u remote keys",
             kvl_ucx_version(), u->n_maps, u->n_keys);
    if (ucx_attach((kvl_mover *)u, ep)) {
        /* the answer is not sent yet: refuse instead, and stay in-stream */
        kvl_buf_free(&b);
        path_destroy(u, a->cfg.connect_timeout_ms);
        return refuse(a, ep, KVL_ERR_SYSTEM, "UCX: cannot watch the worker");
    }
    a->stream->set_mover(ep, &kvl_ucx_mover, (kvl_mover *)u, NULL);
    kvl_tp_frame f = {.head = b};
    return a->stream->send(ep, &f) == 0 ? 1 : -1;
}

/* ---- engine ---- */

/* The worker's fd fired: progress it (the stream then lets a frame waiting
 * for its flush go on). */
static void on_worker(void *arg)
{
    kvl_ucx_path *u = arg;
    while (kvl_ucx_worker_progress(u->w) == 0)
        ;
    u->t_event_ns = kvl_now_ns();
}

static int ucx_attach(kvl_mover *m, kvl_ep *ep)
{
    kvl_ucx_path *u = U(m);
    if (u->watched)
        return 0;
    u->ep = ep;
    if (u->a->stream->watch_fd(ep, kvl_ucx_worker_fd(u->w), on_worker, u) != 0)
    {
        kvl_fail(KVL_ERR_SYSTEM, "UCX: cannot watch the worker");
        return -1;
    }
    u->watched = 1;
    /* events may have arrived before the watch: progress and arm now */
    while (kvl_ucx_worker_progress(u->w) == 0)
        ;
    return 0;
}

static void ucx_sample(const kvl_mover *m, kvl_tp_sample *out)
{
    /* payloads move on the worker: its events are the path's progress */
    const kvl_ucx_path *u = CU(m);
    uint64_t now = kvl_now_ns();
    uint64_t ms = u->t_event_ns && now > u->t_event_ns ? (now - u->t_event_ns) / 1000000ull
                                                       : UINT32_MAX;
    if (ms < out->last_ack_recv_ms)
        out->last_ack_recv_ms = (uint32_t)ms;
    if (ms < out->last_data_recv_ms)
        out->last_data_recv_ms = (uint32_t)ms;
}

/* Closes the UCP endpoint at once (force: nothing more lands or is read
 * through it; bounded by timeout_ms), unmaps, frees the worker. */
static void ucx_free(kvl_mover *m, uint32_t timeout_ms) { path_destroy(U(m), timeout_ms); }

static int ucx_covers(const kvl_mover *m, const kvl_tp_frame *f)
{
    const kvl_ucx_path *u = CU(m);
    const kvl_wire_piece *dst = f->dst;
    if (!u->uep || !dst)
        return 0;
    const upkey *k = NULL;
    for (uint32_t i = 0; i < f->n_dst; i++) {
        if (!k || dst[i].region != k->region)
            k = key_of(u, dst[i].region);
        /* the key's own bounds (a pull's pieces come from the peer, a push's
         * from our checked plan): out of them, the frame goes in-stream */
        if (!k || dst[i].offset > k->size || dst[i].len > k->size - dst[i].offset)
            return 0;
    }
    return 1;
}

/* Posts the puts of one frame (its payload to its pieces, same total),
 * folds the source into the crc and starts a flush: the ticket. */
static kvl_err ucx_post(kvl_mover *m, kvl_mv_send *ms)
{
    kvl_ucx_path *u = U(m);
    const kvl_tp_frame *f = ms->f;
    const struct iovec *src = ms->src;
    int n_src = ms->n_src;
    int si = 0;
    size_t soff = 0;
    uint64_t total = 0;
    ms->crc = 0;
    for (uint32_t i = 0; i < f->n_dst; i++) {
        const upkey *uk = key_of(u, f->dst[i].region);
        kvl_ucx_rkey *k = uk ? uk->k : NULL;
        if (!k)
            return kvl_fail(KVL_ERR_UNKNOWN_REGION, "no UCX remote key for region %llu",
                            (unsigned long long)f->dst[i].region);
        uint64_t off = f->dst[i].offset, left = f->dst[i].len;
        while (left) {
            if (si >= n_src)
                return kvl_fail(KVL_ERR_INVALID_ARG, "UCX: payload shorter than its pieces");
            size_t take = src[si].iov_len - soff;
            if (take > left)
                take = (size_t)left;
            const uint8_t *p = (const uint8_t *)src[si].iov_base + soff;
            kvl_err e = kvl_ucx_put(u->uep, p, take, k, off);
            if (e)
                return kvl_fail(e, "UCX put: %s", kvl_last_error());
            ms->crc = kvl_crc32c(ms->crc, p, take);
            off += take;
            left -= take;
            total += take;
            soff += take;
            if (soff == src[si].iov_len) {
                si++;
                soff = 0;
            }
        }
    }
    if (total != f->payload_len)
        return kvl_fail(KVL_ERR_INVALID_ARG, "UCX: pieces hold %llu bytes, the payload %llu",
                        (unsigned long long)total, (unsigned long long)f->payload_len);
    kvl_err e = kvl_ucx_flush_start(u->uep, &ms->ticket);
    return e ? kvl_fail(e, "UCX flush: %s", kvl_last_error()) : KVL_OK;
}

static int ucx_ready(kvl_mover *m, uint64_t seq, char *why, size_t why_len)
{
    kvl_ucx_path *u = U(m);
    if (kvl_ucx_flushed(u->uep) >= seq)
        return 1;
    return kvl_ucx_ep_status(u->uep, why, why_len) != 0 ? -1 : 0;
}

static int ucx_wait(kvl_mover *m, uint64_t seq, uint64_t deadline_ns)
{
    kvl_ucx_path *u = U(m);
    for (;;) {
        int r = ucx_ready(m, seq, NULL, 0);
        if (r)
            return r;
        if (kvl_now_ns() >= deadline_ns)
            return 0;
        kvl_ucx_worker_progress(u->w);
    }
}

/* Over UCX's TCP nothing is placed but by our worker's progress; on RDMA the
 * unmapped memory invalidates the keys: the stream frees the mover right
 * after this, which closes the endpoint by force before anything more lands. */
static void ucx_fence(kvl_mover *m, const char *why)
{
    kvl_ucx_path *u = U(m);
    snprintf(u->note, sizeof u->note, "UCX fenced: %s", why);
}

static kvl_err ucx_usable(const kvl_config *cfg, uint32_t secret_len)
{
    (void)cfg;
    if (!secret_len)
        return kvl_fail(KVL_ERR_INVALID_ARG,
                        "config.transport UCX needs a cluster secret: libucp parses a peer's "
                        "worker address unchecked, so UCX is set up only between agents that "
                        "proved the secret (docs/ucx.md)");
    if (!kvl_ucx_loaded_version()[0])
        return kvl_fail(KVL_ERR_INVALID_ARG,
                        "config.transport UCX: UCX is not loaded (kvl_ucx_load_lib first)");
    return KVL_OK;
}

/* ---- regions registered or deregistered after the set-up (step 3) ---- */

/* Sorted insert of the peer's keys in s (ids ascending) into u->keys. */
static kvl_err add_keys(kvl_ucx_path *u, const kvl_ucx_setup *s)
{
    if ((uint64_t)u->n_keys + s->n_keys > KVL_UCX_MAX_KEYS)
        return kvl_fail(KVL_ERR_PROTOCOL, "UCX_KEYS: %u keys more than the %u held pass the "
                        "limit of %d", s->n_keys, u->n_keys, KVL_UCX_MAX_KEYS);
    for (uint32_t i = 0; i < s->n_keys; i++)
        if (key_of(u, s->keys[i].region))
            return kvl_fail(KVL_ERR_PROTOCOL, "UCX_KEYS: region %llu has a key on this path "
                            "already", (unsigned long long)s->keys[i].region);
    upkey *nk = calloc((size_t)u->n_keys + s->n_keys, sizeof *nk);
    if (!nk)
        return kvl_fail(KVL_ERR_NOMEM, "UCX: out of memory for %u keys", u->n_keys + s->n_keys);
    uint32_t n = 0, a = 0;
    kvl_err e = KVL_OK;
    for (uint32_t b = 0; b < s->n_keys; b++) {
        const kvl_ucx_key_view *kv = &s->keys[b];
        while (a < u->n_keys && u->keys[a].region < kv->region)
            nk[n++] = u->keys[a++];
        kvl_ucx_rkey *k = NULL;
        if ((e = kvl_ucx_rkey_unpack(u->uep, kv->key, kv->key_len, kv->base, kv->size, &k))) {
            e = kvl_fail(e, "UCX_KEYS: key of region %llu: %s", (unsigned long long)kv->region,
                         kvl_last_error());
            break;
        }
        nk[n++] = (upkey){.region = kv->region, .size = kv->size, .k = k};
    }
    if (e) { /* the new ones unpacked so far go; the old ones stay */
        for (uint32_t i = 0; i < n; i++)
            if (!key_of(u, nk[i].region))
                kvl_ucx_rkey_destroy(nk[i].k);
        free(nk);
        return e;
    }
    while (a < u->n_keys)
        nk[n++] = u->keys[a++];
    free(u->keys);
    u->keys = nk;
    u->n_keys = n;
    return KVL_OK;
}

static int ucx_keys(kvl_mover *m, const uint8_t *body, size_t len)
{
    kvl_ucx_path *u = U(m);
    kvl_ucx_setup s;
    if (kvl_ucx_dec_setup(body, len, 0, &s))
        return -1;
    /* fenced or dropped since: the keys have nothing to go with */
    kvl_err e = u && u->uep ? add_keys(u, &s) : KVL_OK;
    kvl_ucx_setup_free(&s);
    if (e == KVL_ERR_PROTOCOL)
        return -1;
    if (e) /* a key libucp refuses, or no memory: that region goes in-stream */
        kvl_log(u->a, KVL_LOG_WARNING, NULL, -1, "%s", kvl_last_error());
    else
        note_set(u);
    return 0;
}

static void ucx_sync(kvl_mover *m)
{
    kvl_ucx_path *u = U(m);
    if (!u->map_ids)
        return;
    kvl_agent *a = u->a;
    kvl_regions *t = &a->regions;
    pthread_mutex_lock(&t->mu);
    /* gone: unmapped now (the table and u->map_ids are both ascending) */
    uint32_t keep = 0;
    for (uint32_t i = 0, j = 0; i < u->n_maps; i++) {
        while (j < t->n && t->v[j]->id < u->map_ids[i])
            j++;
        if (j < t->n && t->v[j]->id == u->map_ids[i]) {
            u->maps[keep] = u->maps[i];
            u->map_ids[keep++] = u->map_ids[i];
        } else {
            kvl_ucx_mem_unmap(u->maps[i]);
            kvl_log(a, KVL_LOG_INFO, NULL, -1,
                    "UCX: region %llu deregistered: unmapped from a path's context",
                    (unsigned long long)u->map_ids[i]);
        }
    }
    u->n_maps = keep;
    /* new: ids above every mapped one (ids are never reused) */
    uint64_t last = u->n_maps ? u->map_ids[u->n_maps - 1] : 0;
    size_t fresh = 0;
    for (size_t j = 0; j < t->n; j++)
        if (t->v[j]->id > last && (t->v[j]->rights & u->need) == u->need &&
            t->v[j]->mem == KVL_MEM_HOST)
            fresh++;
    if (!fresh || u->n_maps + fresh > KVL_UCX_MAX_KEYS) {
        pthread_mutex_unlock(&t->mu);
        return;
    }
    kvl_ucx_key_view *v = calloc(fresh, sizeof *v);
    uint8_t *bl = calloc(fresh, KVL_UCX_RKEY_MAX);
    if (u->n_maps + fresh > u->cap_maps) {
        uint32_t ncap = (uint32_t)(u->n_maps + fresh) * 2;
        kvl_ucx_mem **nm = realloc(u->maps, ncap * sizeof *nm);
        if (nm)
            u->maps = nm;
        uint64_t *ni = nm ? realloc(u->map_ids, ncap * sizeof *ni) : NULL;
        if (ni) {
            u->map_ids = ni;
            u->cap_maps = ncap;
        }
    }
    uint32_t n = 0;
    for (size_t j = 0; v && bl && u->n_maps + fresh <= u->cap_maps && j < t->n; j++) {
        kvl_region *r = t->v[j];
        if (r->id <= last || (r->rights & u->need) != u->need || r->mem != KVL_MEM_HOST)
            continue;
        uint8_t *key = bl + (size_t)n * KVL_UCX_RKEY_MAX;
        uint32_t key_len = 0;
        if (kvl_ucx_mem_map(u->w, r->base, r->size, &u->maps[u->n_maps], key, &key_len)) {
            kvl_log(a, KVL_LOG_WARNING, NULL, -1, "UCX: region %llu not mapped (%s): it goes "
                    "in-stream on this path", (unsigned long long)r->id, kvl_last_error());
            continue;
        }
        u->map_ids[u->n_maps++] = r->id;
        v[n++] = (kvl_ucx_key_view){.region = r->id,
                                    .base = (uint64_t)(uintptr_t)r->base,
                                    .size = r->size,
                                    .key = key,
                                    .key_len = (uint16_t)key_len};
    }
    pthread_mutex_unlock(&t->mu);
    if (n) {
        kvl_buf b = {0};
        frame_begin(&b);
        kvl_err e = kvl_ucx_enc_setup(&b, NULL, 0, v, n);
        kvl_frame_finish(&b, KVL_F_MOVER_KEYS, 0);
        if (e || b.oom) {
            kvl_buf_free(&b);
        } else {
            kvl_tp_frame f = {.head = b};
            a->stream->send(u->ep, &f);
        }
        note_set(u);
    }
    free(v);
    free(bl);
}

const kvl_mover_ops kvl_ucx_mover = {
    .name = "ucx",
    .label = "UCX",
    .what = "UCX puts",
    .kind = KVL_MOVER_UCX,
    .caps = KVL_MV_ONE_SIDED | KVL_MV_NO_HEDGE | KVL_MV_OFFER | KVL_MV_SECRET |
            KVL_MV_MAPS_REGIONS | KVL_MV_FALLS_BACK | KVL_MV_ASKED,
    .usable = ucx_usable,
    .start = ucx_start,
    .answer = ucx_answer,
    .check = ucx_check,
    .sync = ucx_sync,
    .keys = ucx_keys,
    .note = ucx_note,
    .attach = ucx_attach,
    .sample = ucx_sample,
    .covers = ucx_covers,
    .post = ucx_post,
    .ready = ucx_ready,
    .wait = ucx_wait,
    .fence = ucx_fence,
    .free = ucx_free,
};
