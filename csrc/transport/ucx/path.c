/* path.c: the UCX side of one kvlink data path (path.h; docs/ucx.md).
 *
 * Set-up (after the TCP handshake, which proved the cluster secret):
 *   initiator: UCX_OFFER(its worker address, a key for each of its host
 *              regions: pull destinations)              -- kvl_ucx_path_offer
 *   listener:  UCX_ACCEPT(its worker address, a key for every region peers
 *              may write) or UCX_REFUSE(status, why)   -- kvl_ucx_path_answer
 * The initiator then puts DATA payloads into the listener's regions, and the
 * listener puts READ_RESP payloads into the initiator's (a READ_REQ with the
 * DST flag names where).
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>

#include "../tcp/tcp.h"
#include "msg.h"
#include "path.h"
#include "ucx.h"

typedef struct upkey {
    uint64_t region;
    uint64_t size; /* the region's size the key was packed with */
    kvl_ucx_rkey *k;
} upkey;

struct kvl_ucx_path {
    kvl_ucx_worker *w;
    kvl_ucx_ep *uep;
    kvl_ucx_mem **maps; /* our regions mapped in w's context */
    uint64_t *map_ids;  /* ... their region ids, ascending */
    uint32_t n_maps, cap_maps;
    uint32_t need;      /* rights a region needs to be shown: KVL_REMOTE_WRITE at the
                           listener (push destinations), 0 at the initiator (pulls) */
    upkey *keys;        /* the peer's regions, by id ascending */
    uint32_t n_keys;
    kvl_ep *wk;         /* the worker fd's pseudo endpoint in the engine's epoll */
};

/* UCX's TCP moves a put in segments of TCP_TX_SEG_SIZE (8 KiB by default):
 * 1 MiB made put 3.6x faster here (docs/BENCHMARKS.md). */
static const char *const worker_opts[] = {"TCP_TX_SEG_SIZE", "1m", "TCP_RX_SEG_SIZE", "1m", NULL};

static void path_destroy(kvl_ucx_path *u, uint32_t timeout_ms)
{
    if (!u)
        return;
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
static kvl_err path_new(const char *local, kvl_ucx_path **out)
{
    *out = NULL;
    char dev[64];
    kvl_err e = kvl_ucx_netdev_of(local, dev, sizeof dev);
    if (e)
        return e;
    kvl_ucx_path *u = calloc(1, sizeof *u);
    if (!u)
        return kvl_fail(KVL_ERR_NOMEM, "UCX: out of memory");
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

static void note(kvl_ep *ep, const char *fmt, const char *detail)
{
    snprintf(ep->ucx_note, sizeof ep->ucx_note, fmt, detail);
}

kvl_err kvl_ucx_path_offer(kvl_ep *ep, const char *local, uint64_t deadline_ns)
{
    kvl_ucx_path *u = NULL;
    uint8_t addr[KVL_UCX_ADDR_MAX];
    size_t addr_len = 0;
    kvl_ucx_key_view *keys = NULL;
    uint8_t *blobs = NULL;
    uint32_t n_keys = 0;
    kvl_err e = path_new(local, &u);
    if (!e)
        e = kvl_ucx_worker_address(u->w, addr, sizeof addr, &addr_len);
    /* our host regions, where the peer puts what we pull: any region may be a
     * pull's destination (registered later: in-stream until the path's next
     * set-up) */
    if (!e)
        e = map_regions(ep->a, u, 0, &keys, &n_keys, &blobs);
    kvl_buf b = {0};
    kvl_frame_start(&b);
    if (e) {
        /* no UCX here: say so to the listener, which keeps the path TCP too */
        note(ep, "UCX not set up here: %s", kvl_last_error());
        path_destroy(u, 0);
        u = NULL;
        kvl_ucx_enc_setup(&b, NULL, 0, NULL, 0); /* addr_len 0: refused by the decoder */
    } else {
        if (kvl_ucx_enc_setup(&b, addr, (uint16_t)addr_len, keys, n_keys))
            b.oom = 1;
    }
    free(keys);
    free(blobs);
    kvl_frame_finish(&b, KVL_F_UCX_OFFER, 0);
    e = b.oom ? kvl_fail(KVL_ERR_NOMEM, "UCX_OFFER: out of memory")
              : kvl_tcp_send_all(ep, b.p, b.len, deadline_ns);
    kvl_buf_free(&b);
    if (e || !u) {
        path_destroy(u, 0);
        if (!e) /* the listener answers UCX_REFUSE to an empty offer: read it */
            goto read_answer;
        return e;
    }
read_answer:;
    uint8_t hdr[KVL_HDR_BYTES];
    kvl_frame_hdr h;
    if ((e = kvl_tcp_recv_all(ep, hdr, sizeof hdr, deadline_ns)) ||
        (e = kvl_hdr_decode(hdr, &h))) {
        path_destroy(u, 0);
        return e;
    }
    if ((h.type != KVL_F_UCX_ACCEPT && h.type != KVL_F_UCX_REFUSE) || h.payload_len ||
        h.flags) {
        path_destroy(u, 0);
        return kvl_fail(KVL_ERR_PROTOCOL, "the answer to UCX_OFFER is frame type %u", h.type);
    }
    uint8_t *body = malloc(h.body_len ? h.body_len : 1);
    if (!body) {
        path_destroy(u, 0);
        return kvl_fail(KVL_ERR_NOMEM, "UCX: out of memory for an answer of %u bytes",
                        h.body_len);
    }
    if ((e = kvl_tcp_recv_all(ep, body, h.body_len, deadline_ns))) {
        free(body);
        path_destroy(u, 0);
        return e;
    }
    if (kvl_crc32c(0, body, h.body_len) != h.body_crc) {
        free(body);
        path_destroy(u, 0);
        return kvl_fail(KVL_ERR_PROTOCOL, "UCX answer: body failed its crc32c check");
    }
    if (h.type == KVL_F_UCX_REFUSE) {
        uint32_t st = 0;
        char msg[256];
        e = kvl_ucx_dec_refuse(body, h.body_len, &st, msg);
        free(body);
        if (!e && u)
            note(ep, "the peer refused UCX: %s", msg);
        path_destroy(u, 0);
        return e; /* the path stays TCP */
    }
    if (!u) { /* we offered nothing: an ACCEPT is a broken peer */
        free(body);
        return kvl_fail(KVL_ERR_PROTOCOL, "UCX_ACCEPT to an empty offer");
    }
    kvl_ucx_setup s;
    if ((e = kvl_ucx_dec_setup(body, h.body_len, 1, &s))) {
        free(body);
        path_destroy(u, 0);
        return e;
    }
    /* from here on a failure leaves the path TCP: the listener set up its end
     * and keeps it unused until the connection ends */
    kvl_err ue = kvl_ucx_ep_create(u->w, s.addr, s.addr_len, &u->uep);
    if (!ue)
        ue = take_keys(u, &s);
    kvl_ucx_setup_free(&s);
    free(body);
    if (ue) {
        note(ep, "UCX set-up failed, running TCP: %s", kvl_last_error());
        path_destroy(u, 0);
        return KVL_OK;
    }
    ep->ucx = u;
    snprintf(ep->ucx_note, sizeof ep->ucx_note, "UCX %s, %u remote keys, %u regions mapped",
             kvl_ucx_version(), u->n_keys, u->n_maps);
    return KVL_OK;
}

/* The peer's region table entry for id (tab sorted by id, as the wire
 * carries it), or NULL. */
static const kvl_region_info *table_entry(const kvl_region_info *tab, size_t n, uint64_t id)
{
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (tab[mid].id == id)
            return &tab[mid];
        if (tab[mid].id < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

int kvl_ucx_path_check(kvl_ep *ep, const kvl_region_info *regions, size_t n)
{
    kvl_ucx_path *u = ep->ucx;
    if (!u)
        return 0;
    /* A key for a region the table does not list (registered after the
     * table was read) stays: no chunk can name that region before the table
     * does, and then this check has not seen it -- but the put bounds are
     * the key's own, which the region table's bounds on every chunk keep
     * within (xfer.c), and a key smaller than the table's region would fail
     * a put with KVL_ERR_OUT_OF_BOUNDS, not place out of range. */
    for (uint32_t i = 0; i < u->n_keys; i++) {
        const kvl_region_info *r = table_entry(regions, n, u->keys[i].region);
        if (!r)
            continue;
        uint64_t ksize = u->keys[i].size;
        char why[sizeof ep->ucx_note];
        if (!(r->rights & KVL_REMOTE_WRITE))
            snprintf(why, sizeof why,
                     "UCX key for region %llu, which the peer's region table does not open for "
                     "remote writes: peer broken or hostile, running TCP",
                     (unsigned long long)r->id);
        else if (ksize != r->size)
            snprintf(why, sizeof why,
                     "UCX key of region %llu covers %llu bytes, the peer's region table says "
                     "%llu: peer broken or hostile, running TCP",
                     (unsigned long long)r->id, (unsigned long long)ksize,
                     (unsigned long long)r->size);
        else
            continue;
        kvl_log(ep->a, KVL_LOG_WARNING, NULL, -1, "%s", why);
        kvl_ucx_path_free(ep, ep->a->cfg.connect_timeout_ms);
        snprintf(ep->ucx_note, sizeof ep->ucx_note, "%s", why);
        return 0;
    }
    return 1;
}

int kvl_ucx_path_note(const kvl_ep *ep, char *out, size_t len)
{
    snprintf(out, len, "%s", ep->ucx_note);
    return ep->ucx != NULL;
}

/* ---- listener ---- */

static int refuse(kvl_ep *ep, uint32_t status, const char *why)
{
    kvl_buf b = {0};
    kvl_frame_start(&b);
    kvl_ucx_enc_refuse(&b, status, why);
    kvl_frame_finish(&b, KVL_F_UCX_REFUSE, 0);
    kvl_tp_frame f = {.head = b};
    return kvl_tcp_ops.send(ep, &f) == 0 ? 0 : -1;
}

/* The address of ep's local end (dotted quad). */
static int local_ip(const kvl_ep *ep, char *out, size_t len)
{
    struct sockaddr_in sa;
    socklen_t sl = sizeof sa;
    if (getsockname(ep->fd, (struct sockaddr *)&sa, &sl) != 0 || sa.sin_family != AF_INET)
        return -1;
    return inet_ntop(AF_INET, &sa.sin_addr, out, (socklen_t)len) ? 0 : -1;
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

int kvl_ucx_path_answer(kvl_ep *ep, const uint8_t *body, size_t len, int proven)
{
    kvl_agent *a = ep->a;
    if (!proven)
        return refuse(ep, KVL_ERR_AUTH,
                      "UCX is set up only between agents holding a cluster secret");
    if (a->cfg.transport != KVL_TRANSPORT_UCX) {
        char why[96];
        snprintf(why, sizeof why, "agent '%s' runs transport='%s'", a->name,
                 a->cfg.transport == KVL_TRANSPORT_TCP ? "tcp" : "auto");
        return refuse(ep, KVL_ERR_INVALID_ARG, why);
    }
    kvl_ucx_setup s;
    if (kvl_ucx_dec_setup(body, len, 1, &s)) {
        char why[200];
        snprintf(why, sizeof why, "UCX_OFFER: %s", kvl_last_error());
        return refuse(ep, KVL_ERR_PROTOCOL, why);
    }
    char ip[64];
    kvl_ucx_path *u = NULL;
    kvl_ucx_key_view *keys = NULL;
    uint8_t *blobs = NULL;
    uint32_t n_keys = 0;
    uint8_t addr[KVL_UCX_ADDR_MAX];
    size_t addr_len = 0;
    kvl_err e = local_ip(ep, ip, sizeof ip) ? kvl_fail(KVL_ERR_SYSTEM, "getsockname failed")
                                            : path_new(ip, &u);
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
        kvl_frame_start(&b);
        e = kvl_ucx_enc_setup(&b, addr, (uint16_t)addr_len, keys, n_keys);
        kvl_frame_finish(&b, KVL_F_UCX_ACCEPT, 0);
        if (!e && b.oom)
            e = kvl_fail(KVL_ERR_NOMEM, "UCX_ACCEPT: out of memory");
    }
    free(keys);
    free(blobs);
    if (e) {
        char why[200];
        snprintf(why, sizeof why, "UCX set-up failed at '%s': %s", a->name, kvl_last_error());
        kvl_buf_free(&b);
        path_destroy(u, a->cfg.connect_timeout_ms);
        return refuse(ep, e, why);
    }
    ep->ucx = u;
    snprintf(ep->ucx_note, sizeof ep->ucx_note, "UCX %s, %u regions mapped, %u remote keys",
             kvl_ucx_version(), u->n_maps, u->n_keys);
    if (kvl_ucx_path_watch(ep)) {
        /* the answer is not sent yet: refuse instead, and stay TCP */
        ep->ucx = NULL;
        kvl_buf_free(&b);
        path_destroy(u, a->cfg.connect_timeout_ms);
        return refuse(ep, KVL_ERR_SYSTEM, "UCX: cannot watch the worker");
    }
    kvl_tp_frame f = {.head = b};
    return kvl_tcp_ops.send(ep, &f) == 0 ? 1 : -1;
}

/* ---- engine ---- */

int kvl_ucx_path_watch(kvl_ep *ep)
{
    kvl_ucx_path *u = ep->ucx;
    if (!u || u->wk)
        return 0;
    kvl_ep *wk = calloc(1, sizeof *wk);
    if (!wk)
        return -1;
    wk->a = ep->a;
    wk->fd = kvl_ucx_worker_fd(u->w);
    wk->spare = -1;
    wk->ucx_owner = ep;
    pthread_mutex_init(&wk->jmu, NULL);
    if (kvl_engine_watch(ep->a, wk->fd, wk, EPOLLIN) != 0) {
        pthread_mutex_destroy(&wk->jmu);
        free(wk);
        return -1;
    }
    u->wk = wk;
    /* events may have arrived before the watch: progress and arm now */
    while (kvl_ucx_worker_progress(u->w) == 0)
        ;
    return 0;
}

void kvl_ucx_path_on_event(kvl_ep *wk)
{
    kvl_ep *ep = wk->ucx_owner;
    kvl_ucx_path *u = ep ? ep->ucx : NULL;
    if (!u)
        return;
    while (kvl_ucx_worker_progress(u->w) == 0)
        ;
    ep->t_ucx_ns = kvl_now_ns();
    kvl_tcp_ucx_progressed(ep);
}

void kvl_ucx_path_free(kvl_ep *ep, uint32_t timeout_ms)
{
    kvl_ucx_path *u = ep->ucx;
    if (!u)
        return;
    ep->ucx = NULL;
    if (u->wk) {
        /* its event may be pending in the engine's current batch: the pseudo
         * endpoint stays allocated, dead and ownerless, until ep is freed */
        kvl_engine_unwatch(ep->a, u->wk->fd);
        u->wk->ucx_owner = NULL;
        u->wk->dead = 1;
        u->wk->fd = -1;
        ep->ucx_wk_gone = u->wk;
    }
    path_destroy(u, timeout_ms);
}

int kvl_ucx_path_covers(const kvl_ucx_path *u, const kvl_wire_piece *dst, uint32_t n)
{
    if (!u->uep || !dst)
        return 0;
    const upkey *k = NULL;
    for (uint32_t i = 0; i < n; i++) {
        if (!k || dst[i].region != k->region)
            k = key_of(u, dst[i].region);
        /* the key's own bounds (a pull's pieces come from the peer, a push's
         * from our checked plan): out of them, the frame goes in-stream */
        if (!k || dst[i].offset > k->size || dst[i].len > k->size - dst[i].offset)
            return 0;
    }
    return 1;
}

kvl_err kvl_ucx_path_post(kvl_ucx_path *u, const struct iovec *src, int n_src,
                          const kvl_wire_piece *dst, uint32_t n_dst, uint64_t len, uint32_t *crc,
                          uint64_t *seq)
{
    int si = 0;
    size_t soff = 0;
    uint64_t total = 0;
    for (uint32_t i = 0; i < n_dst; i++) {
        const upkey *uk = key_of(u, dst[i].region);
        kvl_ucx_rkey *k = uk ? uk->k : NULL;
        if (!k)
            return kvl_fail(KVL_ERR_UNKNOWN_REGION, "no UCX remote key for region %llu",
                            (unsigned long long)dst[i].region);
        uint64_t off = dst[i].offset, left = dst[i].len;
        while (left) {
            if (si >= n_src)
                return kvl_fail(KVL_ERR_INVALID_ARG, "UCX: payload shorter than its pieces");
            size_t take = src[si].iov_len - soff;
            if (take > left)
                take = (size_t)left;
            const uint8_t *p = (const uint8_t *)src[si].iov_base + soff;
            kvl_err e = kvl_ucx_put(u->uep, p, take, k, off);
            if (e)
                return e;
            *crc = kvl_crc32c(*crc, p, take);
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
    if (total != len)
        return kvl_fail(KVL_ERR_INVALID_ARG, "UCX: pieces hold %llu bytes, the payload %llu",
                        (unsigned long long)total, (unsigned long long)len);
    return kvl_ucx_flush_start(u->uep, seq);
}

int kvl_ucx_path_flushed(kvl_ucx_path *u, uint64_t seq, char *why, size_t why_len)
{
    if (kvl_ucx_flushed(u->uep) >= seq)
        return 1;
    return kvl_ucx_ep_status(u->uep, why, why_len) != 0 ? -1 : 0;
}

int kvl_ucx_path_wait_flush(kvl_ucx_path *u, uint64_t seq, uint64_t deadline_ns)
{
    for (;;) {
        int r = kvl_ucx_path_flushed(u, seq, NULL, 0);
        if (r)
            return r;
        if (kvl_now_ns() >= deadline_ns)
            return 0;
        kvl_ucx_worker_progress(u->w);
    }
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

int kvl_ucx_path_keys(kvl_ep *ep, const uint8_t *body, size_t len)
{
    kvl_ucx_path *u = ep->ucx;
    kvl_ucx_setup s;
    if (kvl_ucx_dec_setup(body, len, 0, &s))
        return -1;
    /* fenced or dropped since: the keys have nothing to go with */
    kvl_err e = u && u->uep ? add_keys(u, &s) : KVL_OK;
    kvl_ucx_setup_free(&s);
    if (e == KVL_ERR_PROTOCOL)
        return -1;
    if (e) /* a key libucp refuses, or no memory: that region goes in-stream */
        kvl_log(ep->a, KVL_LOG_WARNING, NULL, -1, "%s", kvl_last_error());
    else if (u)
        snprintf(ep->ucx_note, sizeof ep->ucx_note, "UCX %s, %u remote keys, %u regions mapped",
                 kvl_ucx_version(), u->n_keys, u->n_maps);
    return 0;
}

void kvl_ucx_path_sync(kvl_ep *ep)
{
    kvl_ucx_path *u = ep->ucx;
    if (!u || !u->map_ids)
        return;
    kvl_agent *a = ep->a;
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
        kvl_frame_start(&b);
        kvl_err e = kvl_ucx_enc_setup(&b, NULL, 0, v, n);
        kvl_frame_finish(&b, KVL_F_UCX_KEYS, 0);
        if (e || b.oom) {
            kvl_buf_free(&b);
        } else {
            kvl_tp_frame f = {.head = b};
            kvl_tcp_ops.send(ep, &f);
        }
        snprintf(ep->ucx_note, sizeof ep->ucx_note, "UCX %s, %u remote keys, %u regions mapped",
                 kvl_ucx_version(), u->n_keys, u->n_maps);
    }
    free(v);
    free(bl);
}
