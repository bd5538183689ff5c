/* test_crc32c.c: kvl_crc32c against published vectors and a bitwise reference.
 *
 * The product picks its code path at run time (SSE4.2 three-lane interleave,
 * else slicing-by-8).  The Makefile builds this file twice: once against the
 * product object as is, and once with the CPU check forced off
 * (KVL_TEST_FORCE_SW), so both paths are checked on an x86-64 host.
 */
#include <string.h>

#include "kvlink.h"
#include "test_main.h"

#define POLY 0x82F63B78u /* reflected Castagnoli */
#define LANE 4096u       /* the product's interleave lane: lengths around 3*LANE matter */

/* One bit at a time, straight from the definition: slow and obviously right. */
static uint32_t ref_bitwise(uint32_t crc, const uint8_t *p, size_t n)
{
    uint32_t s = ~crc;
    while (n--) {
        s ^= *p++;
        for (int k = 0; k < 8; k++)
            s = (s & 1) ? (s >> 1) ^ POLY : s >> 1;
    }
    return ~s;
}

/* Byte-table version of the same, for the long buffers (the bitwise loop is
 * ~8x slower under ASan).  Its table comes from ref_bitwise's inner loop and
 * it is itself checked against ref_bitwise below. */
static uint32_t ref_table[256];

static void ref_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t s = i;
        for (int k = 0; k < 8; k++)
            s = (s & 1) ? (s >> 1) ^ POLY : s >> 1;
        ref_table[i] = s;
    }
}

static uint32_t ref_bytewise(uint32_t crc, const uint8_t *p, size_t n)
{
    uint32_t s = ~crc;
    while (n--)
        s = ref_table[(s ^ *p++) & 0xff] ^ (s >> 8);
    return ~s;
}

static void test_vectors(void)
{
    /* RFC 3720 (iSCSI) appendix B.4 and the usual check value. */
    uint8_t buf[32];
    CHECK_EQ_U64(kvl_crc32c(0, "123456789", 9), 0xE3069283u);
    CHECK_EQ_U64(ref_bitwise(0, (const uint8_t *)"123456789", 9), 0xE3069283u);
    memset(buf, 0, sizeof buf);
    CHECK_EQ_U64(kvl_crc32c(0, buf, 32), 0x8A9136AAu);
    memset(buf, 0xff, sizeof buf);
    CHECK_EQ_U64(kvl_crc32c(0, buf, 32), 0x62A8AB43u);
    for (int i = 0; i < 32; i++)
        buf[i] = (uint8_t)i;
    CHECK_EQ_U64(kvl_crc32c(0, buf, 32), 0x46DD794Eu);
    for (int i = 0; i < 32; i++)
        buf[i] = (uint8_t)(31 - i);
    CHECK_EQ_U64(kvl_crc32c(0, buf, 32), 0x113FDB5Cu);
    CHECK_EQ_U64(kvl_crc32c(0, NULL, 0), 0);
    CHECK_EQ_U64(kvl_crc32c(0, "", 0), 0);
    /* Continuing with nothing must leave any state unchanged. */
    CHECK_EQ_U64(kvl_crc32c(0xE3069283u, buf, 0), 0xE3069283u);
}

/* Checks buffer [p, p+n) three ways: one shot, split at random points, and
 * against the reference.  p comes from a malloc of exactly off+n bytes, so
 * ASan flags any read past the end. */
static void check_buffer(test_rng *r, const uint8_t *p, size_t n, size_t off)
{
    uint32_t want = ref_bytewise(0, p, n);
    uint32_t got = kvl_crc32c(0, p, n);
    CHECKF(got == want, "one-shot len %zu offset %zu: got 0x%08x want 0x%08x", n, off, got,
           want);

    uint32_t inc = 0;
    size_t pos = 0;
    while (pos < n) {
        /* Mix tiny pieces (alignment prologues) with ones over 3*LANE. */
        size_t step = (rng_u64(r) & 1) ? (size_t)rng_range(r, 1, 17)
                                       : (size_t)rng_range(r, 1, 5 * LANE);
        if (step > n - pos)
            step = n - pos;
        inc = kvl_crc32c(inc, p + pos, step);
        pos += step;
    }
    CHECKF(inc == want, "incremental len %zu offset %zu: got 0x%08x want 0x%08x", n, off, inc,
           want);
}

static void test_lengths(void)
{
    test_rng r = {0x6b766c2d637263ull};
    /* Every length up to a few lanes' worth of tail handling, the lengths
     * around each multiple of 3*LANE, and random ones up to 200000. */
    size_t lens[1024];
    size_t n_lens = 0;
    for (size_t n = 0; n <= 80; n++)
        lens[n_lens++] = n;
    for (size_t m = 1; m <= 4; m++)
        for (int d = -9; d <= 9; d++)
            lens[n_lens++] = m * 3 * LANE + (size_t)(ptrdiff_t)d;
    lens[n_lens++] = LANE;
    lens[n_lens++] = 2 * LANE;
    lens[n_lens++] = 200000;
    while (n_lens < 260)
        lens[n_lens++] = (size_t)rng_range(&r, 0, 200000);

    for (size_t i = 0; i < n_lens; i++) {
        for (size_t off = 0; off < 8; off++) {
            size_t n = lens[i];
            uint8_t *base = malloc(off + n ? off + n : 1);
            if (!CHECK(base))
                return;
            rng_fill(&r, base, off + n);
            check_buffer(&r, base + off, n, off);
            free(base);
        }
    }

    /* The byte-table reference itself, against the bitwise definition. */
    uint8_t buf[3 * LANE + 13];
    rng_fill(&r, buf, sizeof buf);
    CHECK_EQ_U64(ref_bytewise(0, buf, sizeof buf), ref_bitwise(0, buf, sizeof buf));
    CHECK_EQ_U64(ref_bytewise(0x12345678u, buf, 77), ref_bitwise(0x12345678u, buf, 77));
}

/* Long runs of one byte value stress the lane merge (the shift tables). */
static void test_patterns(void)
{
    size_t n = 9 * LANE + 5;
    uint8_t *p = malloc(n);
    if (!CHECK(p))
        return;
    static const uint8_t fills[] = {0x00, 0xff, 0x01, 0x80, 0x5a};
    for (size_t f = 0; f < sizeof fills; f++) {
        memset(p, fills[f], n);
        for (size_t off = 0; off < 3; off++)
            CHECKF(kvl_crc32c(0, p + off, n - off) == ref_bytewise(0, p + off, n - off),
                   "fill 0x%02x offset %zu", fills[f], off);
    }
    free(p);
}

int main(void)
{
    double t0 = test_now_s();
    ref_init();
    int hw = kvl_crc32c_hw();
    printf("kvl_crc32c_hw() = %d (%s)\n", hw, hw ? "SSE4.2 crc32 instruction" : "table code");
    /* kvlink.h documents exactly 1 or 0, and callers may compare with 1. */
    CHECKF(hw == 0 || hw == 1, "kvl_crc32c_hw() returned %d, not 0 or 1", hw);
#ifdef KVL_TEST_FORCE_SW
    CHECKF(hw == 0, "this build forces the table code but kvl_crc32c_hw() is %d", hw);
#endif
    test_vectors();
    test_lengths();
    test_patterns();
#ifdef KVL_TEST_FORCE_SW
    return test_report("test_crc32c (forced table code)", t0);
#else
    return test_report("test_crc32c", t0);
#endif
}
