/* ucx.c: one path's UCX end over libucp (ucx.h; design: docs/ucx.md).
 *
 * Callbacks from libucp run inside ucp_worker_progress (or inside a posting
 * call) on the thread that owns the worker; they only update counters of
 * the endpoint they name.  An endpoint is freed only after every request
 * that names it completed (kvl_ucx_ep_close waits for that, bounded).
 */
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "internal.h"
#include "ucx.h"

/* Zero bytes after a copied peer blob: libucp parses addresses and keys
 * without a length, so a truncated blob reads zeros, not our heap. */
#define KVL_UCX_PAD 256

kvl_err kvl_ucx_netdev_of(const char *ip, char *dev, size_t dev_len)
{
    struct in_addr want;
    if (!ip || inet_pton(AF_INET, ip, &want) != 1)
        return kvl_fail(KVL_ERR_INVALID_ARG, "UCX: '%s' is not an IPv4 address", ip ? ip : "");
    struct ifaddrs *ifs = NULL;
    if (getifaddrs(&ifs) != 0)
        return kvl_fail_errno("getifaddrs");
    kvl_err err = kvl_fail(KVL_ERR_INVALID_ARG, "UCX: no interface holds %s", ip);
    /* the interface holding ip itself, else the one whose subnet holds it
     * (loopback paths use 127.0.0.2.., which lo answers for 127.0.0.0/8) */
    for (int pass = 0; pass < 2 && err; pass++) {
        for (struct ifaddrs *i = ifs; i; i = i->ifa_next) {
            if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET || strlen(i->ifa_name) >= dev_len)
                continue;
            const struct sockaddr_in *sa = (const struct sockaddr_in *)(const void *)i->ifa_addr;
            const struct sockaddr_in *nm = (const struct sockaddr_in *)(const void *)i->ifa_netmask;
            uint32_t mask = pass == 0 || !nm ? 0xffffffffu : nm->sin_addr.s_addr;
            if (pass == 1 && !nm)
                continue;
            if ((sa->sin_addr.s_addr & mask) == (want.s_addr & mask)) {
                snprintf(dev, dev_len, "%s", i->ifa_name);
                err = KVL_OK;
                break;
            }
        }
    }
    freeifaddrs(ifs);
    return err;
}

#ifdef KVL_HAVE_UCX
#include "dl.h"

struct kvl_ucx_worker {
    ucp_context_h ctx;
    ucp_worker_h w;
    int efd;
};

struct kvl_ucx_ep {
    kvl_ucx_worker *w;
    ucp_ep_h ep;
    ucs_status_t status;  /* UCS_OK, or the first failure */
    uint64_t inflight;    /* puts posted, not completed */
    uint64_t flushes;     /* flush requests posted, not completed */
    uint64_t flush_seq;   /* the last flush number handed out */
    uint64_t flushed;     /* the highest flush number completed */
    int closing;
};

struct kvl_ucx_mem {
    kvl_ucx_worker *w;
    ucp_mem_h memh;
};

struct kvl_ucx_rkey {
    ucp_rkey_h rk;
    uint64_t base, size;
};

typedef struct flush_req {
    kvl_ucx_ep *ep;
    uint64_t seq;
} flush_req;

static kvl_err ucx_fail(kvl_err err, const char *what, ucs_status_t st)
{
    return kvl_fail(err, "UCX: %s: %s", what, kvl_ucx.ucs_status_string(st));
}

static kvl_err need_loaded(void)
{
    char why[512];
    if (kvl_ucx_load(NULL, why, sizeof why) != 0)
        return kvl_fail(KVL_ERR_SYSTEM, "%s", why);
    return KVL_OK;
}

kvl_err kvl_ucx_worker_create(const char *netdev, const char *const *opts, kvl_ucx_worker **out)
{
    *out = NULL;
    kvl_err e = need_loaded();
    if (e)
        return e;
    if (!netdev || !netdev[0] || strlen(netdev) > 64)
        return kvl_fail(KVL_ERR_INVALID_ARG, "UCX: bad network device name");
    kvl_ucx_worker *w = calloc(1, sizeof *w);
    if (!w)
        return kvl_fail(KVL_ERR_NOMEM, "UCX: out of memory");
    ucp_config_t *cfg = NULL;
    ucs_status_t st = kvl_ucx.ucp_config_read(NULL, NULL, &cfg);
    if (st != UCS_OK) {
        free(w);
        return ucx_fail(KVL_ERR_SYSTEM, "ucp_config_read", st);
    }
    /* One device per context: UCX cannot stripe behind kvlink's scheduler. */
    st = kvl_ucx.ucp_config_modify(cfg, "NET_DEVICES", netdev);
    if (st != UCS_OK) {
        kvl_ucx.ucp_config_release(cfg);
        free(w);
        return ucx_fail(KVL_ERR_SYSTEM, "NET_DEVICES", st);
    }
    for (int i = 0; opts && opts[i] && opts[i + 1]; i += 2) {
        st = kvl_ucx.ucp_config_modify(cfg, opts[i], opts[i + 1]);
        if (st != UCS_OK) {
            kvl_ucx.ucp_config_release(cfg);
            free(w);
            return kvl_fail(KVL_ERR_INVALID_ARG, "UCX: option %s=%s: %s", opts[i], opts[i + 1],
                            kvl_ucx.ucs_status_string(st));
        }
    }
    ucp_params_t p;
    memset(&p, 0, sizeof p);
    p.field_mask = UCP_PARAM_FIELD_FEATURES;
    p.features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
    st = kvl_ucx.ucp_init_version(UCP_API_MAJOR, UCP_API_MINOR, &p, cfg, &w->ctx);
    kvl_ucx.ucp_config_release(cfg);
    if (st != UCS_OK) {
        free(w);
        return ucx_fail(KVL_ERR_SYSTEM, "ucp_init", st);
    }
    ucp_worker_params_t wp;
    memset(&wp, 0, sizeof wp);
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    st = kvl_ucx.ucp_worker_create(w->ctx, &wp, &w->w);
    if (st != UCS_OK) {
        kvl_ucx.ucp_cleanup(w->ctx);
        free(w);
        return ucx_fail(KVL_ERR_SYSTEM, "ucp_worker_create", st);
    }
    st = kvl_ucx.ucp_worker_get_efd(w->w, &w->efd);
    if (st != UCS_OK) {
        kvl_ucx_worker_destroy(w);
        return ucx_fail(KVL_ERR_SYSTEM, "ucp_worker_get_efd", st);
    }
    *out = w;
    return KVL_OK;
}

void kvl_ucx_worker_destroy(kvl_ucx_worker *w)
{
    if (!w)
        return;
    kvl_ucx.ucp_worker_destroy(w->w);
    kvl_ucx.ucp_cleanup(w->ctx);
    free(w);
}

kvl_err kvl_ucx_worker_address(kvl_ucx_worker *w, uint8_t *buf, size_t cap, size_t *len)
{
    ucp_worker_attr_t a;
    memset(&a, 0, sizeof a);
    a.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS;
    ucs_status_t st = kvl_ucx.ucp_worker_query(w->w, &a);
    if (st != UCS_OK)
        return ucx_fail(KVL_ERR_SYSTEM, "ucp_worker_query", st);
    kvl_err e = KVL_OK;
    if (a.address_length > cap || a.address_length > KVL_UCX_ADDR_MAX)
        e = kvl_fail(KVL_ERR_INVALID_ARG, "UCX: worker address of %zu bytes exceeds %zu",
                     a.address_length, cap < KVL_UCX_ADDR_MAX ? cap : (size_t)KVL_UCX_ADDR_MAX);
    else {
        memcpy(buf, a.address, a.address_length);
        *len = a.address_length;
    }
    kvl_ucx.ucp_worker_release_address(w->w, a.address);
    return e;
}

int kvl_ucx_worker_fd(const kvl_ucx_worker *w) { return w->efd; }

int kvl_ucx_worker_progress(kvl_ucx_worker *w)
{
    while (kvl_ucx.ucp_worker_progress(w->w))
        ;
    ucs_status_t st = kvl_ucx.ucp_worker_arm(w->w);
    return st == UCS_OK ? 1 : st == UCS_ERR_BUSY ? 0 : -1;
}

static void ep_failed(void *arg, ucp_ep_h ep, ucs_status_t st)
{
    (void)ep;
    kvl_ucx_ep *e = arg;
    if (e->status == UCS_OK)
        e->status = st;
}

kvl_err kvl_ucx_ep_create(kvl_ucx_worker *w, const uint8_t *addr, size_t len, kvl_ucx_ep **out)
{
    *out = NULL;
    if (!addr || len == 0 || len > KVL_UCX_ADDR_MAX)
        return kvl_fail(KVL_ERR_PROTOCOL, "UCX: peer worker address of %zu bytes (1..%d)", len,
                        KVL_UCX_ADDR_MAX);
    kvl_ucx_ep *e = calloc(1, sizeof *e);
    uint8_t *copy = calloc(1, len + KVL_UCX_PAD);
    if (!e || !copy) {
        free(e);
        free(copy);
        return kvl_fail(KVL_ERR_NOMEM, "UCX: out of memory");
    }
    memcpy(copy, addr, len);
    e->w = w;
    ucp_ep_params_t p;
    memset(&p, 0, sizeof p);
    p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                   UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.address = (const ucp_address_t *)copy;
    p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    p.err_handler.cb = ep_failed;
    p.err_handler.arg = e;
    ucs_status_t st = kvl_ucx.ucp_ep_create(w->w, &p, &e->ep);
    free(copy); /* parsed during the call */
    if (st != UCS_OK) {
        free(e);
        return ucx_fail(KVL_ERR_PROTOCOL, "peer worker address refused (ucp_ep_create)", st);
    }
    *out = e;
    return KVL_OK;
}

int kvl_ucx_ep_status(const kvl_ucx_ep *ep, char *why, size_t why_len)
{
    if (ep->status != UCS_OK && why && why_len)
        snprintf(why, why_len, "UCX endpoint failed: %s", kvl_ucx.ucs_status_string(ep->status));
    return (int)ep->status;
}

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

void kvl_ucx_ep_close(kvl_ucx_ep *ep, int force, uint32_t timeout_ms)
{
    if (!ep)
        return;
    ep->closing = 1;
    ucp_request_param_t p;
    memset(&p, 0, sizeof p);
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    void *req = kvl_ucx.ucp_ep_close_nbx(ep->ep, &p);
    uint64_t until = now_ms() + timeout_ms;
    while (UCS_PTR_IS_PTR(req) && kvl_ucx.ucp_request_check_status(req) == UCS_INPROGRESS &&
           now_ms() < until)
        kvl_ucx.ucp_worker_progress(ep->w->w);
    if (UCS_PTR_IS_PTR(req)) {
        if (kvl_ucx.ucp_request_check_status(req) == UCS_INPROGRESS) {
            /* UCX still holds requests naming ep: leak it rather than free
             * memory a later callback writes. */
            kvl_ucx.ucp_request_free(req);
            return;
        }
        kvl_ucx.ucp_request_free(req);
    }
    /* A closed endpoint completes its requests (cancelled) before or
     * during close; wait for their callbacks, bounded the same way. */
    while ((ep->inflight || ep->flushes) && now_ms() < until)
        kvl_ucx.ucp_worker_progress(ep->w->w);
    if (ep->inflight || ep->flushes)
        return; /* leaked on purpose, as above */
    free(ep);
}

kvl_err kvl_ucx_mem_map(kvl_ucx_worker *w, void *base, uint64_t len, kvl_ucx_mem **out,
                        uint8_t *key, uint32_t *key_len)
{
    *out = NULL;
    if (!base || len == 0)
        return kvl_fail(KVL_ERR_INVALID_ARG, "UCX: empty region");
    kvl_ucx_mem *m = calloc(1, sizeof *m);
    if (!m)
        return kvl_fail(KVL_ERR_NOMEM, "UCX: out of memory");
    m->w = w;
    ucp_mem_map_params_t mp;
    memset(&mp, 0, sizeof mp);
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    mp.address = base;
    mp.length = len;
    ucs_status_t st = kvl_ucx.ucp_mem_map(w->ctx, &mp, &m->memh);
    if (st != UCS_OK) {
        free(m);
        return ucx_fail(KVL_ERR_SYSTEM, "ucp_mem_map", st);
    }
    void *kb = NULL;
    size_t kl = 0;
    st = kvl_ucx.ucp_rkey_pack(w->ctx, m->memh, &kb, &kl);
    if (st != UCS_OK || kl > KVL_UCX_RKEY_MAX) {
        if (st == UCS_OK)
            kvl_ucx.ucp_rkey_buffer_release(kb);
        kvl_ucx.ucp_mem_unmap(w->ctx, m->memh);
        free(m);
        if (st != UCS_OK)
            return ucx_fail(KVL_ERR_SYSTEM, "ucp_rkey_pack", st);
        return kvl_fail(KVL_ERR_SYSTEM, "UCX: packed key of %zu bytes exceeds %d", kl,
                        KVL_UCX_RKEY_MAX);
    }
    memcpy(key, kb, kl);
    *key_len = (uint32_t)kl;
    kvl_ucx.ucp_rkey_buffer_release(kb);
    *out = m;
    return KVL_OK;
}

void kvl_ucx_mem_unmap(kvl_ucx_mem *m)
{
    if (!m)
        return;
    kvl_ucx.ucp_mem_unmap(m->w->ctx, m->memh);
    free(m);
}

kvl_err kvl_ucx_rkey_unpack(kvl_ucx_ep *ep, const uint8_t *key, uint32_t key_len, uint64_t base,
                            uint64_t size, kvl_ucx_rkey **out)
{
    *out = NULL;
    if (!key || key_len == 0 || key_len > KVL_UCX_RKEY_MAX)
        return kvl_fail(KVL_ERR_PROTOCOL, "UCX: remote key of %u bytes (1..%d)", key_len,
                        KVL_UCX_RKEY_MAX);
    if (size == 0 || base + size < base)
        return kvl_fail(KVL_ERR_PROTOCOL, "UCX: remote region [%llu, +%llu) wraps or is empty",
                        (unsigned long long)base, (unsigned long long)size);
    uint8_t buf[KVL_UCX_RKEY_MAX + KVL_UCX_PAD];
    memset(buf, 0, sizeof buf);
    memcpy(buf, key, key_len);
    kvl_ucx_rkey *k = calloc(1, sizeof *k);
    if (!k)
        return kvl_fail(KVL_ERR_NOMEM, "UCX: out of memory");
    ucs_status_t st = kvl_ucx.ucp_ep_rkey_unpack(ep->ep, buf, &k->rk);
    if (st != UCS_OK) {
        free(k);
        return ucx_fail(KVL_ERR_ACCESS_DENIED, "peer's remote key refused (ucp_ep_rkey_unpack)",
                        st);
    }
    k->base = base;
    k->size = size;
    *out = k;
    return KVL_OK;
}

void kvl_ucx_rkey_destroy(kvl_ucx_rkey *k)
{
    if (!k)
        return;
    kvl_ucx.ucp_rkey_destroy(k->rk);
    free(k);
}

static void put_done(void *req, ucs_status_t st, void *user)
{
    kvl_ucx_ep *e = user;
    e->inflight--;
    if (st != UCS_OK && e->status == UCS_OK && !e->closing)
        e->status = st;
    kvl_ucx.ucp_request_free(req);
}

kvl_err kvl_ucx_put(kvl_ucx_ep *ep, const void *src, size_t len, kvl_ucx_rkey *k, uint64_t off)
{
    if (off > k->size || len > k->size - off)
        return kvl_fail(KVL_ERR_OUT_OF_BOUNDS,
                        "UCX: put of %zu bytes at offset %llu outside the remote region of %llu",
                        len, (unsigned long long)off, (unsigned long long)k->size);
    if (ep->status != UCS_OK || ep->closing)
        return kvl_fail(KVL_ERR_CONN_LOST, "UCX: endpoint failed: %s",
                        kvl_ucx.ucs_status_string(ep->status));
    if (len == 0)
        return KVL_OK;
    ucp_request_param_t p;
    memset(&p, 0, sizeof p);
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send = put_done;
    p.user_data = ep;
    void *req = kvl_ucx.ucp_put_nbx(ep->ep, src, len, k->base + off, k->rk, &p);
    if (UCS_PTR_IS_ERR(req)) {
        ep->status = UCS_PTR_STATUS(req);
        return ucx_fail(KVL_ERR_CONN_LOST, "ucp_put_nbx", UCS_PTR_STATUS(req));
    }
    if (req)
        ep->inflight++;
    return KVL_OK;
}

static void flush_done(void *req, ucs_status_t st, void *user)
{
    flush_req *f = user;
    kvl_ucx_ep *e = f->ep;
    e->flushes--;
    if (st == UCS_OK) {
        if (f->seq > e->flushed)
            e->flushed = f->seq;
    } else if (e->status == UCS_OK && !e->closing)
        e->status = st;
    free(f);
    kvl_ucx.ucp_request_free(req);
}

kvl_err kvl_ucx_flush_start(kvl_ucx_ep *ep, uint64_t *seq)
{
    if (ep->status != UCS_OK || ep->closing)
        return kvl_fail(KVL_ERR_CONN_LOST, "UCX: endpoint failed: %s",
                        kvl_ucx.ucs_status_string(ep->status));
    flush_req *f = malloc(sizeof *f);
    if (!f)
        return kvl_fail(KVL_ERR_NOMEM, "UCX: out of memory");
    f->ep = ep;
    f->seq = ++ep->flush_seq;
    ucp_request_param_t p;
    memset(&p, 0, sizeof p);
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send = flush_done;
    p.user_data = f;
    void *req = kvl_ucx.ucp_ep_flush_nbx(ep->ep, &p);
    *seq = f->seq;
    if (UCS_PTR_IS_ERR(req)) {
        free(f);
        ep->status = UCS_PTR_STATUS(req);
        return ucx_fail(KVL_ERR_CONN_LOST, "ucp_ep_flush_nbx", UCS_PTR_STATUS(req));
    }
    if (!req) { /* completed at once */
        if (f->seq > ep->flushed)
            ep->flushed = f->seq;
        free(f);
        return KVL_OK;
    }
    ep->flushes++;
    return KVL_OK;
}

uint64_t kvl_ucx_flushed(const kvl_ucx_ep *ep) { return ep->flushed; }
uint64_t kvl_ucx_inflight(const kvl_ucx_ep *ep) { return ep->inflight; }

#else /* built without UCX headers: every entry point says so */

static kvl_err not_built(void)
{
    char why[512];
    kvl_ucx_load(NULL, why, sizeof why);
    return kvl_fail(KVL_ERR_SYSTEM, "%s", why);
}

kvl_err kvl_ucx_worker_create(const char *netdev, const char *const *opts, kvl_ucx_worker **out)
{
    (void)netdev, (void)opts;
    *out = NULL;
    return not_built();
}
void kvl_ucx_worker_destroy(kvl_ucx_worker *w) { (void)w; }
kvl_err kvl_ucx_worker_address(kvl_ucx_worker *w, uint8_t *buf, size_t cap, size_t *len)
{
    (void)w, (void)buf, (void)cap, (void)len;
    return not_built();
}
int kvl_ucx_worker_fd(const kvl_ucx_worker *w) { (void)w; return -1; }
int kvl_ucx_worker_progress(kvl_ucx_worker *w) { (void)w; return -1; }
kvl_err kvl_ucx_ep_create(kvl_ucx_worker *w, const uint8_t *addr, size_t len, kvl_ucx_ep **out)
{
    (void)w, (void)addr, (void)len;
    *out = NULL;
    return not_built();
}
int kvl_ucx_ep_status(const kvl_ucx_ep *ep, char *why, size_t why_len)
{
    (void)ep, (void)why, (void)why_len;
    return -1;
}
void kvl_ucx_ep_close(kvl_ucx_ep *ep, int force, uint32_t timeout_ms)
{
    (void)ep, (void)force, (void)timeout_ms;
}
kvl_err kvl_ucx_mem_map(kvl_ucx_worker *w, void *base, uint64_t len, kvl_ucx_mem **out,
                        uint8_t *key, uint32_t *key_len)
{
    (void)w, (void)base, (void)len, (void)key, (void)key_len;
    *out = NULL;
    return not_built();
}
void kvl_ucx_mem_unmap(kvl_ucx_mem *m) { (void)m; }
kvl_err kvl_ucx_rkey_unpack(kvl_ucx_ep *ep, const uint8_t *key, uint32_t key_len, uint64_t base,
                            uint64_t size, kvl_ucx_rkey **out)
{
    (void)ep, (void)key, (void)key_len, (void)base, (void)size;
    *out = NULL;
    return not_built();
}
void kvl_ucx_rkey_destroy(kvl_ucx_rkey *k) { (void)k; }
kvl_err kvl_ucx_put(kvl_ucx_ep *ep, const void *src, size_t len, kvl_ucx_rkey *k, uint64_t off)
{
    (void)ep, (void)src, (void)len, (void)k, (void)off;
    return not_built();
}
kvl_err kvl_ucx_flush_start(kvl_ucx_ep *ep, uint64_t *seq)
{
    (void)ep;
    *seq = 0;
    return not_built();
}
uint64_t kvl_ucx_flushed(const kvl_ucx_ep *ep) { (void)ep; return 0; }
uint64_t kvl_ucx_inflight(const kvl_ucx_ep *ep) { (void)ep; return 0; }
#endif
