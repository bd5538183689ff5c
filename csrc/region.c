/* region.c: the table of registered memory regions.
 *
 * Looked up by the engine for every chunk header (receiver side) and by
 * submit (sender side); ids only grow, so the vector stays sorted by
 * appending and lookups are binary searches under one mutex.
 */
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <unistd.h>

#include "internal.h"

void kvl_regions_init(kvl_regions *t)
{
    memset(t, 0, sizeof *t);
    pthread_mutex_init(&t->mu, NULL);
    t->next_id = 1;
}

void kvl_regions_destroy(kvl_regions *t)
{
    for (size_t i = 0; i < t->n; i++)
        free(t->v[i]);
    free(t->v);
    pthread_mutex_destroy(&t->mu);
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif

/* Faults writable memory in now, as RDMA registration would pin it, so the
 * first transfer into a fresh buffer does not pay a page fault per 4 KiB on
 * the engine thread (measured: 4x slower into untouched memory).  Best
 * effort: older kernels and special mappings just skip it. */
static void populate(void *ptr, uint64_t len)
{
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t lo = (uintptr_t)ptr & ~(page - 1);
    uintptr_t hi = ((uintptr_t)ptr + len + page - 1) & ~(page - 1);
    (void)madvise((void *)lo, hi - lo, MADV_POPULATE_WRITE);
}

static kvl_region *find(kvl_regions *t, uint64_t id, size_t *pos)
{
    size_t lo = 0, hi = t->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (t->v[mid]->id < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    *pos = lo;
    return lo < t->n && t->v[lo]->id == id ? t->v[lo] : NULL;
}

/* Movers that map regions in their own context (KVL_MV_MAPS_REGIONS: UCX,
 * docs/ucx.md step 3) hear of every change: the engine has them re-map and
 * send the new keys.  Out of memory: the new region goes in-stream there. */
static void regions_changed(kvl_agent *a)
{
    if (!(kvl_movers_caps(&a->cfg) & KVL_MV_MAPS_REGIONS))
        return;
    kvl_cmd *cmd = calloc(1, sizeof *cmd);
    if (!cmd)
        return;
    cmd->type = KVL_CMD_REGIONS;
    kvl_engine_post(a, cmd);
}

kvl_err kvl_region_register(kvl_agent *a, void *ptr, uint64_t len, uint32_t rights,
                            uint32_t mem, const char *name, uint64_t *id)
{
    return kvl_region_register_device(a, ptr, len, rights, mem, NULL, name, id);
}

kvl_err kvl_region_register_device(kvl_agent *a, void *ptr, uint64_t len, uint32_t rights,
                                   uint32_t mem, int32_t *device, const char *name, uint64_t *id)
{
    kvl_clear_error();
    if (!a || !id)
        return kvl_fail(KVL_ERR_INVALID_ARG, "register: agent and id must not be NULL");
    if (atomic_load(&a->closed))
        return kvl_fail(KVL_ERR_CLOSED, "register: the agent is closed");
    if (!ptr || len == 0)
        return kvl_fail(KVL_ERR_INVALID_ARG, "register: memory is empty (%llu bytes at %p)",
                        (unsigned long long)len, ptr);
    if ((uintptr_t)ptr + len < (uintptr_t)ptr)
        return kvl_fail(KVL_ERR_INVALID_ARG, "register: memory range wraps around");
    if (rights & ~(uint32_t)(KVL_REMOTE_READ | KVL_REMOTE_WRITE | KVL_LOCAL_READONLY))
        return kvl_fail(KVL_ERR_INVALID_ARG, "register: unknown rights bits 0x%x", rights);
    if ((rights & KVL_LOCAL_READONLY) && (rights & KVL_REMOTE_WRITE))
        return kvl_fail(KVL_ERR_INVALID_ARG,
                        "register: remote_write=True needs writable memory, this buffer is "
                        "read-only");
    if (mem != KVL_MEM_HOST && mem != KVL_MEM_CUDA)
        return kvl_fail(KVL_ERR_INVALID_ARG, "register: unknown memory type %u", mem);
    /* device memory: checked to be what the caller says before anything is
     * kept (its payloads are staged through host slots: staging.c) */
    int32_t ordinal = -1;
    if (mem == KVL_MEM_CUDA) {
        kvl_err ce = kvl_cuda_check_ptr(ptr, len, device ? *device : -1, &ordinal);
        if (ce)
            return ce;
    }
    if (name && strlen(name) >= KVL_NAME_MAX)
        return kvl_fail(KVL_ERR_INVALID_ARG, "register: name is longer than %d bytes",
                        KVL_NAME_MAX - 1);
    kvl_region *r = calloc(1, sizeof *r);
    if (!r)
        return kvl_fail(KVL_ERR_NOMEM, "register: out of memory");
    if (mem == KVL_MEM_HOST && !(rights & KVL_LOCAL_READONLY))
        populate(ptr, len);
    r->base = ptr;
    r->size = len;
    r->rights = rights;
    r->mem = mem;
    r->device = ordinal;
    /* the region table's remote-key slot stays empty: movers that need keys
     * send their own (MOVER_* frames, after their set-up) */
    r->rkey_len = 0;
    if (name)
        strcpy(r->name, name);
    if ((rights & (KVL_REMOTE_READ | KVL_REMOTE_WRITE)) &&
        getrandom(r->key, sizeof r->key, 0) != sizeof r->key) {
        free(r);
        return kvl_fail_errno("register: getrandom (the region's access key)");
    }
    kvl_regions *t = &a->regions;
    pthread_mutex_lock(&t->mu);
    kvl_err err = KVL_OK;
    if (t->n == KVL_MAX_REGIONS) {
        err = kvl_fail(KVL_ERR_INVALID_ARG, "register: at most %d regions per agent",
                       KVL_MAX_REGIONS);
    } else if (name && name[0]) {
        for (size_t i = 0; i < t->n; i++)
            if (strcmp(t->v[i]->name, name) == 0) {
                err = kvl_fail(KVL_ERR_INVALID_ARG,
                               "register: a region named '%s' already exists (id %llu); "
                               "names must be unique per agent",
                               name, (unsigned long long)t->v[i]->id);
                break;
            }
    }
    if (!err && t->n == t->cap) {
        size_t ncap = t->cap ? t->cap * 2 : 16;
        kvl_region **nv = realloc(t->v, ncap * sizeof *nv);
        if (!nv)
            err = kvl_fail(KVL_ERR_NOMEM, "register: out of memory");
        else {
            t->v = nv;
            t->cap = ncap;
        }
    }
    if (!err) {
        r->id = t->next_id++;
        t->v[t->n++] = r;
        *id = r->id;
        if (device)
            *device = ordinal;
    }
    pthread_mutex_unlock(&t->mu);
    if (err)
        free(r);
    else
        regions_changed(a);
    return err;
}

kvl_err kvl_region_deregister(kvl_agent *a, uint64_t id)
{
    kvl_clear_error();
    if (!a)
        return kvl_fail(KVL_ERR_INVALID_ARG, "deregister: agent is NULL");
    if (atomic_load(&a->closed))
        return kvl_fail(KVL_ERR_CLOSED, "deregister: the agent is closed");
    kvl_regions *t = &a->regions;
    pthread_mutex_lock(&t->mu);
    size_t pos;
    kvl_region *r = find(t, id, &pos);
    kvl_err err = KVL_OK;
    if (!r)
        err = kvl_fail(KVL_ERR_UNKNOWN_REGION, "deregister: region %llu is not registered",
                       (unsigned long long)id);
    else if (r->refs)
        err = kvl_fail(KVL_ERR_BUSY,
                       "deregister: region %llu is used by %d transfer(s) or frame(s) in "
                       "flight; wait for them and try again",
                       (unsigned long long)id, r->refs);
    else {
        memmove(&t->v[pos], &t->v[pos + 1], (t->n - pos - 1) * sizeof *t->v);
        t->n--;
        explicit_bzero(r->key, sizeof r->key);
        free(r);
    }
    pthread_mutex_unlock(&t->mu);
    if (!err)
        regions_changed(a);
    return err;
}

kvl_err kvl_region_key(kvl_agent *a, uint64_t id, uint8_t key[16])
{
    kvl_clear_error();
    if (!a || !key)
        return kvl_fail(KVL_ERR_INVALID_ARG, "region_key: NULL argument");
    kvl_regions *t = &a->regions;
    pthread_mutex_lock(&t->mu);
    size_t pos;
    kvl_region *r = find(t, id, &pos);
    kvl_err err = KVL_OK;
    if (!r)
        err = kvl_fail(KVL_ERR_UNKNOWN_REGION, "region_key: region %llu is not registered",
                       (unsigned long long)id);
    else if (!(r->rights & (KVL_REMOTE_READ | KVL_REMOTE_WRITE)))
        err = kvl_fail(KVL_ERR_ACCESS_DENIED,
                       "region_key: region %llu '%s' is not exposed to peers (no remote_read "
                       "or remote_write)",
                       (unsigned long long)id, r->name);
    else
        memcpy(key, r->key, sizeof r->key);
    pthread_mutex_unlock(&t->mu);
    return err;
}

kvl_err kvl_regions_acquire(kvl_regions *t, uint64_t id, uint64_t off, uint64_t len,
                            uint32_t need, const char *what, kvl_region **out)
{
    pthread_mutex_lock(&t->mu);
    size_t pos;
    kvl_region *r = find(t, id, &pos);
    kvl_err err = KVL_OK;
    if (!r)
        err = kvl_fail(KVL_ERR_UNKNOWN_REGION, "%s: region %llu is not registered", what,
                       (unsigned long long)id);
    else if (off > r->size || len > r->size - off)
        err = kvl_fail(KVL_ERR_OUT_OF_BOUNDS,
                       "%s: bytes [%llu, %llu) lie outside region %llu '%s' of %llu bytes", what,
                       (unsigned long long)off, (unsigned long long)(off + len),
                       (unsigned long long)id, r->name, (unsigned long long)r->size);
    else if ((r->rights & need) != need)
        err = kvl_fail(KVL_ERR_ACCESS_DENIED, "%s: region %llu '%s' was registered without %s",
                       what, (unsigned long long)id, r->name,
                       (need & KVL_REMOTE_WRITE) ? "remote_write=True" : "remote_read=True");
    else {
        r->refs++;
        *out = r;
    }
    pthread_mutex_unlock(&t->mu);
    return err;
}

uint32_t kvl_regions_mem(kvl_regions *t, uint64_t id)
{
    pthread_mutex_lock(&t->mu);
    size_t pos;
    kvl_region *r = find(t, id, &pos);
    uint32_t mem = r ? r->mem : KVL_MEM_HOST;
    pthread_mutex_unlock(&t->mu);
    return mem;
}

void kvl_regions_release(kvl_regions *t, kvl_region *r)
{
    pthread_mutex_lock(&t->mu);
    r->refs--;
    pthread_mutex_unlock(&t->mu);
}

kvl_err kvl_regions_snapshot(kvl_regions *t, kvl_region_info **out, size_t *n)
{
    pthread_mutex_lock(&t->mu);
    kvl_region_info *v = calloc(t->n ? t->n : 1, sizeof *v);
    if (!v) {
        pthread_mutex_unlock(&t->mu);
        return kvl_fail(KVL_ERR_NOMEM, "region table: out of memory");
    }
    size_t k = 0; /* only what peers may touch: local-only regions stay private */
    for (size_t i = 0; i < t->n; i++) {
        kvl_region *r = t->v[i];
        uint32_t rights = r->rights & (KVL_REMOTE_READ | KVL_REMOTE_WRITE);
        if (!rights)
            continue;
        v[k].id = r->id;
        v[k].size = r->size;
        v[k].rights = rights;
        v[k].mem = r->mem;
        memcpy(v[k].name, r->name, sizeof v[k].name);
        v[k].rkey_len = r->rkey_len;
        memcpy(v[k].rkey, r->rkey, r->rkey_len);
        k++;
    }
    *n = k;
    *out = v;
    pthread_mutex_unlock(&t->mu);
    return KVL_OK;
}
