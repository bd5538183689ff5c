/* aead.h: AES-256-GCM records for sealed (relayed) connections, through the
 * system's libcrypto loaded at run time (no OpenSSL header or link needed to
 * build kvlink; docs/security.md, "Relays"). */
#ifndef KVLINK_RELAY_AEAD_H
#define KVLINK_RELAY_AEAD_H

#include <stddef.h>
#include <stdint.h>

#include "../../base.h"

#define KVL_AEAD_KEY 32
#define KVL_AEAD_SALT 4
#define KVL_AEAD_TAG 16

typedef struct kvl_aead kvl_aead;

/* Loads libcrypto once (any thread): KVL_OK, or an error naming the library
 * and the package that provides it. */
kvl_err kvl_aead_load(void);
/* One direction of one connection: key and salt from the key exchange; the
 * record sequence number starts at 0 and is the nonce's tail, so a record
 * dropped, repeated or reordered on the way fails to open.  NULL: no memory. */
kvl_aead *kvl_aead_new(const uint8_t key[KVL_AEAD_KEY], const uint8_t salt[KVL_AEAD_SALT]);
void kvl_aead_free(kvl_aead *c);
/* Encrypts buf[0..len) in place (len <= 1 MiB), authenticating aad too;
 * writes the tag.  0, or -1 (libcrypto failed). */
int kvl_aead_seal(kvl_aead *c, const uint8_t *aad, size_t aad_len, uint8_t *buf, size_t len,
                  uint8_t tag[KVL_AEAD_TAG]);
/* Decrypts buf[0..len) in place; 0 when aad, the bytes and the tag verify
 * under this direction's next sequence number, -1 otherwise (the bytes are
 * then garbage and the connection must end). */
int kvl_aead_open(kvl_aead *c, const uint8_t *aad, size_t aad_len, uint8_t *buf, size_t len,
                  const uint8_t tag[KVL_AEAD_TAG]);

#endif
