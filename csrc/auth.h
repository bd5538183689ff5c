/* auth.h: the handshake's mutual challenge-response (auth.c). */
#ifndef KVLINK_AUTH_H_
#define KVLINK_AUTH_H_

#include "base.h"

/* ---- auth.c: the handshake's mutual challenge-response ---- */
/* What both proofs of one connection cover: who connects to whom, as which
 * connection, and both fresh nonces. */
typedef struct kvl_auth_ctx {
    const char *server_name, *client_name;
    uint64_t server_instance, client_instance;
    uint8_t kind;
    uint16_t path;
    const uint8_t *nonce_c, *nonce_s; /* KVL_NONCE_BYTES each */
} kvl_auth_ctx;
/* The listener's (server 1) or the initiator's (server 0) proof that it
 * holds a's secret: HMAC-SHA256 over a direction label and x, so one side's
 * proof is never valid as the other's. */
void kvl_auth_mac(const kvl_agent *a, int server, const kvl_auth_ctx *x,
                  uint8_t out[KVL_MAC_BYTES]);
/* A fresh random nonce.  Returns KVL_OK, or KVL_ERR_SYSTEM without entropy. */
kvl_err kvl_auth_nonce(uint8_t out[KVL_NONCE_BYTES]);

#endif
