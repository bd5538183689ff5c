/* crc32c.c: CRC-32C (Castagnoli), hardware-accelerated where the CPU allows.
 *
 * On x86-64 with SSE4.2 the crc32 instruction has a latency of 3 cycles and a
 * throughput of 1 per cycle, so one dependency chain reaches a third of the
 * instruction's speed.  Long buffers are therefore cut into three interleaved
 * lanes of LANE bytes each, whose states are merged with precomputed "advance
 * over LANE zero bytes" tables (CRC is linear over GF(2)).  Elsewhere a
 * slicing-by-8 table does the work.
 */
#include <pthread.h>
#include <string.h>

#include "internal.h"

#define POLY 0x82F63B78u /* reflected Castagnoli polynomial */
#define LANE 4096u       /* bytes per interleaved lane: 3 lanes fit in L1 */

static uint32_t sw_table[8][256];
static uint32_t shift1[4][256]; /* advance a state over LANE zero bytes */
static uint32_t shift2[4][256]; /* advance a state over 2*LANE zero bytes */
static int have_hw;
static pthread_once_t init_once = PTHREAD_ONCE_INIT;

static uint32_t sw_update(uint32_t s, const uint8_t *p, size_t n)
{
    while (n && ((uintptr_t)p & 7)) {
        s = sw_table[0][(s ^ *p++) & 0xff] ^ (s >> 8);
        n--;
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= s;
        s = sw_table[7][w & 0xff] ^ sw_table[6][(w >> 8) & 0xff] ^
            sw_table[5][(w >> 16) & 0xff] ^ sw_table[4][(w >> 24) & 0xff] ^
            sw_table[3][(w >> 32) & 0xff] ^ sw_table[2][(w >> 40) & 0xff] ^
            sw_table[1][(w >> 48) & 0xff] ^ sw_table[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--)
        s = sw_table[0][(s ^ *p++) & 0xff] ^ (s >> 8);
    return s;
}

#if defined(__x86_64__)
#include <nmmintrin.h>

__attribute__((target("sse4.2"))) static uint32_t hw_zeros(uint32_t s, size_t n)
{
    uint64_t c = s;
    for (size_t i = 0; i < n / 8; i++)
        c = _mm_crc32_u64(c, 0);
    return (uint32_t)c;
}

static inline uint32_t shift(uint32_t t[4][256], uint32_t s)
{
    return t[0][s & 0xff] ^ t[1][(s >> 8) & 0xff] ^ t[2][(s >> 16) & 0xff] ^ t[3][s >> 24];
}

__attribute__((target("sse4.2"))) static uint32_t hw_update(uint32_t s, const uint8_t *p,
                                                            size_t n)
{
    uint64_t c = s;
    while (n && ((uintptr_t)p & 7)) {
        c = _mm_crc32_u8((uint32_t)c, *p++);
        n--;
    }
    while (n >= 3 * LANE) {
        uint64_t a = c, b = 0, d = 0;
        for (size_t i = 0; i < LANE; i += 8) {
            uint64_t wa, wb, wd; /* memcpy loads: aligned here, and alias-safe */
            memcpy(&wa, p + i, 8);
            memcpy(&wb, p + i + LANE, 8);
            memcpy(&wd, p + i + 2 * LANE, 8);
            a = _mm_crc32_u64(a, wa);
            b = _mm_crc32_u64(b, wb);
            d = _mm_crc32_u64(d, wd);
        }
        c = shift(shift2, (uint32_t)a) ^ shift(shift1, (uint32_t)b) ^ (uint32_t)d;
        p += 3 * LANE;
        n -= 3 * LANE;
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c = _mm_crc32_u64(c, w);
        p += 8;
        n -= 8;
    }
    while (n--)
        c = _mm_crc32_u8((uint32_t)c, *p++);
    return (uint32_t)c;
}
#endif

static void crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t s = i;
        for (int k = 0; k < 8; k++)
            s = (s & 1) ? (s >> 1) ^ POLY : s >> 1;
        sw_table[0][i] = s;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            sw_table[t][i] = (sw_table[t - 1][i] >> 8) ^ sw_table[0][sw_table[t - 1][i] & 0xff];
#if defined(__x86_64__)
    __builtin_cpu_init();
    have_hw = !!__builtin_cpu_supports("sse4.2"); /* a feature mask, not 0/1 */
    if (have_hw) {
        for (int k = 0; k < 4; k++)
            for (uint32_t i = 0; i < 256; i++) {
                shift1[k][i] = hw_zeros(i << (8 * k), LANE);
                shift2[k][i] = hw_zeros(i << (8 * k), 2 * LANE);
            }
    }
#endif
}

uint32_t kvl_crc32c(uint32_t crc, const void *buf, size_t len)
{
    pthread_once(&init_once, crc_init);
    uint32_t s = ~crc;
#if defined(__x86_64__)
    if (have_hw)
        return ~hw_update(s, buf, len);
#endif
    return ~sw_update(s, buf, len);
}

int kvl_crc32c_hw(void)
{
    pthread_once(&init_once, crc_init);
    return have_hw;
}
