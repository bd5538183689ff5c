/* msg.c: the UCX transport's message bodies (msg.h): encoders, and decoders
 * that trust no length, count or id from the network. */
#include <stdlib.h>
#include <string.h>

#include "transport/ucx/msg.h"

/* ---- appending to a kvl_buf: kvl_buf_put (wire.c) ---- */

static void put_le(kvl_buf *b, uint64_t v, int bytes)
{
    uint8_t t[8];
    for (int i = 0; i < bytes; i++)
        t[i] = (uint8_t)(v >> (8 * i));
    kvl_buf_put(b, t, (size_t)bytes);
}

/* ---- a cursor that latches "bad" on overrun ---- */

typedef struct cur {
    const uint8_t *p, *end;
    int bad;
} cur;

static uint64_t get_le(cur *c, int bytes)
{
    if (c->bad || (size_t)(c->end - c->p) < (size_t)bytes) {
        c->bad = 1;
        return 0;
    }
    uint64_t v = 0;
    for (int i = 0; i < bytes; i++)
        v |= (uint64_t)c->p[i] << (8 * i);
    c->p += bytes;
    return v;
}

static const uint8_t *get_bytes(cur *c, size_t n)
{
    if (c->bad || (size_t)(c->end - c->p) < n) {
        c->bad = 1;
        return NULL;
    }
    const uint8_t *r = c->p;
    c->p += n;
    return r;
}

/* ---- SETUP ---- */

/* NULL if the key entry is within the limits, else why not. */
static const char *key_problem(const kvl_ucx_key_view *k, const kvl_ucx_key_view *prev)
{
    if (k->key_len == 0 || k->key_len > KVL_UCX_RKEY_MAX)
        return "key length outside 1..256";
    if (k->size == 0 || k->base + k->size < k->base)
        return "region bounds empty or wrapping";
    if (prev && k->region <= prev->region)
        return "region ids not strictly increasing";
    return NULL;
}

kvl_err kvl_ucx_enc_setup(kvl_buf *b, const uint8_t *addr, uint16_t addr_len,
                          const kvl_ucx_key_view *keys, uint32_t n_keys)
{
    if (addr_len > KVL_UCX_ADDR_MAX || (addr_len && !addr) || n_keys > KVL_UCX_MAX_KEYS ||
        (n_keys && !keys))
        return kvl_fail(KVL_ERR_INVALID_ARG, "UCX setup: address or key count out of range");
    for (uint32_t i = 0; i < n_keys; i++) {
        const char *why = key_problem(&keys[i], i ? &keys[i - 1] : NULL);
        if (why || !keys[i].key)
            return kvl_fail(KVL_ERR_INVALID_ARG, "UCX setup: key %u: %s", i,
                            why ? why : "no key bytes");
    }
    put_le(b, addr_len, 2);
    kvl_buf_put(b, addr, addr_len);
    put_le(b, n_keys, 4);
    for (uint32_t i = 0; i < n_keys; i++) {
        put_le(b, keys[i].region, 8);
        put_le(b, keys[i].base, 8);
        put_le(b, keys[i].size, 8);
        put_le(b, keys[i].key_len, 2);
        kvl_buf_put(b, keys[i].key, keys[i].key_len);
    }
    return KVL_OK;
}

kvl_err kvl_ucx_dec_setup(const uint8_t *body, size_t len, int need_addr, kvl_ucx_setup *out)
{
    memset(out, 0, sizeof *out);
    cur c = {body, body + len, 0};
    uint16_t alen = (uint16_t)get_le(&c, 2);
    if (c.bad)
        return kvl_fail(KVL_ERR_PROTOCOL, "UCX setup: truncated before the address");
    if (alen > KVL_UCX_ADDR_MAX || (need_addr && alen == 0) || (!need_addr && alen != 0))
        return kvl_fail(KVL_ERR_PROTOCOL, "UCX setup: worker address of %u bytes (%s)", alen,
                        need_addr ? "1..4096 expected" : "none expected in UCX_KEYS");
    const uint8_t *addr = get_bytes(&c, alen);
    uint32_t n = (uint32_t)get_le(&c, 4);
    if (c.bad)
        return kvl_fail(KVL_ERR_PROTOCOL, "UCX setup: truncated in the address or key count");
    if (n > KVL_UCX_MAX_KEYS)
        return kvl_fail(KVL_ERR_PROTOCOL, "UCX setup: %u keys (at most %d)", n,
                        KVL_UCX_MAX_KEYS);
    /* each key takes at least 27 bytes: a count larger than the body can
     * hold is refused before anything is allocated for it */
    if ((size_t)n * 27u > (size_t)(c.end - c.p))
        return kvl_fail(KVL_ERR_PROTOCOL, "UCX setup: %u keys do not fit in %zu bytes", n,
                        (size_t)(c.end - c.p));
    kvl_ucx_key_view *keys = n ? calloc(n, sizeof *keys) : NULL;
    if (n && !keys)
        return kvl_fail(KVL_ERR_NOMEM, "UCX setup: out of memory for %u keys", n);
    for (uint32_t i = 0; i < n; i++) {
        kvl_ucx_key_view *k = &keys[i];
        k->region = get_le(&c, 8);
        k->base = get_le(&c, 8);
        k->size = get_le(&c, 8);
        k->key_len = (uint16_t)get_le(&c, 2);
        if (c.bad || k->key_len == 0 || k->key_len > KVL_UCX_RKEY_MAX) {
            free(keys);
            return kvl_fail(KVL_ERR_PROTOCOL, "UCX setup: key %u truncated or of bad length", i);
        }
        k->key = get_bytes(&c, k->key_len);
        const char *why = c.bad ? "truncated" : key_problem(k, i ? &keys[i - 1] : NULL);
        if (why) {
            free(keys);
            return kvl_fail(KVL_ERR_PROTOCOL, "UCX setup: key %u: %s", i, why);
        }
    }
    if (c.p != c.end) {
        free(keys);
        return kvl_fail(KVL_ERR_PROTOCOL, "UCX setup: %zu trailing bytes", (size_t)(c.end - c.p));
    }
    out->addr = alen ? addr : NULL;
    out->addr_len = alen;
    out->n_keys = n;
    out->keys = keys;
    return KVL_OK;
}

void kvl_ucx_setup_free(kvl_ucx_setup *s)
{
    free(s->keys);
    s->keys = NULL;
    s->n_keys = 0;
}

const kvl_ucx_key_view *kvl_ucx_setup_key(const kvl_ucx_setup *s, uint64_t region)
{
    size_t lo = 0, hi = s->n_keys;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (s->keys[mid].region < region)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < s->n_keys && s->keys[lo].region == region ? &s->keys[lo] : NULL;
}

/* ---- REFUSE ---- */

void kvl_ucx_enc_refuse(kvl_buf *b, uint32_t status, const char *msg)
{
    size_t n = msg ? strlen(msg) : 0;
    if (n > 255)
        n = 255;
    put_le(b, status, 4);
    put_le(b, n, 2);
    kvl_buf_put(b, msg, n);
}

kvl_err kvl_ucx_dec_refuse(const uint8_t *body, size_t len, uint32_t *status, char *msg)
{
    cur c = {body, body + len, 0};
    msg[0] = '\0';
    *status = (uint32_t)get_le(&c, 4);
    uint16_t n = (uint16_t)get_le(&c, 2);
    if (c.bad || n > 255)
        return kvl_fail(KVL_ERR_PROTOCOL, "UCX refuse: truncated or message over 255 bytes");
    const uint8_t *m = get_bytes(&c, n);
    if (c.bad || c.p != c.end)
        return kvl_fail(KVL_ERR_PROTOCOL, "UCX refuse: length does not match the body");
    memcpy(msg, m, n);
    msg[n] = '\0';
    return KVL_OK;
}
