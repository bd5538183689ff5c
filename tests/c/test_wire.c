/* test_wire.c: frame encoding round trips and the decoders' rejections.
 *
 * Every body handed to a decoder here lives in a malloc of exactly its
 * length, so under ASan a decoder that reads one byte too far aborts the
 * run instead of passing by luck.
 */
#include <string.h>

#include "internal.h"
#include "test_main.h"

/* ---- helpers ---- */

/* An exact-size heap copy of [p, p+n) (n may be 0). */
static uint8_t *dup_exact(const void *p, size_t n)
{
    uint8_t *d = malloc(n);
    if (n && !d) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    if (n)
        memcpy(d, p, n);
    return d;
}

/* A finished frame and where its body is. */
typedef struct frame {
    kvl_buf b;
    const uint8_t *body;
    size_t len;
} frame;

static void frame_done(frame *f, uint8_t type, uint64_t payload_len)
{
    kvl_frame_finish(&f->b, type, payload_len);
    if (!CHECK(!f->b.oom && f->b.len >= KVL_HDR_BYTES))
        exit(2);
    f->body = f->b.p + KVL_HDR_BYTES;
    f->len = f->b.len - KVL_HDR_BYTES;

    /* Every frame's header must decode to what finish was asked for. */
    uint8_t *hdr = dup_exact(f->b.p, KVL_HDR_BYTES);
    kvl_frame_hdr h;
    kvl_err e = kvl_hdr_decode(hdr, &h);
    CHECKF(e == KVL_OK, "header of type %u: %s", type, kvl_last_error());
    CHECK_EQ_U64(h.type, type);
    CHECK_EQ_U64(h.body_len, f->len);
    CHECK_EQ_U64(h.body_crc, kvl_crc32c(0, f->body, f->len));
    CHECK_EQ_U64(h.payload_len, payload_len);
    free(hdr);
}

typedef enum dec_kind {
    D_HELLO, D_HELLO_ACK, D_CHUNK, D_STATUS, D_NOTIFY, D_ANNOUNCE, D_CHALLENGE, D_AUTH, D_N
} dec_kind;
static const char *const dec_names[D_N] = {"hello",  "hello_ack", "chunk",     "status",
                                           "notify", "announce",  "challenge", "auth"};

/* Runs decoder k on [body, body+len) (copied to an exact-size buffer) and
 * checks that what it accepted is safe to use: every pointer it returns lies
 * in the body, every count is in range, every string is terminated.  The
 * tail reads go through the product's own accessors so ASan sees them. */
static kvl_err run_decoder(dec_kind k, const uint8_t *src, size_t len)
{
    uint8_t *body = dup_exact(src, len);
    kvl_err e = KVL_ERR_PROTOCOL;
    kvl_clear_error(); /* so a rejection is seen to leave its own message */
    const uint8_t *end = body + len;
    switch (k) {
    case D_HELLO: {
        kvl_msg_hello m;
        memset(&m, 0xa5, sizeof m);
        e = kvl_dec_hello(body, len, &m);
        if (e == KVL_OK) {
            size_t n = strnlen(m.name, sizeof m.name);
            CHECK(n > 0 && n < sizeof m.name);
            CHECK(m.kind <= KVL_CONN_DATA);
            CHECK(m.kind != KVL_CONN_DATA || m.path < KVL_MAX_PATHS);
        }
        break;
    }
    case D_HELLO_ACK: {
        kvl_msg_hello_ack m;
        memset(&m, 0xa5, sizeof m);
        e = kvl_dec_hello_ack(body, len, &m);
        if (e == KVL_OK) {
            CHECK(strnlen(m.name, sizeof m.name) < sizeof m.name);
            CHECK(strnlen(m.msg, sizeof m.msg) < sizeof m.msg);
            CHECK(m.n_regions <= KVL_MAX_REGIONS);
            if (CHECK(m.regions >= body && m.regions <= end)) {
                const uint8_t *rec = m.regions;
                for (uint32_t i = 0; i < m.n_regions; i++) {
                    kvl_region_info r;
                    rec = kvl_dec_region_next(rec, &r);
                    CHECK(strnlen(r.name, sizeof r.name) < sizeof r.name);
                    CHECK(r.rkey_len <= KVL_MAX_RKEY && rec <= end);
                }
                CHECK(rec == end); /* the records fill the rest of the body exactly */
            }
        }
        break;
    }
    case D_CHUNK: {
        kvl_msg_chunk m;
        memset(&m, 0xa5, sizeof m);
        e = kvl_dec_chunk(body, len, &m);
        if (e == KVL_OK) {
            CHECK(m.n_pieces >= 1 && m.n_pieces <= KVL_MAX_PIECES);
            if (CHECK(m.pieces >= body &&
                      m.pieces + (size_t)m.n_pieces * KVL_WIRE_PIECE_BYTES < end)) {
                for (uint32_t i = 0; i < m.n_pieces; i++) {
                    kvl_wire_piece p;
                    kvl_dec_piece(&m, i, &p);
                    (void)kvl_dec_key_for(&m, p.region);
                }
            }
            CHECK(m.n_keys >= 1 && m.n_keys <= m.n_pieces);
            CHECK(m.keys == m.pieces + (size_t)m.n_pieces * KVL_WIRE_PIECE_BYTES + 4 &&
                  m.keys + (size_t)m.n_keys * KVL_WIRE_KEY_BYTES == end);
        }
        break;
    }
    case D_STATUS: {
        kvl_msg_status m;
        memset(&m, 0xa5, sizeof m);
        e = kvl_dec_status(body, len, &m);
        if (e == KVL_OK)
            CHECK(strnlen(m.msg, sizeof m.msg) < sizeof m.msg);
        break;
    }
    case D_NOTIFY: {
        kvl_msg_notify m;
        memset(&m, 0xa5, sizeof m);
        e = kvl_dec_notify(body, len, &m);
        if (e == KVL_OK) {
            CHECK(m.tag_len <= KVL_MAX_TAG);
            if (CHECK(m.tag >= body && m.tag + m.tag_len == end))
                (void)kvl_crc32c(0, m.tag, m.tag_len); /* touches every tag byte */
        }
        break;
    }
    case D_ANNOUNCE: {
        kvl_msg_announce m;
        memset(&m, 0xa5, sizeof m);
        e = kvl_dec_announce(body, len, &m);
        if (e == KVL_OK) {
            CHECK(m.xfer && m.tag_len <= KVL_MAX_TAG);
            CHECK(m.n_chunks >= 1 && m.n_chunks <= KVL_MAX_XFER_CHUNKS);
            CHECK(m.n_layers >= 1 && m.n_layers <= KVL_MAX_LAYERS);
            if (CHECK(m.tag >= body && m.map == m.tag + m.tag_len &&
                      m.map + (size_t)m.n_chunks * 8 == end)) {
                uint32_t prev = 0;
                for (uint32_t i = 0; i < m.n_chunks; i++) { /* what the receiver relies on */
                    uint32_t lf, ll;
                    kvl_dec_announce_chunk(&m, i, &lf, &ll);
                    CHECK(lf <= ll && ll < m.n_layers && lf >= prev);
                    prev = lf;
                }
            }
        }
        break;
    }
    case D_CHALLENGE: {
        kvl_msg_challenge m;
        memset(&m, 0xa5, sizeof m);
        e = kvl_dec_challenge(body, len, &m);
        if (e == KVL_OK)
            CHECK(strnlen(m.name, sizeof m.name) < sizeof m.name);
        break;
    }
    case D_AUTH: {
        kvl_msg_auth m;
        e = kvl_dec_auth(body, len, &m);
        break;
    }
    default:
        break;
    }
    if (e != KVL_OK)
        CHECKF(kvl_last_error()[0], "%s decoder failed (%d) without a message", dec_names[k],
               e);
    free(body);
    return e;
}

/* A rejection must be KVL_ERR_PROTOCOL. */
#define EXPECT_PROTOCOL(k, body, len, why)                                                \
    do {                                                                                  \
        kvl_err e_ = run_decoder((k), (body), (len));                                     \
        CHECKF(e_ == KVL_ERR_PROTOCOL, "%s: %s decoder returned %d (%s)", (why),          \
               dec_names[k], e_, kvl_err_name(e_));                                       \
    } while (0)

/* Every proper prefix of a valid body, and the body plus trailing bytes,
 * must be rejected; the body itself accepted. */
static void check_truncations(dec_kind k, const uint8_t *body, size_t len, const char *what)
{
    CHECKF(run_decoder(k, body, len) == KVL_OK, "%s: valid body rejected: %s", what,
           kvl_last_error());
    for (size_t n = 0; n < len; n++) {
        kvl_err e = run_decoder(k, body, n);
        CHECKF(e == KVL_ERR_PROTOCOL, "%s truncated to %zu of %zu bytes: got %d", what, n, len,
               e);
    }
    uint8_t *longer = malloc(len + 8);
    if (!CHECK(longer))
        return;
    memcpy(longer, body, len);
    memset(longer + len, 0, 8);
    for (size_t extra = 1; extra <= 8; extra++) {
        kvl_err e = run_decoder(k, longer, len + extra);
        CHECKF(e == KVL_ERR_PROTOCOL, "%s with %zu trailing bytes: got %d", what, extra, e);
    }
    free(longer);
}

/* A string of n copies of c, terminated (n < cap). */
static void fill_str(char *dst, size_t n, char c)
{
    memset(dst, c, n);
    dst[n] = '\0';
}

/* ---- pool of valid bodies for the fuzzer ---- */

typedef struct sample {
    dec_kind k;
    uint8_t *body;
    size_t len;
} sample;

static sample pool[64];
static size_t n_pool;

static void keep(dec_kind k, const frame *f)
{
    if (n_pool < sizeof pool / sizeof pool[0])
        pool[n_pool++] = (sample){k, dup_exact(f->body, f->len), f->len};
}

/* ---- header ---- */

static void test_header(void)
{
    static const kvl_frame_hdr cases[] = {
        {KVL_F_HELLO, 0, 0, 0, 0},
        {KVL_F_DATA, KVL_HF_OOB, 12345, 0xdeadbeef, 1ull << 30},
        {KVL_F_READ_RESP, KVL_HF_OOB, KVL_MAX_BODY, 0xffffffffu, 1},
        {KVL_F_DATA, KVL_HF_OOB, 12345, 7, 1ull << 26},
        {KVL_F_READ_REQ, KVL_HF_DST, 10, 7, 0},
        {KVL_F_REGIONS, 0, 1, 7, 0},
        {KVL_F_MOVER_OFFER, 0, 300, 7, 0},
        {KVL_F_MOVER_ACCEPT, 0, 300, 7, 0},
        {KVL_F_MOVER_KEYS, 0, 6, 7, 0},
        {KVL_F_MOVER_REFUSE, 0, 6, 7, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        uint8_t raw[KVL_HDR_BYTES];
        kvl_hdr_encode(raw, &cases[i]);
        /* The layout internal.h describes: "KVLK", version, type, ... */
        CHECK(memcmp(raw, "KVLK", 4) == 0);
        CHECK(raw[4] == KVL_PROTO_VERSION && raw[5] == cases[i].type);
        CHECK(raw[8] == (uint8_t)cases[i].body_len && raw[16] == (uint8_t)cases[i].payload_len);
        uint8_t *in = dup_exact(raw, sizeof raw);
        kvl_frame_hdr h;
        memset(&h, 0xa5, sizeof h);
        kvl_err e = kvl_hdr_decode(in, &h);
        if (CHECKF(e == KVL_OK, "case %zu: %s", i, kvl_last_error()))
            CHECK(h.type == cases[i].type && h.flags == cases[i].flags &&
                  h.body_len == cases[i].body_len && h.body_crc == cases[i].body_crc &&
                  h.payload_len == cases[i].payload_len);
        free(in);
    }

    /* Rejections, each starting from a valid header with one field broken. */
    struct {
        const char *why;
        int byte;           /* byte to overwrite, or -1 */
        uint8_t value;
        kvl_frame_hdr h;    /* header to encode first */
        kvl_err want;
    } bad[] = {
        {"magic byte 0", 0, 'X', {KVL_F_HELLO, 0, 10, 0, 0}, KVL_ERR_PROTOCOL},
        {"magic byte 3", 3, 0, {KVL_F_HELLO, 0, 10, 0, 0}, KVL_ERR_PROTOCOL},
        {"version 0", 4, 0, {KVL_F_HELLO, 0, 10, 0, 0}, KVL_ERR_HANDSHAKE},
        {"version 1", 4, 1, {KVL_F_HELLO, 0, 10, 0, 0}, KVL_ERR_HANDSHAKE},
        {"version 2", 4, 2, {KVL_F_HELLO, 0, 10, 0, 0}, KVL_ERR_HANDSHAKE},
        {"version 3", 4, 3, {KVL_F_HELLO, 0, 10, 0, 0}, KVL_ERR_HANDSHAKE},
        {"version 4", 4, 4, {KVL_F_HELLO, 0, 10, 0, 0}, KVL_ERR_HANDSHAKE},
        {"version 6", 4, 6, {KVL_F_HELLO, 0, 10, 0, 0}, KVL_ERR_HANDSHAKE},
        {"unknown header flag 8", -1, 0, {KVL_F_DATA, 8, 10, 0, 4096}, KVL_ERR_PROTOCOL},
        {"version 4's CMA flag", -1, 0, {KVL_F_DATA, 4, 10, 0, 4096}, KVL_ERR_PROTOCOL},
        {"OOB without a payload", -1, 0, {KVL_F_DATA, KVL_HF_OOB, 10, 0, 0}, KVL_ERR_PROTOCOL},
        {"DST on a DATA", -1, 0, {KVL_F_DATA, KVL_HF_DST, 10, 0, 4096}, KVL_ERR_PROTOCOL},
        {"DST on a READ_RESP", -1, 0, {KVL_F_READ_RESP, KVL_HF_DST, 10, 0, 0}, KVL_ERR_PROTOCOL},
        {"header flags 0xffff", -1, 0, {KVL_F_DATA, 0xffff, 10, 0, 4096}, KVL_ERR_PROTOCOL},
        {"OOB on a READ_RESP without a payload", -1, 0, {KVL_F_READ_RESP, KVL_HF_OOB, 10, 0, 0},
         KVL_ERR_PROTOCOL},
        {"OOB on an ACK", -1, 0, {KVL_F_ACK, KVL_HF_OOB, 10, 0, 0}, KVL_ERR_PROTOCOL},
        {"MOVER_OFFER with payload", -1, 0, {KVL_F_MOVER_OFFER, 0, 10, 0, 1}, KVL_ERR_PROTOCOL},
        {"version 255", 4, 255, {KVL_F_HELLO, 0, 10, 0, 0}, KVL_ERR_HANDSHAKE},
        {"type 0", -1, 0, {0, 0, 10, 0, 0}, KVL_ERR_PROTOCOL},
        {"type TYPE_MAX+1", -1, 0, {KVL_F_TYPE_MAX + 1, 0, 10, 0, 0}, KVL_ERR_PROTOCOL},
        {"type 200", -1, 0, {200, 0, 10, 0, 0}, KVL_ERR_PROTOCOL},
        {"body_len MAX+1", -1, 0, {KVL_F_HELLO, 0, KVL_MAX_BODY + 1, 0, 0}, KVL_ERR_PROTOCOL},
        {"body_len 2^32-1", -1, 0, {KVL_F_DATA, 0, 0xffffffffu, 0, 0}, KVL_ERR_PROTOCOL},
        {"HELLO with payload", -1, 0, {KVL_F_HELLO, 0, 10, 0, 1}, KVL_ERR_PROTOCOL},
        {"HELLO_ACK with payload", -1, 0, {KVL_F_HELLO_ACK, 0, 10, 0, 1}, KVL_ERR_PROTOCOL},
        {"ACK with payload", -1, 0, {KVL_F_ACK, 0, 10, 0, 4096}, KVL_ERR_PROTOCOL},
        {"READ_REQ with payload", -1, 0, {KVL_F_READ_REQ, 0, 10, 0, 1}, KVL_ERR_PROTOCOL},
        {"NOTIFY with payload", -1, 0, {KVL_F_NOTIFY, 0, 10, 0, 1}, KVL_ERR_PROTOCOL},
        {"REGIONS_REQ with payload", -1, 0, {KVL_F_REGIONS_REQ, 0, 0, 0, 1}, KVL_ERR_PROTOCOL},
        {"REGIONS with payload", -1, 0, {KVL_F_REGIONS, 0, 0, 0, 1}, KVL_ERR_PROTOCOL},
        {"DATA payload 1 GiB + 1", -1, 0, {KVL_F_DATA, 0, 10, 0, (1ull << 30) + 1},
         KVL_ERR_PROTOCOL},
        {"READ_RESP payload 2^64-1", -1, 0, {KVL_F_READ_RESP, 0, 10, 0, UINT64_MAX},
         KVL_ERR_PROTOCOL},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        uint8_t raw[KVL_HDR_BYTES];
        kvl_hdr_encode(raw, &bad[i].h);
        if (bad[i].byte >= 0)
            raw[bad[i].byte] = bad[i].value;
        uint8_t *in = dup_exact(raw, sizeof raw);
        kvl_frame_hdr h;
        kvl_clear_error();
        kvl_err e = kvl_hdr_decode(in, &h);
        CHECKF(e == bad[i].want, "%s: got %d (%s), expected %s", bad[i].why, e,
               kvl_err_name(e), kvl_err_name(bad[i].want));
        CHECKF(kvl_last_error()[0], "%s: no message", bad[i].why);
        free(in);
    }

    /* Random headers: any outcome but OK/PROTOCOL/HANDSHAKE is a bug, and
     * what OK lets through must respect the limits. */
    test_rng r = {0x68656164657273ull};
    for (int it = 0; it < 100000; it++) {
        uint8_t raw[KVL_HDR_BYTES];
        kvl_frame_hdr seed = {(uint8_t)rng_range(&r, 0, 12), 0, 0, 0, 0};
        kvl_hdr_encode(raw, &seed);
        /* Keep magic and version most of the time so the later checks run. */
        size_t from = rng_range(&r, 0, 3) ? 5 : 0;
        for (size_t i = from; i < KVL_HDR_BYTES; i++)
            if (rng_range(&r, 0, 2) == 0)
                raw[i] = (uint8_t)rng_u64(&r);
        if (rng_range(&r, 0, 1))
            raw[11] = raw[10] = raw[9] = 0; /* plausible body_len */
        if (rng_range(&r, 0, 1))
            memset(raw + 19, 0, 5); /* plausible payload_len */
        uint8_t *in = dup_exact(raw, sizeof raw);
        kvl_frame_hdr h;
        kvl_err e = kvl_hdr_decode(in, &h);
        CHECKF(e == KVL_OK || e == KVL_ERR_PROTOCOL || e == KVL_ERR_HANDSHAKE, "got %d", e);
        if (e == KVL_OK) {
            CHECK(h.type >= 1 && h.type <= KVL_F_TYPE_MAX);
            CHECK(h.body_len <= KVL_MAX_BODY);
            CHECK(h.payload_len <= KVL_MAX_CHUNK);
            CHECK(h.payload_len == 0 || h.type == KVL_F_DATA || h.type == KVL_F_READ_RESP);
        }
        free(in);
    }
}

/* kvl_frame_finish on a reused buffer, and body crc over the exact body. */
static void test_frame_finish(void)
{
    frame f = {0};
    kvl_frame_start(&f.b);
    kvl_enc_notify(&f.b, 1, 2, "abc", 3);
    frame_done(&f, KVL_F_NOTIFY, 0);
    size_t first_len = f.len;

    /* Reuse: start resets, the second frame owes nothing to the first. */
    kvl_frame_start(&f.b);
    frame_done(&f, KVL_F_REGIONS_REQ, 0);
    CHECK(f.len == 0 && first_len == 19);
    CHECK_EQ_U64(kvl_crc32c(0, f.body, 0), 0);

    kvl_frame_start(&f.b);
    kvl_enc_chunk(&f.b, 7, 8, 9, 1);
    kvl_wire_piece pc = {1, 2, 3};
    kvl_enc_piece(&f.b, &pc);
    frame_done(&f, KVL_F_DATA, 1ull << 30);
    CHECK(f.len == 20 + KVL_WIRE_PIECE_BYTES);
    kvl_buf_free(&f.b);
    CHECK(f.b.p == NULL && f.b.len == 0 && f.b.cap == 0);
}

/* ---- HELLO ---- */

static void test_hello(void)
{
    static const struct {
        uint64_t instance;
        uint8_t kind;
        uint16_t path;
        size_t name_len;
    } cases[] = {
        {0, KVL_CONN_CONTROL, 0, 1},
        {0x0123456789abcdefull, KVL_CONN_DATA, 0, 5},
        {UINT64_MAX, KVL_CONN_DATA, KVL_MAX_PATHS - 1, KVL_NAME_MAX - 1},
        {42, KVL_CONN_CONTROL, 0xffff, 17}, /* path is not checked on control */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kvl_msg_hello in = {.instance = cases[i].instance, .kind = cases[i].kind,
                            .path = cases[i].path, .flags = (uint8_t)(i & KVL_HELLO_AUTH)};
        if (cases[i].kind == KVL_CONN_DATA && i == 2)
            in.movers = KVL_MOVER_UCX; /* movers are named on data connections only */
        memset(in.nonce, (int)i + 1, sizeof in.nonce);
        fill_str(in.name, cases[i].name_len, (char)('a' + i));
        frame f = {0};
        kvl_frame_start(&f.b);
        kvl_enc_hello(&f.b, &in);
        frame_done(&f, KVL_F_HELLO, 0);
        CHECK(f.len ==
              8 + 1 + 2 + 2 + cases[i].name_len + 1 + KVL_NONCE_BYTES + KVL_TOKEN_BYTES + 4);
        kvl_msg_hello out;
        uint8_t *body = dup_exact(f.body, f.len);
        if (CHECKF(kvl_dec_hello(body, f.len, &out) == KVL_OK, "case %zu: %s", i,
                   kvl_last_error()))
            CHECK(out.instance == in.instance && out.kind == in.kind &&
                  out.path == in.path && strcmp(out.name, in.name) == 0 &&
                  out.flags == in.flags && out.movers == in.movers &&
                  memcmp(out.nonce, in.nonce, sizeof in.nonce) == 0);
        free(body);
        check_truncations(D_HELLO, f.body, f.len, "HELLO");
        keep(D_HELLO, &f);
        kvl_buf_free(&f.b);
    }

    /* A name longer than the wire allows is cut to KVL_NAME_MAX-1 bytes by
     * the encoder, so it still decodes. */
    {
        kvl_msg_hello in = {.instance = 1, .kind = KVL_CONN_CONTROL};
        memset(in.name, 'z', sizeof in.name); /* no terminator within the array */
        frame f = {0};
        kvl_frame_start(&f.b);
        kvl_enc_hello(&f.b, &in);
        frame_done(&f, KVL_F_HELLO, 0);
        kvl_msg_hello out;
        if (CHECK(run_decoder(D_HELLO, f.body, f.len) == KVL_OK)) {
            uint8_t *body = dup_exact(f.body, f.len);
            kvl_dec_hello(body, f.len, &out);
            CHECK(strlen(out.name) == KVL_NAME_MAX - 1);
            free(body);
        }
        kvl_buf_free(&f.b);
    }

    /* Hand-built bodies: u64 instance, u8 kind, u16 path, u16 name_len,
     * name, u8 flags, 16-byte nonce, 16-byte token, u32 movers (T bytes
     * after the name; the movers at byte 14 + 1 + 32 with a 1-byte name). */
    enum { T = 1 + KVL_NONCE_BYTES + KVL_TOKEN_BYTES + 4, MV = 14 + 1 + KVL_NONCE_BYTES + KVL_TOKEN_BYTES };
    uint8_t b[8 + 1 + 2 + 2 + 80 + T];
    memset(b, 0, sizeof b);
    b[8] = KVL_CONN_CONTROL;
    /* empty name */
    EXPECT_PROTOCOL(D_HELLO, b, 13 + T, "HELLO with an empty name");
    /* unknown kind */
    b[8] = 7;
    b[11] = 1;
    b[13] = 'n';
    EXPECT_PROTOCOL(D_HELLO, b, 14 + T, "HELLO with kind 7");
    b[8] = KVL_CONN_CONTROL;
    CHECK(run_decoder(D_HELLO, b, 14 + T) == KVL_OK);
    /* unknown flags */
    b[14] = 8;
    EXPECT_PROTOCOL(D_HELLO, b, 14 + T, "HELLO with flag 8");
    b[14] = 4; /* version 4's CMA flag: a mover now */
    EXPECT_PROTOCOL(D_HELLO, b, 14 + T, "HELLO with version 4's flag CMA");
    b[14] = KVL_HELLO_AUTH;
    CHECK(run_decoder(D_HELLO, b, 14 + T) == KVL_OK);
    /* a mover on a control connection: never named there */
    b[MV] = KVL_MOVER_SHM;
    EXPECT_PROTOCOL(D_HELLO, b, 14 + T, "HELLO with a mover on a control connection");
    b[8] = KVL_CONN_DATA;
    CHECK(run_decoder(D_HELLO, b, 14 + T) == KVL_OK);
    b[MV] = KVL_MOVER_SHM | KVL_MOVER_UCX;
    EXPECT_PROTOCOL(D_HELLO, b, 14 + T, "HELLO naming two movers");
    b[MV] = 0x80;
    EXPECT_PROTOCOL(D_HELLO, b, 14 + T, "HELLO naming an unknown mover");
    b[MV + 3] = 0x80;
    b[MV] = 0;
    EXPECT_PROTOCOL(D_HELLO, b, 14 + T, "HELLO naming an unknown mover (high bit)");
    b[MV + 3] = 0;
    b[8] = KVL_CONN_CONTROL;
    b[14] = 0;
    /* no flags and nonce (a version 2 HELLO) */
    EXPECT_PROTOCOL(D_HELLO, b, 14, "HELLO without flags and nonce");
    EXPECT_PROTOCOL(D_HELLO, b, 14 + 1 + KVL_NONCE_BYTES, "HELLO without its token");
    EXPECT_PROTOCOL(D_HELLO, b, 14 + T - 4, "HELLO without its movers (a version 4 HELLO)");
    /* name length field larger than the body */
    b[11] = 2 + T;
    EXPECT_PROTOCOL(D_HELLO, b, 14 + T, "HELLO name_len one past the body");
    b[11] = 0xff;
    b[12] = 0xff;
    EXPECT_PROTOCOL(D_HELLO, b, 14 + T, "HELLO name_len 65535");
    /* a name of KVL_NAME_MAX bytes does not fit with its terminator */
    b[11] = KVL_NAME_MAX;
    b[12] = 0;
    memset(b + 13, 'n', KVL_NAME_MAX);
    EXPECT_PROTOCOL(D_HELLO, b, 13 + KVL_NAME_MAX + T, "HELLO name of KVL_NAME_MAX bytes");
    b[11] = KVL_NAME_MAX - 1;
    b[13 + KVL_NAME_MAX - 1] = 0; /* flags */
    CHECK(run_decoder(D_HELLO, b, 13 + KVL_NAME_MAX - 1 + T) == KVL_OK);
    /* data connection with a path index out of range */
    b[8] = KVL_CONN_DATA;
    b[9] = KVL_MAX_PATHS;
    EXPECT_PROTOCOL(D_HELLO, b, 13 + KVL_NAME_MAX - 1 + T, "HELLO data path 64");
    b[9] = KVL_MAX_PATHS - 1;
    CHECK(run_decoder(D_HELLO, b, 13 + KVL_NAME_MAX - 1 + T) == KVL_OK);
}

/* ---- HELLO_ACK / REGIONS ---- */

static void test_hello_ack(void)
{
    kvl_region_info regs[5];
    memset(regs, 0, sizeof regs);
    for (int i = 0; i < 5; i++) {
        regs[i].id = 100u + (uint64_t)i;
        regs[i].size = (1ull << 40) + (uint64_t)i;
        regs[i].rights = (uint32_t)i & 3;
        regs[i].mem = (uint32_t)i & 1;
        fill_str(regs[i].name, i == 4 ? KVL_NAME_MAX - 1 : (size_t)i, (char)('A' + i));
        regs[i].rkey_len = i == 4 ? KVL_MAX_RKEY : (uint32_t)i * 7; /* 0 (TCP) .. the cap */
        memset(regs[i].rkey, 0x40 + i, regs[i].rkey_len);
    }
    static const size_t counts[] = {0, 1, 5};
    for (size_t c = 0; c < 3; c++) {
        char name[KVL_NAME_MAX], msg[256];
        fill_str(name, c == 2 ? KVL_NAME_MAX - 1 : 3, 'x');
        fill_str(msg, c == 2 ? 255 : c, 'm');
        frame f = {0};
        kvl_frame_start(&f.b);
        kvl_enc_hello_ack(&f.b, (uint32_t)c + 9, 0xfeedull << c, name, msg, regs, counts[c]);
        frame_done(&f, c == 1 ? KVL_F_REGIONS : KVL_F_HELLO_ACK, 0);
        uint8_t *body = dup_exact(f.body, f.len);
        kvl_msg_hello_ack out;
        if (CHECKF(kvl_dec_hello_ack(body, f.len, &out) == KVL_OK, "%zu regions: %s",
                   counts[c], kvl_last_error())) {
            CHECK(out.status == c + 9 && out.instance == 0xfeedull << c);
            CHECK(strcmp(out.name, name) == 0 && strcmp(out.msg, msg) == 0);
            CHECK(out.n_regions == counts[c]);
            const uint8_t *rec = out.regions;
            for (uint32_t i = 0; i < out.n_regions && i < 5; i++) {
                kvl_region_info r;
                rec = kvl_dec_region_next(rec, &r);
                CHECKF(r.id == regs[i].id && r.size == regs[i].size &&
                           r.rights == regs[i].rights && r.mem == regs[i].mem &&
                           strcmp(r.name, regs[i].name) == 0 && r.rkey_len == regs[i].rkey_len &&
                           memcmp(r.rkey, regs[i].rkey, r.rkey_len) == 0,
                       "region %u differs after the round trip", i);
            }
        }
        free(body);
        check_truncations(D_HELLO_ACK, f.body, f.len, "HELLO_ACK");
        keep(D_HELLO_ACK, &f);
        kvl_buf_free(&f.b);
    }
    /* NULL name and message encode as empty strings. */
    {
        frame f = {0};
        kvl_frame_start(&f.b);
        kvl_enc_hello_ack(&f.b, KVL_ERR_HANDSHAKE, 1, NULL, NULL, NULL, 0);
        frame_done(&f, KVL_F_HELLO_ACK, 0);
        CHECK(run_decoder(D_HELLO_ACK, f.body, f.len) == KVL_OK);
        kvl_buf_free(&f.b);
    }

    /* Hand-built: u32 status, u64 instance, u16 0 (name), u16 0 (msg), u32 n. */
    enum { FIX = 4 + 8 + 2 + 2 + 4 };
    size_t big = FIX + (size_t)(KVL_MAX_REGIONS + 1) * KVL_WIRE_REGION_BYTES;
    uint8_t *b = calloc(1, big);
    if (!CHECK(b))
        return;
    uint32_t ns[] = {1, 0xffffffffu, 0x80000000u, KVL_MAX_REGIONS + 1};
    for (size_t i = 0; i < 4; i++) {
        memcpy(b + 16, &ns[i], 4); /* host is little-endian, like the wire */
        EXPECT_PROTOCOL(D_HELLO_ACK, b, FIX, "HELLO_ACK n_regions past the body");
    }
    /* The count cap holds even when the body really is that long. */
    uint32_t over = KVL_MAX_REGIONS + 1, at = KVL_MAX_REGIONS;
    memcpy(b + 16, &over, 4);
    EXPECT_PROTOCOL(D_HELLO_ACK, b, big, "HELLO_ACK with KVL_MAX_REGIONS+1 regions");
    memcpy(b + 16, &at, 4);
    for (uint64_t i = 0; i < KVL_MAX_REGIONS; i++) { /* ids 1, 2, ...: ascending */
        uint64_t id = i + 1;
        memcpy(b + FIX + i * KVL_WIRE_REGION_BYTES, &id, 8);
    }
    CHECK(run_decoder(D_HELLO_ACK, b, big - KVL_WIRE_REGION_BYTES) == KVL_OK);
    /* ids out of order, unknown rights bits or memory types are refused */
    uint64_t id3 = 3;
    memcpy(b + FIX + 2 * KVL_WIRE_REGION_BYTES, &id3, 8);
    memcpy(b + FIX + 3 * KVL_WIRE_REGION_BYTES, &id3, 8);
    EXPECT_PROTOCOL(D_HELLO_ACK, b, big - KVL_WIRE_REGION_BYTES, "region ids not ascending");
    uint64_t id4 = 4;
    memcpy(b + FIX + 3 * KVL_WIRE_REGION_BYTES, &id4, 8);
    uint32_t bad_rights = 4, bad_mem = 2, zero = 0;
    memcpy(b + FIX + 16, &bad_rights, 4);
    EXPECT_PROTOCOL(D_HELLO_ACK, b, big - KVL_WIRE_REGION_BYTES, "region rights bit 2");
    memcpy(b + FIX + 16, &zero, 4);
    memcpy(b + FIX + 20, &bad_mem, 4);
    EXPECT_PROTOCOL(D_HELLO_ACK, b, big - KVL_WIRE_REGION_BYTES, "region memory type 2");
    memcpy(b + FIX + 20, &zero, 4);
    CHECK(run_decoder(D_HELLO_ACK, b, big - KVL_WIRE_REGION_BYTES) == KVL_OK);
    /* a remote key over the cap, with the bytes really there */
    uint32_t one = 1;
    memcpy(b + 16, &one, 4);
    uint16_t klen = KVL_MAX_RKEY + 1;
    memcpy(b + FIX + 88, &klen, 2);
    EXPECT_PROTOCOL(D_HELLO_ACK, b, FIX + KVL_WIRE_REGION_BYTES + klen, "HELLO_ACK rkey of 257 bytes");
    klen = KVL_MAX_RKEY;
    memcpy(b + FIX + 88, &klen, 2);
    CHECK(run_decoder(D_HELLO_ACK, b, FIX + KVL_WIRE_REGION_BYTES + klen) == KVL_OK);
    /* msg of 256 bytes does not fit in msg[256] with its terminator */
    uint8_t m[FIX + 256];
    memset(m, 'q', sizeof m);
    memset(m, 0, 14);
    m[14] = 0;
    m[15] = 1; /* msg_len 256 */
    memset(m + FIX - 4 + 256, 0, 4);
    EXPECT_PROTOCOL(D_HELLO_ACK, m, sizeof m, "HELLO_ACK msg of 256 bytes");
    free(b);
}

/* ---- DATA / READ_REQ ---- */

static void test_chunk(void)
{
    static const uint32_t counts[] = {1, 3, 17, KVL_MAX_PIECES};
    for (size_t c = 0; c < 4; c++) {
        frame f = {0};
        kvl_frame_start(&f.b);
        kvl_enc_chunk(&f.b, 0xabcdef0123ull, (uint32_t)c * 1000, (uint32_t)c, counts[c]);
        for (uint32_t i = 0; i < counts[c]; i++) {
            kvl_wire_piece p = {i + 1, (uint64_t)i << 33, (uint64_t)i * 7 + 1};
            kvl_enc_piece(&f.b, &p);
        }
        uint32_t nk = counts[c] < 3 ? counts[c] : 3; /* keys of regions 1..nk */
        kvl_enc_keys(&f.b, nk);
        for (uint32_t k = 1; k <= nk; k++) {
            uint8_t key[KVL_KEY_BYTES];
            memset(key, (int)k, sizeof key);
            kvl_enc_key(&f.b, k, key);
        }
        frame_done(&f, c & 1 ? KVL_F_READ_REQ : KVL_F_DATA, c & 1 ? 0 : 4096);
        CHECK(f.len == 20 + (size_t)counts[c] * KVL_WIRE_PIECE_BYTES + 4 +
                           (size_t)nk * KVL_WIRE_KEY_BYTES);
        uint8_t *body = dup_exact(f.body, f.len);
        kvl_msg_chunk out;
        if (CHECKF(kvl_dec_chunk(body, f.len, &out) == KVL_OK, "%u pieces: %s", counts[c],
                   kvl_last_error())) {
            CHECK(out.xfer == 0xabcdef0123ull && out.chunk == c * 1000 && out.attempt == c);
            CHECK(out.n_pieces == counts[c] && out.n_keys == nk);
            for (uint32_t k = 1; k <= nk; k++) {
                const uint8_t *key = kvl_dec_key_for(&out, k);
                CHECK(key && key[0] == k && key[KVL_KEY_BYTES - 1] == k);
            }
            CHECK(kvl_dec_key_for(&out, nk + 1) == NULL && kvl_dec_key_for(&out, 0) == NULL);
            for (uint32_t i = 0; i < out.n_pieces; i++) {
                kvl_wire_piece p;
                kvl_dec_piece(&out, i, &p);
                if (!CHECKF(p.region == i + 1 && p.offset == (uint64_t)i << 33 &&
                                p.len == (uint64_t)i * 7 + 1,
                            "piece %u differs after the round trip", i))
                    break;
            }
        }
        free(body);
        /* Every truncation of the 8192-piece body is 196 KiB x 196 Ki
         * decodes: test the small ones fully and the big one's edges. */
        if (counts[c] < 100) {
            check_truncations(D_CHUNK, f.body, f.len, "chunk");
            keep(D_CHUNK, &f);
        } else {
            for (size_t n = 0; n < 64; n++)
                EXPECT_PROTOCOL(D_CHUNK, f.body, n, "big chunk, short prefix");
            for (size_t n = f.len - 64; n < f.len; n++)
                EXPECT_PROTOCOL(D_CHUNK, f.body, n, "big chunk, long prefix");
        }
        kvl_buf_free(&f.b);
    }

    /* Hand-built: u64 xfer, u32 chunk, u32 attempt, u32 n, n x 24 bytes. */
    size_t big = 20 + (size_t)(KVL_MAX_PIECES + 1) * KVL_WIRE_PIECE_BYTES;
    uint8_t *b = calloc(1, big);
    if (!CHECK(b))
        return;
    EXPECT_PROTOCOL(D_CHUNK, b, 20, "chunk with 0 pieces");
    EXPECT_PROTOCOL(D_CHUNK, b, 20 + KVL_WIRE_PIECE_BYTES, "chunk with 0 pieces and a piece");
    uint32_t over = KVL_MAX_PIECES + 1;
    memcpy(b + 16, &over, 4);
    EXPECT_PROTOCOL(D_CHUNK, b, big, "chunk with KVL_MAX_PIECES+1 pieces");
    uint32_t huge = 0xffffffffu;
    memcpy(b + 16, &huge, 4);
    EXPECT_PROTOCOL(D_CHUNK, b, 20, "chunk with 2^32-1 pieces");
    uint32_t two = 2;
    memcpy(b + 16, &two, 4);
    EXPECT_PROTOCOL(D_CHUNK, b, 20 + KVL_WIRE_PIECE_BYTES, "chunk with 2 pieces, 1 present");
    /* keys: 1..n_pieces of them, ids strictly ascending */
    uint32_t one = 1;
    memcpy(b + 16, &one, 4);
    size_t at = 20 + KVL_WIRE_PIECE_BYTES;
    EXPECT_PROTOCOL(D_CHUNK, b, at + 4, "chunk with 0 keys");
    memcpy(b + at, &two, 4);
    EXPECT_PROTOCOL(D_CHUNK, b, at + 4 + 2 * KVL_WIRE_KEY_BYTES, "more keys than pieces");
    memcpy(b + 16, &two, 4);
    at = 20 + 2 * KVL_WIRE_PIECE_BYTES;
    memset(b + 20, 0, 2 * KVL_WIRE_PIECE_BYTES);
    memcpy(b + at, &two, 4);
    uint64_t id = 5;
    memcpy(b + at + 4, &id, 8);
    memcpy(b + at + 4 + KVL_WIRE_KEY_BYTES, &id, 8);
    EXPECT_PROTOCOL(D_CHUNK, b, at + 4 + 2 * KVL_WIRE_KEY_BYTES, "the same key id twice");
    id = 6;
    memcpy(b + at + 4 + KVL_WIRE_KEY_BYTES, &id, 8);
    CHECK(run_decoder(D_CHUNK, b, at + 4 + 2 * KVL_WIRE_KEY_BYTES) == KVL_OK);
    free(b);
}

/* ---- ACK / READ_RESP ---- */

/* A READ_REQ with header flag DST (pull over UCX): the body ends with
 * where each piece goes in the initiator's regions, 16 bytes a piece. */
static void test_chunk_dst(void)
{
    kvl_frame_hdr ok = {KVL_F_READ_REQ, KVL_HF_DST, 10, 0, 0}, got;
    uint8_t raw[KVL_HDR_BYTES];
    kvl_hdr_encode(raw, &ok);
    CHECKF(kvl_hdr_decode(raw, &got) == KVL_OK && got.flags == KVL_HF_DST,
           "READ_REQ with DST: %s", kvl_last_error());
    frame f = {0};
    kvl_frame_start(&f.b);
    kvl_enc_chunk(&f.b, 77, 5, 2, 3);
    for (uint32_t i = 0; i < 3; i++) {
        kvl_wire_piece p = {9, (uint64_t)i * 100, (uint64_t)i + 10};
        kvl_enc_piece(&f.b, &p);
    }
    uint8_t key[KVL_KEY_BYTES] = {1};
    kvl_enc_keys(&f.b, 1);
    kvl_enc_key(&f.b, 9, key);
    for (uint32_t i = 0; i < 3; i++)
        kvl_enc_dst(&f.b, 40 + i, (uint64_t)i << 40);
    frame_done(&f, KVL_F_READ_REQ, 0);
    uint8_t *body = dup_exact(f.body, f.len);
    kvl_msg_chunk m;
    if (CHECKF(kvl_dec_chunk_flags(body, f.len, KVL_HF_DST, &m) == KVL_OK, "DST: %s",
               kvl_last_error()) &&
        CHECK(m.dst != NULL)) {
        for (uint32_t i = 0; i < 3; i++) {
            kvl_wire_piece d;
            kvl_dec_dst_piece(&m, i, &d);
            CHECKF(d.region == 40 + i && d.offset == (uint64_t)i << 40 && d.len == i + 10,
                   "destination %u differs after the round trip", i);
        }
    }
    /* without the flag the same body has trailing bytes; every truncation of
     * the DST section runs past the body */
    CHECK(kvl_dec_chunk(body, f.len, &m) == KVL_ERR_PROTOCOL &&
          strstr(kvl_last_error(), "trailing"));
    for (size_t n = 0; n < f.len; n++) {
        uint8_t *cut = dup_exact(f.body, n);
        CHECKF(kvl_dec_chunk_flags(cut, n, KVL_HF_DST, &m) == KVL_ERR_PROTOCOL,
               "DST body cut to %zu bytes accepted", n);
        free(cut);
    }
    free(body);
    kvl_buf_free(&f.b);
}

static void test_status(void)
{
    for (int c = 0; c < 4; c++) {
        kvl_msg_status in = {0x1122334455667788ull, (uint32_t)c, 3, (uint32_t)c * 5, {0}};
        fill_str(in.msg, c == 3 ? 255 : (size_t)c * 40, 'e');
        frame f = {0};
        kvl_frame_start(&f.b);
        kvl_enc_status(&f.b, &in);
        frame_done(&f, c & 1 ? KVL_F_READ_RESP : KVL_F_ACK, c & 1 ? 1234 : 0);
        uint8_t *body = dup_exact(f.body, f.len);
        kvl_msg_status out;
        if (CHECKF(kvl_dec_status(body, f.len, &out) == KVL_OK, "case %d: %s", c,
                   kvl_last_error()))
            CHECK(out.xfer == in.xfer && out.chunk == in.chunk && out.attempt == in.attempt &&
                  out.status == in.status && strcmp(out.msg, in.msg) == 0);
        free(body);
        check_truncations(D_STATUS, f.body, f.len, "status");
        keep(D_STATUS, &f);
        kvl_buf_free(&f.b);
    }
    /* msg_len 256 */
    uint8_t b[20 + 2 + 256];
    memset(b, 'r', sizeof b);
    b[20] = 0;
    b[21] = 1;
    EXPECT_PROTOCOL(D_STATUS, b, sizeof b, "status msg of 256 bytes");
    b[20] = 0xff;
    b[21] = 0xff;
    EXPECT_PROTOCOL(D_STATUS, b, sizeof b, "status msg_len 65535");
}

/* ---- NOTIFY ---- */

static void test_notify(void)
{
    static const uint32_t lens[] = {0, 1, 100, KVL_MAX_TAG};
    uint8_t *tag = malloc(KVL_MAX_TAG);
    if (!CHECK(tag))
        return;
    test_rng r = {0x6e6f74696679ull};
    rng_fill(&r, tag, KVL_MAX_TAG);
    for (size_t c = 0; c < 4; c++) {
        frame f = {0};
        kvl_frame_start(&f.b);
        kvl_enc_notify(&f.b, 77 + c, KVL_OP_PULL, lens[c] ? tag : NULL, lens[c]);
        frame_done(&f, KVL_F_NOTIFY, 0);
        CHECK(f.len == 16 + lens[c]);
        uint8_t *body = dup_exact(f.body, f.len);
        kvl_msg_notify out;
        if (CHECKF(kvl_dec_notify(body, f.len, &out) == KVL_OK, "tag %u: %s", lens[c],
                   kvl_last_error()))
            CHECK(out.xfer == 77 + c && out.op == KVL_OP_PULL && out.tag_len == lens[c] &&
                  (lens[c] == 0 || memcmp(out.tag, tag, lens[c]) == 0));
        free(body);
        if (lens[c] <= 100) {
            check_truncations(D_NOTIFY, f.body, f.len, "NOTIFY");
            keep(D_NOTIFY, &f);
        } else {
            for (size_t n = 0; n < f.len; n += 61)
                EXPECT_PROTOCOL(D_NOTIFY, f.body, n, "NOTIFY 4096, truncated");
            EXPECT_PROTOCOL(D_NOTIFY, f.body, f.len - 1, "NOTIFY 4096, truncated by 1");
        }
        kvl_buf_free(&f.b);
    }
    /* tag_len over the cap, with the bytes really there */
    uint8_t *b = calloc(1, 16 + KVL_MAX_TAG + 1);
    if (!CHECK(b)) {
        free(tag);
        return;
    }
    uint32_t over = KVL_MAX_TAG + 1, huge = 0xffffffffu;
    memcpy(b + 12, &over, 4);
    EXPECT_PROTOCOL(D_NOTIFY, b, 16 + KVL_MAX_TAG + 1, "NOTIFY tag_len 4097");
    memcpy(b + 12, &huge, 4);
    EXPECT_PROTOCOL(D_NOTIFY, b, 16, "NOTIFY tag_len 2^32-1");
    free(b);
    free(tag);
}

static void test_announce(void)
{
    static const uint32_t counts[] = {1, 3, 40};
    uint32_t lf[40], ll[40];
    for (uint32_t i = 0; i < 40; i++) { /* chunk i: layers i/3 .. (i+1)/3, layer-major */
        lf[i] = i / 3;
        ll[i] = (i + 1) / 3;
    }
    for (size_t c = 0; c < 3; c++) {
        uint32_t n = counts[c];
        kvl_msg_announce m = {.xfer = 9, .bytes = 1000u * n, .n_chunks = n,
                              .n_layers = ll[n - 1] + 1, .timeout_ms = 5000, .tag_len = 5,
                              .tag = (const uint8_t *)"req-1"};
        frame f = {0};
        kvl_frame_start(&f.b);
        kvl_enc_announce(&f.b, &m, lf, ll);
        frame_done(&f, KVL_F_ANNOUNCE, 0);
        CHECK(f.len == 32 + 5 + 8u * n);
        kvl_msg_announce out;
        uint8_t *body = dup_exact(f.body, f.len);
        if (CHECKF(kvl_dec_announce(body, f.len, &out) == KVL_OK, "%u chunks: %s", n,
                   kvl_last_error()))
            CHECK(out.xfer == 9 && out.n_chunks == n && out.n_layers == m.n_layers &&
                  out.timeout_ms == 5000 && out.tag_len == 5 && !memcmp(out.tag, "req-1", 5));
        free(body);
        check_truncations(D_ANNOUNCE, f.body, f.len, "ANNOUNCE");
        keep(D_ANNOUNCE, &f);
        kvl_buf_free(&f.b);
    }
    /* every bound of the header, with the bytes really there */
    struct { const char *what; size_t off; uint32_t v; } bad[] = {
        {"n_chunks 0", 16, 0},        {"n_chunks over the cap", 16, KVL_MAX_XFER_CHUNKS + 1},
        {"n_layers 0", 20, 0},        {"n_layers over the cap", 20, KVL_MAX_LAYERS + 1},
        {"tag_len 4097", 28, KVL_MAX_TAG + 1},
    };
    kvl_msg_announce m = {.xfer = 9, .bytes = 2, .n_chunks = 2, .n_layers = 1};
    uint32_t z[2] = {0, 0};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        frame f = {0};
        kvl_frame_start(&f.b);
        kvl_enc_announce(&f.b, &m, z, z);
        frame_done(&f, KVL_F_ANNOUNCE, 0);
        uint8_t *body = dup_exact(f.body, f.len);
        memcpy(body + bad[i].off, &bad[i].v, 4);
        EXPECT_PROTOCOL(D_ANNOUNCE, body, f.len, bad[i].what);
        free(body);
        kvl_buf_free(&f.b);
    }
}

/* ---- fuzz ---- */

/* 200000 bodies through every decoder: random bytes, and mutations of the
 * valid bodies collected above.  Only OK and KVL_ERR_PROTOCOL may come back;
 * run_decoder checks what OK hands out, ASan checks every read. */
static void test_fuzz(void)
{
    test_rng r = {0x66757a7a6b766cull};
    unsigned long ok = 0, rejected = 0;
    uint8_t *scratch = malloc(1024);
    if (!CHECK(scratch && n_pool > 0))
        return;
    for (int it = 0; it < 200000; it++) {
        size_t len;
        dec_kind k = (dec_kind)rng_range(&r, 0, D_N - 1);
        int mode = (int)rng_range(&r, 0, 5);
        if (mode == 0) {
            len = (size_t)rng_range(&r, 0, 600);
            rng_fill(&r, scratch, len);
            /* Small length fields now and then, so parsing gets past them. */
            if (len > 24 && rng_range(&r, 0, 1))
                memset(scratch + rng_range(&r, 8, 20), 0, 3);
        } else {
            const sample *s = &pool[rng_range(&r, 0, n_pool - 1)];
            if (rng_range(&r, 0, 3))
                k = s->k; /* mostly its own decoder; sometimes a wrong one */
            len = s->len < 600 ? s->len : 600;
            memcpy(scratch, s->body, len);
            switch (mode) {
            case 1: /* flip a few bytes */
                for (int n = (int)rng_range(&r, 1, 4); n > 0 && len; n--)
                    scratch[rng_range(&r, 0, len - 1)] ^= (uint8_t)rng_range(&r, 1, 255);
                break;
            case 2: /* truncate */
                len = (size_t)rng_range(&r, 0, len);
                break;
            case 3: /* extend with random bytes */
            {
                size_t more = (size_t)rng_range(&r, 1, 64);
                rng_fill(&r, scratch + len, more);
                len += more;
                break;
            }
            case 4: /* an extreme value in a 1/2/4-byte field */
                if (len >= 4) {
                    static const uint32_t v[] = {0, 1, 0xff, 0x100, 0xffff, 0x10000,
                                                 0x7fffffff, 0xffffffff};
                    uint32_t x = v[rng_range(&r, 0, 7)];
                    size_t at = (size_t)rng_range(&r, 0, len - 4);
                    memcpy(scratch + at, &x, (size_t)1 << rng_range(&r, 0, 2));
                }
                break;
            default: /* flip bytes and truncate */
                if (len)
                    scratch[rng_range(&r, 0, len - 1)] ^= (uint8_t)rng_range(&r, 1, 255);
                len = (size_t)rng_range(&r, 0, len);
                break;
            }
        }
        kvl_err e = run_decoder(k, scratch, len);
        if (!CHECKF(e == KVL_OK || e == KVL_ERR_PROTOCOL,
                    "fuzz %d: %s decoder, %zu bytes: got %d (%s)", it, dec_names[k], len, e,
                    kvl_err_name(e)))
            break;
        if (e == KVL_OK)
            ok++;
        else
            rejected++;
    }
    printf("fuzz: 200000 bodies, %lu accepted, %lu rejected\n", ok, rejected);
    CHECK(ok > 1000 && rejected > 1000); /* the mutations do reach both outcomes */
    free(scratch);
}

/* ---- CHALLENGE / AUTH ---- */

static void test_challenge_auth(void)
{
    kvl_msg_challenge ch = {.instance = 0x1122334455667788ull};
    strcpy(ch.name, "listener");
    for (size_t i = 0; i < sizeof ch.nonce; i++)
        ch.nonce[i] = (uint8_t)i;
    for (size_t i = 0; i < sizeof ch.mac; i++)
        ch.mac[i] = (uint8_t)(0xff - i);
    frame f = {0};
    kvl_frame_start(&f.b);
    kvl_enc_challenge(&f.b, &ch);
    frame_done(&f, KVL_F_CHALLENGE, 0);
    kvl_msg_challenge out;
    if (CHECK(kvl_dec_challenge(f.body, f.len, &out) == KVL_OK))
        CHECK(out.instance == ch.instance && strcmp(out.name, ch.name) == 0 &&
              memcmp(out.nonce, ch.nonce, sizeof ch.nonce) == 0 &&
              memcmp(out.mac, ch.mac, sizeof ch.mac) == 0);
    check_truncations(D_CHALLENGE, f.body, f.len, "CHALLENGE");
    keep(D_CHALLENGE, &f);
    kvl_buf_free(&f.b);

    kvl_msg_auth au = {.status = KVL_ERR_AUTH};
    memset(au.mac, 0x5a, sizeof au.mac);
    f = (frame){0};
    kvl_frame_start(&f.b);
    kvl_enc_auth(&f.b, &au);
    frame_done(&f, KVL_F_AUTH, 0);
    kvl_msg_auth aout;
    if (CHECK(kvl_dec_auth(f.body, f.len, &aout) == KVL_OK))
        CHECK(aout.status == au.status && memcmp(aout.mac, au.mac, sizeof au.mac) == 0);
    check_truncations(D_AUTH, f.body, f.len, "AUTH");
    keep(D_AUTH, &f);
    kvl_buf_free(&f.b);
}

int main(void)
{
    double t0 = test_now_s();
    test_header();
    test_frame_finish();
    test_hello();
    test_hello_ack();
    test_chunk();
    test_chunk_dst();
    test_status();
    test_notify();
    test_announce();
    test_challenge_auth();
    test_fuzz();
    for (size_t i = 0; i < n_pool; i++)
        free(pool[i].body);
    return test_report("test_wire", t0);
}
