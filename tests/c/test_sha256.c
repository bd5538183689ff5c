/* test_sha256.c: SHA-256 and HMAC-SHA256 (csrc/sha256.c) against the
 * published vectors (FIPS 180-4 examples, RFC 4231), and the handshake
 * proofs' properties (csrc/auth.c). */
#include <stdio.h>
#include <string.h>

#include "internal.h"
#include "test_main.h"

static void hex(const uint8_t *d, size_t n, char *out)
{
    for (size_t i = 0; i < n; i++)
        sprintf(out + 2 * i, "%02x", d[i]);
}

static int sha_is(const void *msg, size_t n, const char *want)
{
    kvl_sha256 s;
    uint8_t d[32];
    char got[65];
    kvl_sha256_init(&s);
    kvl_sha256_update(&s, msg, n);
    kvl_sha256_final(&s, d);
    hex(d, 32, got);
    return strcmp(got, want) == 0;
}

static int hmac_is(const void *key, size_t klen, const void *msg, size_t n, const char *want)
{
    kvl_hmac m;
    uint8_t d[32];
    char got[65];
    kvl_hmac_init(&m, key, klen);
    kvl_hmac_update(&m, msg, n);
    kvl_hmac_final(&m, d);
    hex(d, 32, got);
    return strcmp(got, want) == 0;
}

static void test_vectors(void)
{
    CHECK(sha_is("", 0, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"));
    CHECK(sha_is("abc", 3, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"));
    const char *two = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"; /* 2 blocks */
    CHECK(sha_is(two, strlen(two),
                 "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"));
    static uint8_t million[1000000];
    memset(million, 'a', sizeof million);
    CHECK(sha_is(million, sizeof million,
                 "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"));
    /* RFC 4231 cases 1, 2 and 6 (a key longer than the block) */
    uint8_t k1[20];
    memset(k1, 0x0b, sizeof k1);
    CHECK(hmac_is(k1, sizeof k1, "Hi There", 8,
                  "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"));
    CHECK(hmac_is("Jefe", 4, "what do ya want for nothing?", 28,
                  "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"));
    uint8_t k6[131];
    memset(k6, 0xaa, sizeof k6);
    const char *m6 = "Test Using Larger Than Block-Size Key - Hash Key First";
    CHECK(hmac_is(k6, sizeof k6, m6, strlen(m6),
                  "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"));
}

static void test_proofs(void)
{
    static kvl_agent a, b;
    memcpy(a.secret, "0123456789abcdef", 16);
    a.secret_len = 16;
    b = a;
    uint8_t nc[KVL_NONCE_BYTES] = {1}, ns[KVL_NONCE_BYTES] = {2};
    kvl_auth_ctx x = {.server_name = "rx", .server_instance = 7, .client_name = "tx",
                      .client_instance = 9, .kind = KVL_CONN_DATA, .path = 3,
                      .nonce_c = nc, .nonce_s = ns};
    uint8_t s1[KVL_MAC_BYTES], s2[KVL_MAC_BYTES], c1[KVL_MAC_BYTES];
    kvl_auth_mac(&a, 1, &x, s1);
    kvl_auth_mac(&b, 1, &x, s2);
    kvl_auth_mac(&a, 0, &x, c1);
    CHECK(kvl_ct_equal(s1, s2, sizeof s1));  /* same secret, same proof */
    CHECK(!kvl_ct_equal(s1, c1, sizeof s1)); /* a server proof is no client proof */
    b.secret[15] ^= 1;
    kvl_auth_mac(&b, 1, &x, s2);
    CHECK(!kvl_ct_equal(s1, s2, sizeof s1)); /* another secret */
    x.path = 4;
    kvl_auth_mac(&a, 1, &x, s2);
    CHECK(!kvl_ct_equal(s1, s2, sizeof s1)); /* another connection */
    x.path = 3;
    ns[0] = 3;
    kvl_auth_mac(&a, 1, &x, s2);
    CHECK(!kvl_ct_equal(s1, s2, sizeof s1)); /* another nonce: no replay */
    uint8_t n1[KVL_NONCE_BYTES], n2[KVL_NONCE_BYTES];
    CHECK(kvl_auth_nonce(n1) == KVL_OK && kvl_auth_nonce(n2) == KVL_OK);
    CHECK(!kvl_ct_equal(n1, n2, sizeof n1));
}

int main(void)
{
    double t0 = test_now_s();
    test_vectors();
    test_proofs();
    return test_report("test_sha256", t0);
}
