/* wire.c: encoding and checked decoding of kvlink frames.
 *
 * Decoders never trust a length: every field is read through a cursor that
 * latches "bad" on overrun, so garbage from the network yields
 * KVL_ERR_PROTOCOL, never an out-of-bounds read.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* ---- little-endian primitives ---- */

static void buf_reserve(kvl_buf *b, size_t more)
{
    if (b->oom || b->len + more <= b->cap)
        return;
    size_t ncap = b->cap ? b->cap * 2 : 256;
    while (ncap < b->len + more)
        ncap *= 2;
    uint8_t *np = realloc(b->p, ncap);
    if (!np) {
        b->oom = 1;
        return;
    }
    b->p = np;
    b->cap = ncap;
}

void kvl_buf_put(kvl_buf *b, const void *src, size_t n)
{
    buf_reserve(b, n);
    if (b->oom)
        return;
    if (n)
        memcpy(b->p + b->len, src, n);
    b->len += n;
}

static void put_u64(kvl_buf *b, uint64_t v)
{
    uint8_t t[8];
    for (int i = 0; i < 8; i++)
        t[i] = (uint8_t)(v >> (8 * i));
    kvl_buf_put(b, t, 8);
}

static void put_u32(kvl_buf *b, uint32_t v)
{
    uint8_t t[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    kvl_buf_put(b, t, 4);
}

static void put_u16(kvl_buf *b, uint16_t v)
{
    uint8_t t[2] = {(uint8_t)v, (uint8_t)(v >> 8)};
    kvl_buf_put(b, t, 2);
}

/* A short string: u16 length then bytes (no NUL). */
static void put_str(kvl_buf *b, const char *s, size_t max)
{
    size_t n = s ? strnlen(s, max) : 0;
    put_u16(b, (uint16_t)n);
    kvl_buf_put(b, s, n);
}

static uint64_t ld_u64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

static uint32_t ld_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

typedef struct rd {
    const uint8_t *p;
    size_t len, off;
    int bad;
} rd;

static const uint8_t *take(rd *r, size_t n)
{
    if (r->bad || n > r->len - r->off) {
        r->bad = 1;
        return NULL;
    }
    const uint8_t *p = r->p + r->off;
    r->off += n;
    return p;
}

static uint64_t get_u64(rd *r)
{
    const uint8_t *p = take(r, 8);
    return p ? ld_u64(p) : 0;
}

static uint32_t get_u32(rd *r)
{
    const uint8_t *p = take(r, 4);
    return p ? ld_u32(p) : 0;
}

static uint16_t get_u16(rd *r)
{
    const uint8_t *p = take(r, 2);
    return p ? (uint16_t)(p[0] | p[1] << 8) : 0;
}

static uint8_t get_u8(rd *r)
{
    const uint8_t *p = take(r, 1);
    return p ? p[0] : 0;
}

/* Copies a short string into dst (cap bytes with NUL); too long is bad. */
static void get_str(rd *r, char *dst, size_t cap)
{
    uint16_t n = get_u16(r);
    const uint8_t *p = take(r, n);
    if (!p || n >= cap) {
        r->bad = 1;
        dst[0] = '\0';
        return;
    }
    memcpy(dst, p, n);
    dst[n] = '\0';
}

static kvl_err finish(rd *r, const char *what)
{
    if (r->bad)
        return kvl_fail(KVL_ERR_PROTOCOL, "malformed %s frame: a field runs past the body",
                        what);
    if (r->off != r->len)
        return kvl_fail(KVL_ERR_PROTOCOL, "malformed %s frame: %zu trailing bytes", what,
                        r->len - r->off);
    return KVL_OK;
}

/* ---- header ---- */

void kvl_hdr_encode(uint8_t out[KVL_HDR_BYTES], const kvl_frame_hdr *h)
{
    kvl_buf b = {0};
    uint8_t tmp[KVL_HDR_BYTES];
    b.p = tmp;
    b.cap = sizeof tmp;
    put_u32(&b, KVL_MAGIC);
    uint8_t vt[2] = {KVL_PROTO_VERSION, h->type};
    kvl_buf_put(&b, vt, 2);
    put_u16(&b, h->flags);
    put_u32(&b, h->body_len);
    put_u32(&b, h->body_crc);
    put_u64(&b, h->payload_len);
    memcpy(out, tmp, KVL_HDR_BYTES);
}

kvl_err kvl_hdr_decode(const uint8_t in[KVL_HDR_BYTES], kvl_frame_hdr *h)
{
    uint32_t magic = ld_u32(in);
    if (magic != KVL_MAGIC)
        return kvl_fail(KVL_ERR_PROTOCOL, "not a kvlink frame (magic 0x%08x)", magic);
    if (in[4] != KVL_PROTO_VERSION)
        return kvl_fail(KVL_ERR_HANDSHAKE,
                        "peer speaks kvlink wire protocol %u, this build speaks %u: "
                        "upgrade both sides to the same kvlink version",
                        in[4], KVL_PROTO_VERSION);
    h->type = in[5];
    h->flags = (uint16_t)(in[6] | in[7] << 8);
    h->body_len = ld_u32(in + 8);
    h->body_crc = ld_u32(in + 12);
    h->payload_len = ld_u64(in + 16);
    if (h->type < 1 || h->type > KVL_F_TYPE_MAX)
        return kvl_fail(KVL_ERR_PROTOCOL, "unknown frame type %u", h->type);
    if (h->body_len > KVL_MAX_BODY)
        return kvl_fail(KVL_ERR_PROTOCOL, "frame body of %u bytes exceeds the %u limit",
                        h->body_len, KVL_MAX_BODY);
    if (h->payload_len > KVL_MAX_CHUNK)
        return kvl_fail(KVL_ERR_PROTOCOL, "frame payload of %llu bytes exceeds the %llu limit",
                        (unsigned long long)h->payload_len, KVL_MAX_CHUNK);
    int may_carry = h->type == KVL_F_DATA || h->type == KVL_F_READ_RESP;
    if (h->payload_len && !may_carry)
        return kvl_fail(KVL_ERR_PROTOCOL, "frame type %u cannot carry a payload", h->type);
    if (h->flags & ~(KVL_HF_OOB | KVL_HF_DST))
        return kvl_fail(KVL_ERR_PROTOCOL, "unknown header flags %#x", h->flags);
    if ((h->flags & KVL_HF_DST) && h->type != KVL_F_READ_REQ)
        return kvl_fail(KVL_ERR_PROTOCOL, "header flag DST on frame type %u (READ_REQ only)",
                        h->type);
    if ((h->flags & KVL_HF_OOB) && !h->payload_len)
        return kvl_fail(KVL_ERR_PROTOCOL, "header flag OOB on frame type %u without a payload",
                        h->type);
    return KVL_OK;
}

void kvl_frame_start(kvl_buf *b)
{
    b->len = 0;
    buf_reserve(b, KVL_HDR_BYTES);
    if (!b->oom)
        b->len = KVL_HDR_BYTES;
}

void kvl_frame_finish(kvl_buf *b, uint8_t type, uint64_t payload_len)
{
    if (b->oom)
        return;
    kvl_frame_hdr h = {
        .type = type,
        .body_len = (uint32_t)(b->len - KVL_HDR_BYTES),
        .body_crc = kvl_crc32c(0, b->p + KVL_HDR_BYTES, b->len - KVL_HDR_BYTES),
        .payload_len = payload_len,
    };
    kvl_hdr_encode(b->p, &h);
}

void kvl_buf_free(kvl_buf *b)
{
    free(b->p);
    memset(b, 0, sizeof *b);
}

/* ---- bodies ---- */

void kvl_enc_hello(kvl_buf *b, const kvl_msg_hello *m)
{
    put_u64(b, m->instance);
    uint8_t k = m->kind;
    kvl_buf_put(b, &k, 1);
    put_u16(b, m->path);
    put_str(b, m->name, KVL_NAME_MAX - 1);
    kvl_buf_put(b, &m->flags, 1);
    kvl_buf_put(b, m->nonce, KVL_NONCE_BYTES);
    kvl_buf_put(b, m->token, KVL_TOKEN_BYTES);
    put_u32(b, m->movers);
}

kvl_err kvl_dec_hello(const uint8_t *body, size_t len, kvl_msg_hello *m)
{
    rd r = {body, len, 0, 0};
    m->instance = get_u64(&r);
    m->kind = get_u8(&r);
    m->path = get_u16(&r);
    get_str(&r, m->name, sizeof m->name);
    m->flags = get_u8(&r);
    const uint8_t *nonce = take(&r, KVL_NONCE_BYTES), *token = take(&r, KVL_TOKEN_BYTES);
    if (nonce && token) {
        memcpy(m->nonce, nonce, KVL_NONCE_BYTES);
        memcpy(m->token, token, KVL_TOKEN_BYTES);
    }
    m->movers = get_u32(&r);
    kvl_err e = finish(&r, "HELLO");
    if (e)
        return e;
    if (m->kind > KVL_CONN_DATA)
        return kvl_fail(KVL_ERR_PROTOCOL, "HELLO: unknown connection kind %u", m->kind);
    if (!m->name[0])
        return kvl_fail(KVL_ERR_PROTOCOL, "HELLO: empty agent name");
    if (m->kind == KVL_CONN_DATA && m->path >= KVL_MAX_PATHS)
        return kvl_fail(KVL_ERR_PROTOCOL, "HELLO: path index %u out of range", m->path);
    if (m->flags & ~KVL_HELLO_AUTH)
        return kvl_fail(KVL_ERR_PROTOCOL, "HELLO: unknown flags %#x", m->flags);
    if (m->movers & ~(uint32_t)KVL_MOVERS_KNOWN)
        return kvl_fail(KVL_ERR_PROTOCOL, "HELLO: unknown movers %#x", m->movers);
    if (m->movers & (m->movers - 1))
        return kvl_fail(KVL_ERR_PROTOCOL, "HELLO: more than one mover wanted (%#x)", m->movers);
    if (m->movers && m->kind != KVL_CONN_DATA)
        return kvl_fail(KVL_ERR_PROTOCOL, "HELLO: a mover wanted on a control connection");
    return KVL_OK;
}

void kvl_enc_challenge(kvl_buf *b, const kvl_msg_challenge *m)
{
    put_u64(b, m->instance);
    put_str(b, m->name, KVL_NAME_MAX - 1);
    kvl_buf_put(b, m->nonce, KVL_NONCE_BYTES);
    kvl_buf_put(b, m->mac, KVL_MAC_BYTES);
}

kvl_err kvl_dec_challenge(const uint8_t *body, size_t len, kvl_msg_challenge *m)
{
    rd r = {body, len, 0, 0};
    m->instance = get_u64(&r);
    get_str(&r, m->name, sizeof m->name);
    const uint8_t *nonce = take(&r, KVL_NONCE_BYTES), *mac = take(&r, KVL_MAC_BYTES);
    if (nonce && mac) {
        memcpy(m->nonce, nonce, KVL_NONCE_BYTES);
        memcpy(m->mac, mac, KVL_MAC_BYTES);
    }
    return finish(&r, "CHALLENGE");
}

void kvl_enc_auth(kvl_buf *b, const kvl_msg_auth *m)
{
    put_u32(b, m->status);
    kvl_buf_put(b, m->mac, KVL_MAC_BYTES);
}

kvl_err kvl_dec_auth(const uint8_t *body, size_t len, kvl_msg_auth *m)
{
    rd r = {body, len, 0, 0};
    m->status = get_u32(&r);
    const uint8_t *mac = take(&r, KVL_MAC_BYTES);
    if (mac)
        memcpy(m->mac, mac, KVL_MAC_BYTES);
    return finish(&r, "AUTH");
}

static void put_region(kvl_buf *b, const kvl_region_info *r)
{
    put_u64(b, r->id);
    put_u64(b, r->size);
    put_u32(b, r->rights);
    put_u32(b, r->mem);
    char name[KVL_NAME_MAX] = {0};
    strncpy(name, r->name, sizeof name - 1);
    kvl_buf_put(b, name, sizeof name);
    uint16_t klen = r->rkey_len <= KVL_MAX_RKEY ? (uint16_t)r->rkey_len : 0;
    put_u16(b, klen);
    kvl_buf_put(b, r->rkey, klen);
}

void kvl_enc_hello_ack(kvl_buf *b, uint32_t status, uint64_t instance, const char *name,
                       const char *msg, const kvl_region_info *regions, size_t n_regions)
{
    put_u32(b, status);
    put_u64(b, instance);
    put_str(b, name, KVL_NAME_MAX - 1);
    put_str(b, msg, 255);
    put_u32(b, (uint32_t)n_regions);
    for (size_t i = 0; i < n_regions; i++)
        put_region(b, &regions[i]);
}

kvl_err kvl_dec_hello_ack(const uint8_t *body, size_t len, kvl_msg_hello_ack *m)
{
    rd r = {body, len, 0, 0};
    m->status = get_u32(&r);
    m->instance = get_u64(&r);
    get_str(&r, m->name, sizeof m->name);
    get_str(&r, m->msg, sizeof m->msg);
    m->n_regions = get_u32(&r);
    if (m->n_regions > KVL_MAX_REGIONS)
        r.bad = 1;
    m->regions = r.bad ? NULL : body + r.off;
    /* every record: 88 fixed bytes, a u16 key length, the key; ids strictly
     * ascending (the initiator binary-searches), known rights and memory */
    uint64_t prev = 0;
    for (uint32_t i = 0; i < m->n_regions && !r.bad; i++) {
        const uint8_t *rec = take(&r, KVL_WIRE_REGION_BYTES - 2);
        uint16_t klen = get_u16(&r);
        if (klen > KVL_MAX_RKEY)
            r.bad = 1;
        take(&r, klen);
        if (r.bad)
            break;
        uint64_t id = ld_u64(rec);
        uint32_t rights = ld_u32(rec + 16), mem = ld_u32(rec + 20);
        if (id <= prev || (rights & ~(uint32_t)(KVL_REMOTE_READ | KVL_REMOTE_WRITE)) ||
            mem > KVL_MEM_CUDA)
            return kvl_fail(KVL_ERR_PROTOCOL,
                            "region table entry %u: id %llu (after %llu), rights %#x, memory "
                            "type %u: ids must ascend, rights and memory types be known",
                            i, (unsigned long long)id, (unsigned long long)prev, rights, mem);
        prev = id;
    }
    return finish(&r, "HELLO_ACK/REGIONS");
}

kvl_err kvl_dec_region_table(const kvl_msg_hello_ack *m, kvl_region_info **out)
{
    kvl_region_info *tab = calloc(m->n_regions ? m->n_regions : 1, sizeof *tab);
    if (!tab)
        return kvl_fail(KVL_ERR_NOMEM, "out of memory for a region table of %u entries",
                        m->n_regions);
    const uint8_t *rec = m->regions;
    for (uint32_t i = 0; i < m->n_regions; i++)
        rec = kvl_dec_region_next(rec, &tab[i]);
    *out = tab;
    return KVL_OK;
}

const uint8_t *kvl_dec_region_next(const uint8_t *p, kvl_region_info *r)
{
    r->id = ld_u64(p);
    r->size = ld_u64(p + 8);
    r->rights = ld_u32(p + 16);
    r->mem = ld_u32(p + 20);
    memcpy(r->name, p + 24, sizeof r->name);
    r->name[sizeof r->name - 1] = '\0';
    r->rkey_len = (uint32_t)p[88] | (uint32_t)p[89] << 8;
    memcpy(r->rkey, p + KVL_WIRE_REGION_BYTES, r->rkey_len);
    return p + KVL_WIRE_REGION_BYTES + r->rkey_len;
}

void kvl_enc_chunk(kvl_buf *b, uint64_t xfer, uint32_t chunk, uint32_t attempt,
                   uint32_t n_pieces)
{
    put_u64(b, xfer);
    put_u32(b, chunk);
    put_u32(b, attempt);
    put_u32(b, n_pieces);
}

void kvl_enc_piece(kvl_buf *b, const kvl_wire_piece *p)
{
    put_u64(b, p->region);
    put_u64(b, p->offset);
    put_u64(b, p->len);
}

void kvl_enc_keys(kvl_buf *b, uint32_t n) { put_u32(b, n); }

void kvl_enc_key(kvl_buf *b, uint64_t region, const uint8_t key[KVL_KEY_BYTES])
{
    put_u64(b, region);
    kvl_buf_put(b, key, KVL_KEY_BYTES);
}

kvl_err kvl_dec_chunk(const uint8_t *body, size_t len, kvl_msg_chunk *m)
{
    return kvl_dec_chunk_flags(body, len, 0, m);
}

kvl_err kvl_dec_chunk_flags(const uint8_t *body, size_t len, uint16_t flags, kvl_msg_chunk *m)
{
    rd r = {body, len, 0, 0};
    m->dst = NULL;
    m->xfer = get_u64(&r);
    m->chunk = get_u32(&r);
    m->attempt = get_u32(&r);
    m->n_pieces = get_u32(&r);
    if (r.bad)
        return finish(&r, "chunk");
    if (m->n_pieces == 0 || m->n_pieces > KVL_MAX_PIECES)
        return kvl_fail(KVL_ERR_PROTOCOL, "chunk frame with %u pieces (1..%u allowed)",
                        m->n_pieces, KVL_MAX_PIECES);
    m->pieces = take(&r, (size_t)m->n_pieces * KVL_WIRE_PIECE_BYTES);
    m->n_keys = get_u32(&r);
    if (r.bad)
        return finish(&r, "chunk");
    if (m->n_keys == 0 || m->n_keys > m->n_pieces)
        return kvl_fail(KVL_ERR_PROTOCOL, "chunk frame with %u access keys for %u pieces",
                        m->n_keys, m->n_pieces);
    m->keys = take(&r, (size_t)m->n_keys * KVL_WIRE_KEY_BYTES);
    for (uint32_t i = 1; m->keys && i < m->n_keys; i++)
        if (ld_u64(m->keys + (size_t)i * KVL_WIRE_KEY_BYTES) <=
            ld_u64(m->keys + (size_t)(i - 1) * KVL_WIRE_KEY_BYTES))
            return kvl_fail(KVL_ERR_PROTOCOL, "chunk frame: access keys not in ascending order");
    if (flags & KVL_HF_DST)
        m->dst = take(&r, (size_t)m->n_pieces * KVL_WIRE_DST_BYTES);
    return finish(&r, "chunk");
}

void kvl_dec_dst_piece(const kvl_msg_chunk *m, uint32_t i, kvl_wire_piece *p)
{
    kvl_wire_piece src;
    kvl_dec_piece(m, i, &src);
    const uint8_t *q = m->dst + (size_t)i * KVL_WIRE_DST_BYTES;
    p->region = ld_u64(q);
    p->offset = ld_u64(q + 8);
    p->len = src.len;
}

void kvl_enc_dst(kvl_buf *b, uint64_t region, uint64_t offset)
{
    put_u64(b, region);
    put_u64(b, offset);
}

const uint8_t *kvl_dec_key_for(const kvl_msg_chunk *m, uint64_t region)
{
    uint32_t lo = 0, hi = m->n_keys;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        uint64_t id = ld_u64(m->keys + (size_t)mid * KVL_WIRE_KEY_BYTES);
        if (id == region)
            return m->keys + (size_t)mid * KVL_WIRE_KEY_BYTES + 8;
        if (id < region)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

void kvl_dec_piece(const kvl_msg_chunk *m, uint32_t i, kvl_wire_piece *p)
{
    const uint8_t *q = m->pieces + (size_t)i * KVL_WIRE_PIECE_BYTES;
    p->region = ld_u64(q);
    p->offset = ld_u64(q + 8);
    p->len = ld_u64(q + 16);
}

void kvl_enc_status(kvl_buf *b, const kvl_msg_status *m)
{
    put_u64(b, m->xfer);
    put_u32(b, m->chunk);
    put_u32(b, m->attempt);
    put_u32(b, m->status);
    put_str(b, m->msg, sizeof m->msg - 1);
}

kvl_err kvl_dec_status(const uint8_t *body, size_t len, kvl_msg_status *m)
{
    rd r = {body, len, 0, 0};
    m->xfer = get_u64(&r);
    m->chunk = get_u32(&r);
    m->attempt = get_u32(&r);
    m->status = get_u32(&r);
    get_str(&r, m->msg, sizeof m->msg);
    return finish(&r, "ACK/READ_RESP/END");
}

void kvl_enc_notify(kvl_buf *b, uint64_t xfer, uint32_t op, const void *tag, uint32_t len)
{
    put_u64(b, xfer);
    put_u32(b, op);
    put_u32(b, len);
    kvl_buf_put(b, tag, len);
}

kvl_err kvl_dec_notify(const uint8_t *body, size_t len, kvl_msg_notify *m)
{
    rd r = {body, len, 0, 0};
    m->xfer = get_u64(&r);
    m->op = get_u32(&r);
    m->tag_len = get_u32(&r);
    if (m->tag_len > KVL_MAX_TAG || m->op < KVL_OP_PUSH || m->op > KVL_OP_PREPARE)
        r.bad = 1;
    m->tag = take(&r, m->tag_len);
    return finish(&r, "NOTIFY");
}

void kvl_enc_token(kvl_buf *b, uint64_t token) { put_u64(b, token); }

kvl_err kvl_dec_token(const uint8_t *body, size_t len, uint64_t *token)
{
    rd r = {body, len, 0, 0};
    *token = get_u64(&r);
    return finish(&r, "PING/PONG/NOTIFY_ACK");
}

void kvl_enc_announce(kvl_buf *b, const kvl_msg_announce *m, const uint32_t *layer_first,
                      const uint32_t *layer_last)
{
    put_u64(b, m->xfer);
    put_u64(b, m->bytes);
    put_u32(b, m->n_chunks);
    put_u32(b, m->n_layers);
    put_u32(b, m->timeout_ms);
    put_u32(b, m->tag_len);
    kvl_buf_put(b, m->tag, m->tag_len);
    for (uint32_t i = 0; i < m->n_chunks; i++) {
        put_u32(b, layer_first[i]);
        put_u32(b, layer_last[i]);
    }
}

kvl_err kvl_dec_announce(const uint8_t *body, size_t len, kvl_msg_announce *m)
{
    rd r = {body, len, 0, 0};
    m->xfer = get_u64(&r);
    m->bytes = get_u64(&r);
    m->n_chunks = get_u32(&r);
    m->n_layers = get_u32(&r);
    m->timeout_ms = get_u32(&r);
    m->tag_len = get_u32(&r);
    if (m->tag_len > KVL_MAX_TAG || m->n_chunks == 0 || m->n_chunks > KVL_MAX_XFER_CHUNKS ||
        m->n_layers == 0 || m->n_layers > KVL_MAX_LAYERS || m->bytes < m->n_chunks ||
        m->xfer == 0)
        r.bad = 1;
    m->tag = r.bad ? NULL : take(&r, m->tag_len);
    m->map = r.bad ? NULL : take(&r, (size_t)m->n_chunks * 8);
    kvl_err e = finish(&r, "ANNOUNCE");
    if (e)
        return e;
    /* the chunk map is layer-major: each chunk starts in the layer the one
     * before it ended in, or later.  So the ranges add up to at most
     * n_chunks + n_layers, and the receiver's per-layer work stays linear. */
    uint32_t prev = 0;
    for (uint32_t i = 0; i < m->n_chunks; i++) {
        uint32_t lf, ll;
        kvl_dec_announce_chunk(m, i, &lf, &ll);
        if (lf > ll || ll >= m->n_layers || lf < prev)
            return kvl_fail(KVL_ERR_PROTOCOL, "ANNOUNCE: chunk %u has layers [%u, %u]", i, lf, ll);
        prev = ll;
    }
    return KVL_OK;
}

void kvl_dec_announce_chunk(const kvl_msg_announce *m, uint32_t i, uint32_t *layer_first,
                            uint32_t *layer_last)
{
    *layer_first = ld_u32(m->map + (size_t)i * 8);
    *layer_last = ld_u32(m->map + (size_t)i * 8 + 4);
}

int kvl_region_learnt_ok(const kvl_region_info *tab, size_t n, uint64_t id, uint64_t size,
                         const char *who, char *why, size_t why_len)
{
    const kvl_region_info *r = kvl_region_table_find(tab, n, id);
    if (!r)
        return 1;
    if (!(r->rights & KVL_REMOTE_WRITE))
        snprintf(why, why_len,
                 "%s key for region %llu, which the peer's region table does not open for "
                 "remote writes: peer broken or hostile, running TCP",
                 who, (unsigned long long)id);
    else if (size != r->size)
        snprintf(why, why_len,
                 "%s key of region %llu covers %llu bytes, the peer's region table says "
                 "%llu: peer broken or hostile, running TCP",
                 who, (unsigned long long)id, (unsigned long long)size,
                 (unsigned long long)r->size);
    else
        return 1;
    return 0;
}

const kvl_region_info *kvl_region_table_find(const kvl_region_info *tab, size_t n, uint64_t id)
{
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (tab[mid].id < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < n && tab[lo].id == id ? &tab[lo] : NULL;
}
