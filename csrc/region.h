/* region.h: registered memory and its access keys (region.c). */
#ifndef KVLINK_REGION_H_
#define KVLINK_REGION_H_

#include "base.h"

/* ---- region.c ---- */
typedef struct kvl_region {
    uint64_t id;
    uint8_t *base;
    uint64_t size;
    uint32_t rights;
    uint32_t mem;
    int32_t device;           /* KVL_MEM_CUDA: the device's ordinal; -1 for host memory */
    char name[KVL_NAME_MAX];
    uint32_t rkey_len;        /* the transport's remote key (reg_mem) */
    uint8_t rkey[KVL_MAX_RKEY];
    uint8_t key[KVL_KEY_BYTES]; /* exposed regions: the access key every piece must carry */
    int refs; /* transfers / frames using it; under regions_mu */
} kvl_region;

/* A remote region's access key, as its owner's metadata gave it. */
typedef struct kvl_rkey_entry {
    uint64_t id;
    uint8_t key[KVL_KEY_BYTES];
} kvl_rkey_entry;
/* bsearch of a bare uint64_t id (a) in kvl_rkey_entry elements sorted by id (b). */
int kvl_region_key_cmp(const void *a, const void *b);

typedef struct kvl_regions {
    pthread_mutex_t mu;
    kvl_region **v; /* sorted by id (ids only grow) */
    size_t n, cap;
    uint64_t next_id;
} kvl_regions;

void kvl_regions_init(kvl_regions *t);
void kvl_regions_destroy(kvl_regions *t);
/* Finds and references the region holding [off, off+len) with the rights
 * bits required; on failure returns the specific code and message naming
 * what (a prefix, e.g. "segments[3].dst") and which side ("this agent"). */
/* The memory type of region id (KVL_MEM_HOST when not registered).
 * Thread-safe (regions.mu). */
uint32_t kvl_regions_mem(kvl_regions *t, uint64_t id);
kvl_err kvl_regions_acquire(kvl_regions *t, uint64_t id, uint64_t off, uint64_t len,
                            uint32_t need, const char *what, kvl_region **out);
void kvl_regions_release(kvl_regions *t, kvl_region *r);
/* The exposed regions (remote_read / remote_write) in wire form, for
 * handshakes; no access keys.  Caller frees *out. */
kvl_err kvl_regions_snapshot(kvl_regions *t, kvl_region_info **out, size_t *n);

#endif
