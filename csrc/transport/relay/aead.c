/* aead.c: AES-256-GCM through libcrypto's EVP interface, resolved with
 * dlopen so kvlink builds and runs where OpenSSL's headers are absent; only
 * relayed connections need it.  The handful of entry points are declared
 * here with their OpenSSL 1.1 / 3 signatures (unchanged across both). */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "aead.h"

typedef struct evp_ctx evp_ctx;
typedef struct evp_cipher evp_cipher;

#define CTRL_GCM_GET_TAG 0x10
#define CTRL_GCM_SET_TAG 0x11

static struct {
    evp_ctx *(*ctx_new)(void);
    void (*ctx_free)(evp_ctx *);
    const evp_cipher *(*aes_256_gcm)(void);
    int (*enc_init)(evp_ctx *, const evp_cipher *, void *, const uint8_t *, const uint8_t *);
    int (*enc_update)(evp_ctx *, uint8_t *, int *, const uint8_t *, int);
    int (*enc_final)(evp_ctx *, uint8_t *, int *);
    int (*dec_init)(evp_ctx *, const evp_cipher *, void *, const uint8_t *, const uint8_t *);
    int (*dec_update)(evp_ctx *, uint8_t *, int *, const uint8_t *, int);
    int (*dec_final)(evp_ctx *, uint8_t *, int *);
    int (*ctrl)(evp_ctx *, int, int, void *);
} evp;

static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static char load_error[256];

static void load(void)
{
    static const char *const names[] = {"libcrypto.so.3", "libcrypto.so", "libcrypto.so.1.1"};
    void *h = NULL;
    for (size_t i = 0; !h && i < sizeof names / sizeof *names; i++)
        h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(load_error, sizeof load_error,
                 "relayed connections are sealed with AES-256-GCM from OpenSSL's libcrypto, "
                 "which could not be loaded (%s): install libssl3 (Debian/Ubuntu) or "
                 "openssl-libs",
                 dlerror());
        return;
    }
#define SYM(field, name)                                                                  \
    do {                                                                                  \
        *(void **)&evp.field = dlsym(h, name);                                            \
        if (!evp.field) {                                                                 \
            snprintf(load_error, sizeof load_error, "libcrypto lacks %s: too old?", name); \
            return;                                                                       \
        }                                                                                 \
    } while (0)
    SYM(ctx_new, "EVP_CIPHER_CTX_new");
    SYM(ctx_free, "EVP_CIPHER_CTX_free");
    SYM(aes_256_gcm, "EVP_aes_256_gcm");
    SYM(enc_init, "EVP_EncryptInit_ex");
    SYM(enc_update, "EVP_EncryptUpdate");
    SYM(enc_final, "EVP_EncryptFinal_ex");
    SYM(dec_init, "EVP_DecryptInit_ex");
    SYM(dec_update, "EVP_DecryptUpdate");
    SYM(dec_final, "EVP_DecryptFinal_ex");
    SYM(ctrl, "EVP_CIPHER_CTX_ctrl");
#undef SYM
    load_error[0] = 0;
}

kvl_err kvl_aead_load(void)
{
    pthread_once(&load_once, load);
    return load_error[0] ? kvl_fail(KVL_ERR_SYSTEM, "%s", load_error) : KVL_OK;
}

struct kvl_aead {
    evp_ctx *enc, *dec;
    uint8_t salt[KVL_AEAD_SALT];
    uint64_t seq;
};

kvl_aead *kvl_aead_new(const uint8_t key[KVL_AEAD_KEY], const uint8_t salt[KVL_AEAD_SALT])
{
    if (kvl_aead_load() != KVL_OK)
        return NULL;
    kvl_aead *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    c->enc = evp.ctx_new();
    c->dec = evp.ctx_new();
    if (!c->enc || !c->dec || evp.enc_init(c->enc, evp.aes_256_gcm(), NULL, key, NULL) != 1 ||
        evp.dec_init(c->dec, evp.aes_256_gcm(), NULL, key, NULL) != 1) {
        kvl_aead_free(c);
        return NULL;
    }
    memcpy(c->salt, salt, sizeof c->salt);
    return c;
}

void kvl_aead_free(kvl_aead *c)
{
    if (!c)
        return;
    if (c->enc)
        evp.ctx_free(c->enc);
    if (c->dec)
        evp.ctx_free(c->dec);
    free(c);
}

/* salt || 64-bit big-endian sequence number: never repeats under one key */
static void nonce(kvl_aead *c, uint8_t iv[12])
{
    memcpy(iv, c->salt, KVL_AEAD_SALT);
    for (int i = 0; i < 8; i++)
        iv[4 + i] = (uint8_t)(c->seq >> (56 - 8 * i));
    c->seq++;
}

int kvl_aead_seal(kvl_aead *c, const uint8_t *aad, size_t aad_len, uint8_t *buf, size_t len,
                  uint8_t tag[KVL_AEAD_TAG])
{
    uint8_t iv[12];
    int n = 0;
    nonce(c, iv);
    if (len > (1u << 20) || evp.enc_init(c->enc, NULL, NULL, NULL, iv) != 1 ||
        (aad_len && evp.enc_update(c->enc, NULL, &n, aad, (int)aad_len) != 1) ||
        evp.enc_update(c->enc, buf, &n, buf, (int)len) != 1 ||
        evp.enc_final(c->enc, buf + n, &n) != 1 ||
        evp.ctrl(c->enc, CTRL_GCM_GET_TAG, KVL_AEAD_TAG, tag) != 1)
        return -1;
    return 0;
}

int kvl_aead_open(kvl_aead *c, const uint8_t *aad, size_t aad_len, uint8_t *buf, size_t len,
                  const uint8_t tag[KVL_AEAD_TAG])
{
    uint8_t iv[12], t[KVL_AEAD_TAG];
    int n = 0;
    nonce(c, iv);
    memcpy(t, tag, sizeof t);
    if (len > (1u << 20) || evp.dec_init(c->dec, NULL, NULL, NULL, iv) != 1 ||
        (aad_len && evp.dec_update(c->dec, NULL, &n, aad, (int)aad_len) != 1) ||
        evp.dec_update(c->dec, buf, &n, buf, (int)len) != 1 ||
        evp.ctrl(c->dec, CTRL_GCM_SET_TAG, KVL_AEAD_TAG, t) != 1)
        return -1;
    return evp.dec_final(c->dec, buf + n, &n) == 1 ? 0 : -1;
}
