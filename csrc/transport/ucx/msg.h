/* msg.h: the UCX mover's bodies inside MOVER_* frames on a path's stream
 * (docs/ucx.md, "Connection set-up" and "A chunk over a UCX path").
 *
 * Every MOVER_* body begins with the kind byte (KVL_MOVER_UCX, written and
 * checked by mover.c and proto.c); what follows is one of the bodies below.
 * A chunk's completion needs no message of its own: it is the frame's
 * crc32c trailer, sent after the flush (docs/ucx.md).
 *
 * All integers little-endian, as in docs/wire-protocol.md.
 *
 *   SETUP (MOVER_OFFER / MOVER_ACCEPT / MOVER_KEYS; KEYS has addr_len 0)
 *     u16 addr_len (0..KVL_UCX_ADDR_MAX; 0 only in MOVER_KEYS) | addr bytes
 *     u32 n_keys (0..KVL_UCX_MAX_KEYS)
 *     n_keys x { u64 region | u64 base | u64 size | u16 key_len (1..KVL_UCX_RKEY_MAX) | key }
 *     region ids strictly increasing; size > 0; base + size does not wrap
 *   REFUSE:    u32 status | u16 len (0..255) | message bytes
 *
 * Decoders read only inside [body, body + len), return KVL_ERR_PROTOCOL
 * (with the reason in kvl_last_error) for anything else, including trailing
 * bytes, and point into body (which must outlive the result).
 */
#ifndef KVLINK_UCX_MSG_H
#define KVLINK_UCX_MSG_H

#include <stddef.h>
#include <stdint.h>

#include "internal.h"
#include "transport/ucx/ucx.h"

/* The most keys one SETUP carries: the region table's own limit. */
#define KVL_UCX_MAX_KEYS 8192

typedef struct kvl_ucx_key_view {
    uint64_t region, base, size;
    const uint8_t *key;
    uint16_t key_len;
} kvl_ucx_key_view;

typedef struct kvl_ucx_setup {
    const uint8_t *addr; /* NULL when addr_len is 0 */
    uint16_t addr_len;
    uint32_t n_keys;
    kvl_ucx_key_view *keys; /* n_keys entries, owned: kvl_ucx_setup_free */
} kvl_ucx_setup;

/* Appends a SETUP body to b (b->oom on allocation failure).  The caller
 * passes keys sorted by region and within the limits above; the encoder
 * checks them too and returns KVL_ERR_INVALID_ARG (b unchanged) if not. */
kvl_err kvl_ucx_enc_setup(kvl_buf *b, const uint8_t *addr, uint16_t addr_len,
                          const kvl_ucx_key_view *keys, uint32_t n_keys);
/* Decodes a SETUP body.  need_addr: 1 for OFFER / ACCEPT (addr_len >= 1),
 * 0 for KEYS (addr_len must be 0).  On success the caller frees out. */
kvl_err kvl_ucx_dec_setup(const uint8_t *body, size_t len, int need_addr, kvl_ucx_setup *out);
void kvl_ucx_setup_free(kvl_ucx_setup *s);
/* The key for region in s (binary search), or NULL. */
const kvl_ucx_key_view *kvl_ucx_setup_key(const kvl_ucx_setup *s, uint64_t region);

void kvl_ucx_enc_refuse(kvl_buf *b, uint32_t status, const char *msg);
/* msg: at least 256 bytes; gets the message, NUL-terminated. */
kvl_err kvl_ucx_dec_refuse(const uint8_t *body, size_t len, uint32_t *status, char *msg);

#endif
