/* auth.c: the proofs of the handshake's mutual challenge-response.
 *
 * With a cluster secret K, a connection is set up as
 *   initiator -> HELLO(flags AUTH, nonce_c)
 *   listener  -> CHALLENGE(nonce_s, mac_s = HMAC(K, "server" | ctx))
 *   initiator -> AUTH(mac_c = HMAC(K, "client" | ctx))
 *   listener  -> HELLO_ACK
 * where ctx binds both names, both instance ids, the connection kind and
 * path, and both nonces.  Each side checks the other's proof before it
 * trusts anything from it; fresh nonces on both sides defeat replay, the
 * labels defeat reflection.  See docs/security.md.
 */
#include <string.h>
#include <sys/random.h>

#include "internal.h"

static void put_str(kvl_hmac *m, const char *s)
{
    uint8_t len = (uint8_t)strlen(s); /* names are < KVL_NAME_MAX bytes */
    kvl_hmac_update(m, &len, 1);
    kvl_hmac_update(m, s, len);
}

static void put_u64(kvl_hmac *m, uint64_t v)
{
    uint8_t b[8];
    for (int i = 0; i < 8; i++)
        b[i] = (uint8_t)(v >> (8 * i));
    kvl_hmac_update(m, b, sizeof b);
}

void kvl_auth_mac(const kvl_agent *a, int server, const kvl_auth_ctx *x,
                  uint8_t out[KVL_MAC_BYTES])
{
    kvl_hmac m;
    kvl_hmac_init(&m, a->secret, a->secret_len);
    static const char label_s[] = "kvlink/3 server", label_c[] = "kvlink/3 client";
    kvl_hmac_update(&m, server ? label_s : label_c, sizeof label_s);
    put_str(&m, x->server_name);
    put_u64(&m, x->server_instance);
    put_str(&m, x->client_name);
    put_u64(&m, x->client_instance);
    uint8_t kp[3] = {x->kind, (uint8_t)x->path, (uint8_t)(x->path >> 8)};
    kvl_hmac_update(&m, kp, sizeof kp);
    kvl_hmac_update(&m, x->nonce_c, KVL_NONCE_BYTES);
    kvl_hmac_update(&m, x->nonce_s, KVL_NONCE_BYTES);
    kvl_hmac_final(&m, out);
}

kvl_err kvl_auth_nonce(uint8_t out[KVL_NONCE_BYTES])
{
    if (getrandom(out, KVL_NONCE_BYTES, 0) != KVL_NONCE_BYTES)
        return kvl_fail_errno("getrandom (handshake nonce)");
    return KVL_OK;
}
