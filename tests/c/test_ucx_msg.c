/* test_ucx_msg.c: the UCX transport's message codec (csrc/transport/ucx/msg.c):
 * round trips, every truncation, each limit, and random bodies (no UCX needed). */
#include <string.h>

#include "test_main.h"
#include "transport/ucx/msg.h"

static kvl_ucx_key_view key(uint64_t region, uint64_t base, uint64_t size, const uint8_t *k,
                            uint16_t n)
{
    kvl_ucx_key_view v = {region, base, size, k, n};
    return v;
}

int main(void)
{
    double t0 = test_now_s();
    uint8_t addr[300], kb[256];
    test_rng r = {7};
    rng_fill(&r, addr, sizeof addr);
    rng_fill(&r, kb, sizeof kb);
    kvl_ucx_key_view keys[3] = {key(1, 0x1000, 4096, kb, 9), key(5, 0x7f0000000000, 1u << 30, kb, 256),
                                key(900, 1, 1, kb + 3, 1)};

    /* round trip */
    kvl_buf b = {0};
    CHECK(kvl_ucx_enc_setup(&b, addr, sizeof addr, keys, 3) == KVL_OK && !b.oom);
    kvl_ucx_setup s;
    CHECK(kvl_ucx_dec_setup(b.p, b.len, 1, &s) == KVL_OK);
    CHECK(s.addr_len == sizeof addr && memcmp(s.addr, addr, sizeof addr) == 0 && s.n_keys == 3);
    for (uint32_t i = 0; i < 3 && i < s.n_keys; i++)
        CHECK(s.keys[i].region == keys[i].region && s.keys[i].base == keys[i].base &&
              s.keys[i].size == keys[i].size && s.keys[i].key_len == keys[i].key_len &&
              memcmp(s.keys[i].key, keys[i].key, keys[i].key_len) == 0);
    CHECK(kvl_ucx_setup_key(&s, 5) == &s.keys[1]);
    CHECK(kvl_ucx_setup_key(&s, 900) == &s.keys[2]);
    CHECK(kvl_ucx_setup_key(&s, 4) == NULL && kvl_ucx_setup_key(&s, 901) == NULL);
    kvl_ucx_setup_free(&s);
    /* an offer needs an address; a KEYS frame must not carry one */
    CHECK(kvl_ucx_dec_setup(b.p, b.len, 0, &s) == KVL_ERR_PROTOCOL);

    /* every truncation and one trailing byte are refused */
    int all = 1;
    for (size_t n = 0; n < b.len; n++) {
        kvl_ucx_setup t;
        all &= kvl_ucx_dec_setup(b.p, n, 1, &t) == KVL_ERR_PROTOCOL && t.keys == NULL;
    }
    CHECK(all);
    kvl_buf b2 = {0};
    CHECK(kvl_ucx_enc_setup(&b2, addr, sizeof addr, keys, 3) == KVL_OK);
    uint8_t zero = 0;
    b2.p = realloc(b2.p, b2.len + 1);
    memcpy(b2.p + b2.len, &zero, 1);
    CHECK(kvl_ucx_dec_setup(b2.p, b2.len + 1, 1, &s) == KVL_ERR_PROTOCOL);
    kvl_buf_free(&b2);

    /* KEYS: no address, no keys */
    kvl_buf b3 = {0};
    CHECK(kvl_ucx_enc_setup(&b3, NULL, 0, NULL, 0) == KVL_OK && b3.len == 6);
    CHECK(kvl_ucx_dec_setup(b3.p, b3.len, 0, &s) == KVL_OK && s.n_keys == 0 && !s.addr);
    CHECK(kvl_ucx_dec_setup(b3.p, b3.len, 1, &s) == KVL_ERR_PROTOCOL);
    kvl_buf_free(&b3);

    /* the encoder refuses what the decoder would */
    kvl_buf e = {0};
    kvl_ucx_key_view unsorted[2] = {key(5, 1, 1, kb, 1), key(5, 2, 1, kb, 1)};
    kvl_ucx_key_view wrap = key(1, UINT64_MAX, 2, kb, 1), empty = key(1, 1, 0, kb, 1),
                     nokey = key(1, 1, 1, kb, 0), longkey = key(1, 1, 1, kb, 257);
    CHECK(kvl_ucx_enc_setup(&e, addr, 1, unsorted, 2) == KVL_ERR_INVALID_ARG);
    CHECK(kvl_ucx_enc_setup(&e, addr, 1, &wrap, 1) == KVL_ERR_INVALID_ARG);
    CHECK(kvl_ucx_enc_setup(&e, addr, 1, &empty, 1) == KVL_ERR_INVALID_ARG);
    CHECK(kvl_ucx_enc_setup(&e, addr, 1, &nokey, 1) == KVL_ERR_INVALID_ARG);
    CHECK(kvl_ucx_enc_setup(&e, addr, 1, &longkey, 1) == KVL_ERR_INVALID_ARG);
    CHECK(kvl_ucx_enc_setup(&e, addr, KVL_UCX_ADDR_MAX + 1, NULL, 0) == KVL_ERR_INVALID_ARG);
    CHECK(e.len == 0);

    /* ... and the decoder refuses hand-made bodies that break each rule */
    struct {
        const char *what;
        uint8_t body[64];
        size_t len;
    } bad[] = {
        {"address too long", {0x01, 0x10}, 2},                       /* 4097 */
        {"too many keys", {1, 0, 0xaa, 0x01, 0x20, 0, 0}, 7},          /* 8193 */
        {"keys that cannot fit", {1, 0, 0xaa, 2, 0, 0, 0}, 7},         /* 2 keys, 0 bytes */
        {"zero-length key",
         {1, 0, 0xaa, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0,
          0, 0, 0, 0, 0},
         34},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        CHECKF(kvl_ucx_dec_setup(bad[i].body, bad[i].len, 1, &s) == KVL_ERR_PROTOCOL, "%s",
               bad[i].what);

    /* REFUSE */
    kvl_buf rb = {0};
    kvl_ucx_enc_refuse(&rb, 7, "UCX not loaded: libucp.so.0: cannot open shared object file");
    uint32_t st = 0;
    char msg[256];
    CHECK(kvl_ucx_dec_refuse(rb.p, rb.len, &st, msg) == KVL_OK && st == 7 &&
          strcmp(msg, "UCX not loaded: libucp.so.0: cannot open shared object file") == 0);
    CHECK(kvl_ucx_dec_refuse(rb.p, rb.len - 1, &st, msg) == KVL_ERR_PROTOCOL);
    kvl_buf_free(&rb);
    char longmsg[400];
    memset(longmsg, 'x', sizeof longmsg - 1);
    longmsg[sizeof longmsg - 1] = '\0';
    kvl_ucx_enc_refuse(&rb, 1, longmsg);
    CHECK(kvl_ucx_dec_refuse(rb.p, rb.len, &st, msg) == KVL_OK && strlen(msg) == 255);
    kvl_buf_free(&rb);


    /* random bodies and random mutations of a valid one: never a crash or a
     * leak (ASan), and whatever decodes re-encodes to the same bytes */
    uint8_t junk[1024];
    int reencoded = 1, decoded = 0;
    for (int i = 0; i < 200000; i++) {
        size_t n = (size_t)rng_range(&r, 0, sizeof junk);
        if (i & 1) {
            n = b.len < sizeof junk ? b.len : sizeof junk;
            memcpy(junk, b.p, n);
            for (int m = (int)rng_range(&r, 1, 4); m > 0; m--)
                junk[rng_range(&r, 0, n - 1)] = (uint8_t)rng_u64(&r);
        } else
            rng_fill(&r, junk, n);
        kvl_ucx_setup t;
        if (kvl_ucx_dec_setup(junk, n, 1, &t) == KVL_OK) {
            decoded++;
            kvl_buf again = {0};
            reencoded &= kvl_ucx_enc_setup(&again, t.addr, t.addr_len, t.keys, t.n_keys) ==
                              KVL_OK &&
                          again.len == n && memcmp(again.p, junk, n) == 0;
            kvl_buf_free(&again);
            kvl_ucx_setup_free(&t);
        }
        kvl_ucx_dec_refuse(junk, n, &st, msg);
    }
    CHECK(reencoded);
    CHECKF(decoded > 10000, "only %d mutated bodies decoded: the round trip was not exercised",
           decoded);
    kvl_buf_free(&b);
    return test_report("ucx_msg", t0);
}
