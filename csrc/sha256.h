/* sha256.h: SHA-256 and HMAC-SHA256 (sha256.c). */
#ifndef KVLINK_SHA256_H_
#define KVLINK_SHA256_H_

#include "base.h"

/* ---- sha256.c ---- */
#define KVL_SHA256_BYTES 32
typedef struct kvl_sha256 {
    uint32_t h[8];
    uint64_t len;
    uint8_t buf[64];
    size_t fill;
} kvl_sha256;
typedef struct kvl_hmac {
    kvl_sha256 inner, outer;
} kvl_hmac;
void kvl_sha256_init(kvl_sha256 *s);
void kvl_sha256_update(kvl_sha256 *s, const void *data, size_t n);
void kvl_sha256_final(kvl_sha256 *s, uint8_t out[KVL_SHA256_BYTES]);
void kvl_hmac_init(kvl_hmac *m, const void *key, size_t key_len);
void kvl_hmac_update(kvl_hmac *m, const void *data, size_t n);
void kvl_hmac_final(kvl_hmac *m, uint8_t out[KVL_SHA256_BYTES]);
/* 1 if a and b hold the same n bytes; the time taken does not depend on where they differ. */
int kvl_ct_equal(const void *a, const void *b, size_t n);

#endif
