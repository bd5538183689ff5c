/* fuzz_wire.c: coverage-guided fuzzing of every frame decoder in csrc/wire.c
 * and of the UCX transport's message bodies (csrc/transport/ucx/msg.c)
 * (libFuzzer, under ASan and UBSan).
 *
 * One harness for all of them: the first input byte picks the decoder, the
 * rest is the body (the 24-byte header for kvl_hdr_decode).  libFuzzer hands
 * over a buffer of exactly that size, so a decoder reading one byte too far
 * is an ASan report.  What a decoder accepted is checked the way
 * test_wire.c's run_decoder checks it (every pointer inside the body, every
 * count in range, every string terminated, the tail read through the
 * product's own accessors); where the encoding has no strings, the accepted
 * message must also encode back to the very same bytes.  A broken invariant
 * aborts with a message, which libFuzzer reports as a crash with its input.
 *
 *   make -C tests/c fuzz-short    seeds, then a bounded run (part of make test)
 *   make -C tests/c fuzz          a long run (FUZZ_SECONDS, default 300)
 *
 * Built with -DKVL_FUZZ_SEEDS instead (any compiler, no libFuzzer) it is a
 * program that writes the seed corpus: one valid body per decoder and shape,
 * made with the product's encoders, prefixed with its selector byte.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "transport/ucx/msg.h"

enum {
    F_HDR, F_HELLO, F_HELLO_ACK, F_CHUNK, F_STATUS, F_NOTIFY, F_ANNOUNCE, F_TOKEN,
    F_CHALLENGE, F_AUTH, F_UCX_SETUP, F_UCX_KEYS, F_UCX_REFUSE, F_N
};

#define REQUIRE(cond)                                                                     \
    do {                                                                                  \
        if (!(cond)) {                                                                    \
            fprintf(stderr, "fuzz_wire: invariant broken at %s:%d: %s\n", __FILE__,       \
                    __LINE__, #cond);                                                     \
            abort();                                                                      \
        }                                                                                 \
    } while (0)

/* The accepted message, encoded again, is exactly the input. */
static void same_bytes(const kvl_buf *b, size_t from, const uint8_t *want, size_t len)
{
    REQUIRE(!b->oom);
    REQUIRE(b->len - from == len);
    REQUIRE(len == 0 || memcmp(b->p + from, want, len) == 0);
}

/* 1 if kvl_hdr_decode accepted the header. */
static int fuzz_hdr(const uint8_t *in, size_t len)
{
    if (len != KVL_HDR_BYTES)
        return 0; /* kvl_hdr_decode reads exactly 24 bytes: callers guarantee that much */
    kvl_frame_hdr h;
    memset(&h, 0xa5, sizeof h);
    kvl_err e = kvl_hdr_decode(in, &h);
    if (e != KVL_OK) {
        REQUIRE(e == KVL_ERR_PROTOCOL || e == KVL_ERR_HANDSHAKE);
        REQUIRE(kvl_last_error()[0]);
        return 0;
    }
    REQUIRE(h.type >= 1 && h.type <= KVL_F_TYPE_MAX);
    REQUIRE(h.body_len <= KVL_MAX_BODY && h.payload_len <= KVL_MAX_CHUNK);
    REQUIRE(h.payload_len == 0 || h.type == KVL_F_DATA || h.type == KVL_F_READ_RESP);
    REQUIRE((h.flags & ~(KVL_HF_OOB | KVL_HF_DST)) == 0 &&
            (!(h.flags & KVL_HF_OOB) || h.payload_len) &&
            (!(h.flags & KVL_HF_DST) || h.type == KVL_F_READ_REQ));
    uint8_t again[KVL_HDR_BYTES];
    kvl_hdr_encode(again, &h);
    REQUIRE(memcmp(again, in, KVL_HDR_BYTES) == 0);
    return 1;
}

/* Decoder k over body; 1 if it accepted the body. */
static int fuzz_body(int k, const uint8_t *body, size_t len)
{
    const uint8_t *end = body + len;
    kvl_err e = KVL_ERR_PROTOCOL;
    kvl_clear_error();
    kvl_buf b = {0};
    switch (k) {
    case F_HELLO: {
        kvl_msg_hello m;
        memset(&m, 0xa5, sizeof m);
        if ((e = kvl_dec_hello(body, len, &m)) != KVL_OK)
            break;
        size_t n = strnlen(m.name, sizeof m.name);
        REQUIRE(n > 0 && n < sizeof m.name);
        REQUIRE(m.kind <= KVL_CONN_DATA);
        REQUIRE(m.kind != KVL_CONN_DATA || m.path < KVL_MAX_PATHS);
        REQUIRE((m.flags & ~KVL_HELLO_AUTH) == 0);
        REQUIRE((m.movers & ~(uint32_t)KVL_MOVERS_KNOWN) == 0 && !(m.movers & (m.movers - 1)));
        REQUIRE(!m.movers || m.kind == KVL_CONN_DATA);
        break;
    }
    case F_HELLO_ACK: {
        kvl_msg_hello_ack m;
        memset(&m, 0xa5, sizeof m);
        if ((e = kvl_dec_hello_ack(body, len, &m)) != KVL_OK)
            break;
        REQUIRE(strnlen(m.name, sizeof m.name) < sizeof m.name);
        REQUIRE(strnlen(m.msg, sizeof m.msg) < sizeof m.msg);
        REQUIRE(m.n_regions <= KVL_MAX_REGIONS);
        REQUIRE(m.regions >= body && m.regions <= end);
        const uint8_t *rec = m.regions;
        for (uint32_t i = 0; i < m.n_regions; i++) {
            kvl_region_info r;
            rec = kvl_dec_region_next(rec, &r);
            REQUIRE(strnlen(r.name, sizeof r.name) < sizeof r.name);
            REQUIRE(r.rkey_len <= KVL_MAX_RKEY && rec <= end);
        }
        REQUIRE(rec == end); /* the records fill the rest of the body exactly */
        kvl_region_info *tab = NULL;
        if (kvl_dec_region_table(&m, &tab) == KVL_OK) {
            for (uint32_t i = 0; i < m.n_regions; i++)
                REQUIRE(tab[i].rkey_len <= KVL_MAX_RKEY);
            free(tab);
        }
        break;
    }
    case F_CHUNK: {
        kvl_msg_chunk m;
        memset(&m, 0xa5, sizeof m);
        if (kvl_dec_chunk_flags(body, len, KVL_HF_DST, &m) == KVL_OK) {
            /* a DST READ_REQ: the destinations fill the rest of the body */
            REQUIRE(m.dst && m.dst + (size_t)m.n_pieces * KVL_WIRE_DST_BYTES == end);
            for (uint32_t i = 0; i < m.n_pieces; i++) {
                kvl_wire_piece d;
                kvl_dec_dst_piece(&m, i, &d);
            }
        }
        memset(&m, 0xa5, sizeof m);
        if ((e = kvl_dec_chunk(body, len, &m)) != KVL_OK)
            break;
        REQUIRE(m.dst == NULL);
        REQUIRE(m.n_pieces >= 1 && m.n_pieces <= KVL_MAX_PIECES);
        REQUIRE(m.n_keys >= 1 && m.n_keys <= m.n_pieces);
        REQUIRE(m.pieces >= body &&
                m.keys == m.pieces + (size_t)m.n_pieces * KVL_WIRE_PIECE_BYTES + 4 &&
                m.keys + (size_t)m.n_keys * KVL_WIRE_KEY_BYTES == end);
        kvl_enc_chunk(&b, m.xfer, m.chunk, m.attempt, m.n_pieces);
        for (uint32_t i = 0; i < m.n_pieces; i++) {
            kvl_wire_piece p;
            kvl_dec_piece(&m, i, &p);
            kvl_enc_piece(&b, &p);
            (void)kvl_dec_key_for(&m, p.region);
        }
        kvl_enc_keys(&b, m.n_keys);
        for (uint32_t i = 0; i < m.n_keys; i++) {
            const uint8_t *k = m.keys + (size_t)i * KVL_WIRE_KEY_BYTES;
            uint64_t id = 0;
            for (int j = 7; j >= 0; j--)
                id = id << 8 | k[j];
            REQUIRE(kvl_dec_key_for(&m, id) == k + 8);
            kvl_enc_key(&b, id, k + 8);
        }
        same_bytes(&b, 0, body, len);
        break;
    }
    case F_STATUS: {
        kvl_msg_status m;
        memset(&m, 0xa5, sizeof m);
        if ((e = kvl_dec_status(body, len, &m)) != KVL_OK)
            break;
        REQUIRE(strnlen(m.msg, sizeof m.msg) < sizeof m.msg);
        break;
    }
    case F_NOTIFY: {
        kvl_msg_notify m;
        memset(&m, 0xa5, sizeof m);
        if ((e = kvl_dec_notify(body, len, &m)) != KVL_OK)
            break;
        REQUIRE(m.tag_len <= KVL_MAX_TAG);
        REQUIRE(m.op >= KVL_OP_PUSH && m.op <= KVL_OP_PREPARE); /* issue 10, item 5 */
        REQUIRE(m.tag >= body && m.tag + m.tag_len == end);
        kvl_enc_notify(&b, m.xfer, m.op, m.tag, m.tag_len);
        same_bytes(&b, 0, body, len);
        break;
    }
    case F_ANNOUNCE: {
        kvl_msg_announce m;
        memset(&m, 0xa5, sizeof m);
        if ((e = kvl_dec_announce(body, len, &m)) != KVL_OK)
            break;
        REQUIRE(m.xfer && m.tag_len <= KVL_MAX_TAG);
        REQUIRE(m.n_chunks >= 1 && m.n_chunks <= KVL_MAX_XFER_CHUNKS);
        REQUIRE(m.n_layers >= 1 && m.n_layers <= KVL_MAX_LAYERS);
        REQUIRE(m.bytes >= m.n_chunks);
        REQUIRE(m.tag >= body && m.map == m.tag + m.tag_len &&
                m.map + (size_t)m.n_chunks * 8 == end);
        uint32_t *lf = malloc(sizeof *lf * m.n_chunks), *ll = malloc(sizeof *ll * m.n_chunks);
        REQUIRE(lf && ll);
        uint32_t prev = 0;
        for (uint32_t i = 0; i < m.n_chunks; i++) { /* what the receiver relies on */
            kvl_dec_announce_chunk(&m, i, &lf[i], &ll[i]);
            REQUIRE(lf[i] <= ll[i] && ll[i] < m.n_layers && lf[i] >= prev);
            prev = ll[i];
        }
        kvl_enc_announce(&b, &m, lf, ll);
        same_bytes(&b, 0, body, len);
        free(lf);
        free(ll);
        break;
    }
    case F_TOKEN: {
        uint64_t t;
        if ((e = kvl_dec_token(body, len, &t)) != KVL_OK)
            break;
        kvl_enc_token(&b, t);
        same_bytes(&b, 0, body, len);
        break;
    }
    case F_CHALLENGE: {
        kvl_msg_challenge m;
        memset(&m, 0xa5, sizeof m);
        if ((e = kvl_dec_challenge(body, len, &m)) != KVL_OK)
            break;
        REQUIRE(strnlen(m.name, sizeof m.name) < sizeof m.name);
        break;
    }
    case F_AUTH: {
        kvl_msg_auth m;
        if ((e = kvl_dec_auth(body, len, &m)) != KVL_OK)
            break;
        kvl_enc_auth(&b, &m);
        same_bytes(&b, 0, body, len);
        break;
    }
    case F_UCX_SETUP:
    case F_UCX_KEYS: {
        kvl_ucx_setup s;
        if ((e = kvl_ucx_dec_setup(body, len, k == F_UCX_SETUP, &s)) != KVL_OK)
            break;
        REQUIRE(s.addr_len == 0 || (s.addr >= body && s.addr + s.addr_len <= end));
        for (uint32_t i = 0; i < s.n_keys; i++)
            REQUIRE(s.keys[i].key >= body && s.keys[i].key + s.keys[i].key_len <= end);
        REQUIRE(kvl_ucx_enc_setup(&b, s.addr, s.addr_len, s.keys, s.n_keys) == KVL_OK);
        kvl_ucx_setup_free(&s);
        same_bytes(&b, 0, body, len);
        break;
    }
    case F_UCX_REFUSE: {
        uint32_t st;
        char msg[256];
        if ((e = kvl_ucx_dec_refuse(body, len, &st, msg)) != KVL_OK)
            break;
        REQUIRE(strnlen(msg, sizeof msg) < sizeof msg);
        break;
    }
    default:
        break;
    }
    kvl_buf_free(&b);
    if (e != KVL_OK) {
        REQUIRE(e == KVL_ERR_PROTOCOL); /* a rejection is always PROTOCOL ... */
        REQUIRE(kvl_last_error()[0]);   /* ... and says why */
    }
    return e == KVL_OK;
}

#ifndef KVL_FUZZ_SEEDS

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    int k = data[0] % F_N;
    /* a copy of exactly the body's size, so its end is where ASan looks */
    size_t len = size - 1;
    uint8_t *body = malloc(len ? len : 1);
    if (!body)
        return 0;
    memcpy(body, data + 1, len);
    if (k == F_HDR)
        fuzz_hdr(body, len);
    else
        fuzz_body(k, body, len);
    free(body);
    return 0;
}

#else /* KVL_FUZZ_SEEDS: write the seed corpus */

static const char *seed_dir;
static int n_seeds;

static void seed(int k, const uint8_t *p, size_t len)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/seed-%02d-%03d", seed_dir, k, n_seeds++);
    FILE *f = fopen(path, "wb");
    if (!f || fputc(k, f) == EOF || (len && fwrite(p, 1, len, f) != len) || fclose(f)) {
        perror(path);
        exit(1);
    }
    /* a seed the harness would reject is a broken seed */
    if (!(k == F_HDR ? fuzz_hdr(p, len) : fuzz_body(k, p, len))) {
        fprintf(stderr, "fuzz_wire: seed %s is not valid: %s\n", path,
                kvl_last_error());
        exit(1);
    }
}

/* Body of a finished frame in b. */
static void seed_frame(int k, kvl_buf *b, uint8_t type, uint64_t payload_len)
{
    kvl_frame_finish(b, type, payload_len);
    if (b->oom)
        exit(1);
    seed(F_HDR, b->p, KVL_HDR_BYTES);
    seed(k, b->p + KVL_HDR_BYTES, b->len - KVL_HDR_BYTES);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s DIR (writes the seed corpus into DIR)\n", argv[0]);
        return 2;
    }
    seed_dir = argv[1];
    kvl_buf b = {0};

    for (int i = 0; i < 3; i++) {
        kvl_msg_hello h = {.instance = 0x1122334455667788ull + (uint64_t)i,
                           .kind = (uint8_t)(i ? KVL_CONN_DATA : KVL_CONN_CONTROL),
                           .path = (uint16_t)(i == 2 ? KVL_MAX_PATHS - 1 : 0),
                           .flags = (uint8_t)(i & KVL_HELLO_AUTH)};
        snprintf(h.name, sizeof h.name, "%s", i == 2 ? "an-agent-name-of-some-length" : "tx");
        memset(h.nonce, 0x5a + i, sizeof h.nonce);
        kvl_frame_start(&b);
        kvl_enc_hello(&b, &h);
        seed_frame(F_HELLO, &b, KVL_F_HELLO, 0);
    }

    kvl_region_info regs[3];
    memset(regs, 0, sizeof regs);
    for (int i = 0; i < 3; i++) {
        regs[i].id = (uint64_t)i + 1;
        regs[i].size = 4096ull << i;
        regs[i].rights = (uint32_t)i & 3;
        snprintf(regs[i].name, sizeof regs[i].name, "region-%d", i);
        regs[i].rkey_len = i == 2 ? 16 : 0;
        memset(regs[i].rkey, 0x77, regs[i].rkey_len);
    }
    for (int n = 0; n <= 3; n++) {
        kvl_frame_start(&b);
        kvl_enc_hello_ack(&b, n == 0 ? KVL_ERR_DUPLICATE_NAME : KVL_OK, 42, "victim",
                          n == 0 ? "refused: a reason" : "", regs, (size_t)n);
        seed_frame(F_HELLO_ACK, &b, n == 3 ? KVL_F_REGIONS : KVL_F_HELLO_ACK, 0);
    }

    for (uint32_t n = 1; n <= 3; n++) {
        kvl_frame_start(&b);
        kvl_enc_chunk(&b, 7, n - 1, n, n);
        for (uint32_t i = 0; i < n; i++) {
            kvl_wire_piece p = {.region = 1 + i, .offset = 4096ull * i, .len = 512};
            kvl_enc_piece(&b, &p);
        }
        kvl_enc_keys(&b, n);
        for (uint32_t i = 0; i < n; i++) {
            uint8_t key[KVL_KEY_BYTES];
            memset(key, (int)(0x40 + i), sizeof key);
            kvl_enc_key(&b, 1 + i, key);
        }
        seed_frame(F_CHUNK, &b, n == 2 ? KVL_F_READ_REQ : KVL_F_DATA, n == 2 ? 0 : 512ull * n);
    }

    for (int i = 0; i < 2; i++) {
        kvl_msg_status st = {.xfer = 7, .chunk = 3, .attempt = 2,
                             .status = i ? KVL_ERR_OUT_OF_BOUNDS : KVL_OK};
        snprintf(st.msg, sizeof st.msg, "%s", i ? "piece outside its region" : "");
        kvl_frame_start(&b);
        kvl_enc_status(&b, &st);
        seed_frame(F_STATUS, &b, i ? KVL_F_END : KVL_F_ACK, 0);
    }

    for (uint32_t op = KVL_OP_PUSH; op <= KVL_OP_PREPARE; op++) {
        kvl_frame_start(&b);
        kvl_enc_notify(&b, op == KVL_OP_PREPARE ? 0 : 9, op, "a-tag", op == 1 ? 0 : 5);
        seed_frame(F_NOTIFY, &b, KVL_F_NOTIFY, 0);
    }

    {
        uint32_t lf[4] = {0, 0, 1, 3}, ll[4] = {0, 1, 2, 3};
        kvl_msg_announce m = {.xfer = 5, .bytes = 1 << 20, .n_chunks = 4, .n_layers = 4,
                              .timeout_ms = 30000, .tag_len = 3, .tag = (const uint8_t *)"tag"};
        kvl_frame_start(&b);
        kvl_enc_announce(&b, &m, lf, ll);
        seed_frame(F_ANNOUNCE, &b, KVL_F_ANNOUNCE, 0);
        m.n_chunks = 1;
        m.n_layers = 1;
        m.tag_len = 0;
        kvl_frame_start(&b);
        kvl_enc_announce(&b, &m, lf, lf);
        seed_frame(F_ANNOUNCE, &b, KVL_F_ANNOUNCE, 0);
    }

    kvl_frame_start(&b);
    kvl_enc_token(&b, 0x0123456789abcdefull);
    seed_frame(F_TOKEN, &b, KVL_F_PING, 0);

    {
        kvl_msg_challenge ch = {.instance = 99};
        snprintf(ch.name, sizeof ch.name, "victim");
        memset(ch.nonce, 0x3c, sizeof ch.nonce);
        memset(ch.mac, 0xc3, sizeof ch.mac);
        kvl_frame_start(&b);
        kvl_enc_challenge(&b, &ch);
        seed_frame(F_CHALLENGE, &b, KVL_F_CHALLENGE, 0);
        kvl_msg_auth au = {.status = 0};
        memset(au.mac, 0xee, sizeof au.mac);
        kvl_frame_start(&b);
        kvl_enc_auth(&b, &au);
        seed_frame(F_AUTH, &b, KVL_F_AUTH, 0);
    }
    {
        uint8_t addr[48], key[9];
        memset(addr, 0x11, sizeof addr);
        memset(key, 0x22, sizeof key);
        kvl_ucx_key_view keys[2] = {{3, 0x7f0000001000ull, 1 << 20, key, sizeof key},
                                    {8, 0x7f0000200000ull, 4096, key, 1}};
        for (uint32_t n = 0; n <= 2; n++) {
            kvl_buf_free(&b);
            if (kvl_ucx_enc_setup(&b, addr, sizeof addr, keys, n) != KVL_OK || b.oom)
                exit(1);
            seed(F_UCX_SETUP, b.p, b.len);
            kvl_buf_free(&b);
            if (kvl_ucx_enc_setup(&b, NULL, 0, keys, n) != KVL_OK || b.oom)
                exit(1);
            seed(F_UCX_KEYS, b.p, b.len);
        }
        kvl_buf_free(&b);
        kvl_ucx_enc_refuse(&b, 7, "UCX not loaded");
        seed(F_UCX_REFUSE, b.p, b.len);
    }
    kvl_buf_free(&b);
    printf("fuzz_wire: %d seeds in %s\n", n_seeds, seed_dir);
    return 0;
}

#endif
