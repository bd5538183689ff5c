/* test_blockio.c: the store's file I/O batches (csrc/blockio.c), built twice: with
 * io_uring (KVL_HAVE_URING, linked with liburing) and with the thread pool alone.
 * O_DIRECT writes and reads of random slots come back byte for byte; reads past the
 * end of the file, bad descriptors and bad arguments are reported, never hidden;
 * four threads share one engine (batches serialise: TSan checks the locking); the
 * batched copy and the scattered crc32c agree with memcpy and one crc32c.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvlink.h"
#include "test_main.h"

#define SLOT 8192u
#define SLOTS 256u

static char path[64];
static int fd = -1;

static void fill(uint8_t *p, size_t n, uint64_t seed)
{
    test_rng r = {seed};
    for (size_t i = 0; i < n; i += 8) {
        uint64_t v = rng_u64(&r);
        memcpy(p + i, &v, n - i < 8 ? n - i : 8);
    }
}

static void test_round_trip(kvl_blockio *io, uint64_t seed)
{
    uint8_t *w = aligned_alloc(4096, (size_t)SLOTS * SLOT);
    uint8_t *r = aligned_alloc(4096, (size_t)SLOTS * SLOT);
    fill(w, (size_t)SLOTS * SLOT, seed);
    memset(r, 0, (size_t)SLOTS * SLOT);
    kvl_io ops[SLOTS];
    for (uint32_t i = 0; i < SLOTS; i++) /* slot i goes to file slot (i * 7) % SLOTS */
        ops[i] = (kvl_io){fd, 1, w + (size_t)i * SLOT, SLOT, (uint64_t)((i * 7) % SLOTS) * SLOT, -1};
    CHECKF(kvl_blockio_run(io, ops, SLOTS) == KVL_OK, "%s", kvl_last_error());
    for (uint32_t i = 0; i < SLOTS; i++)
        CHECK(ops[i].result == SLOT);
    for (uint32_t i = 0; i < SLOTS; i++)
        ops[i] = (kvl_io){fd, 0, r + (size_t)i * SLOT, SLOT, (uint64_t)((i * 7) % SLOTS) * SLOT, -1};
    CHECKF(kvl_blockio_run(io, ops, SLOTS) == KVL_OK, "%s", kvl_last_error());
    CHECK(memcmp(w, r, (size_t)SLOTS * SLOT) == 0);
    free(w);
    free(r);
}

typedef struct shared {
    kvl_blockio *io;
    int seed;
} shared;

static void *hammer(void *arg)
{
    shared *s = arg;
    uint8_t *buf = aligned_alloc(4096, SLOT);
    uint8_t *back = aligned_alloc(4096, SLOT);
    for (int k = 0; k < 50; k++) {
        /* each thread owns the file slots s->seed, s->seed + 4, ... */
        uint64_t off = (uint64_t)(s->seed + 4 * (k % 16)) * SLOT;
        fill(buf, SLOT, (uint64_t)(s->seed * 1000 + k));
        kvl_io op = {fd, 1, buf, SLOT, off, 0};
        CHECK(kvl_blockio_run(s->io, &op, 1) == KVL_OK);
        kvl_io rd = {fd, 0, back, SLOT, off, 0};
        CHECK(kvl_blockio_run(s->io, &rd, 1) == KVL_OK);
        CHECK(memcmp(buf, back, SLOT) == 0);
    }
    free(buf);
    free(back);
    return NULL;
}

static void test_errors(kvl_blockio *io)
{
    uint8_t *b = aligned_alloc(4096, SLOT);
    kvl_io past = {fd, 0, b, SLOT, (uint64_t)SLOTS * SLOT * 4, 0};
    CHECK(kvl_blockio_run(io, &past, 1) == KVL_ERR_SYSTEM);
    CHECKF(past.result == -EIO && strstr(kvl_last_error(), "read of 8192 bytes") != NULL, "%lld %s",
           (long long)past.result, kvl_last_error());
    int closed = dup(fd);
    close(closed);
    kvl_io bad = {closed, 0, b, SLOT, 0, 0};
    CHECK(kvl_blockio_run(io, &bad, 1) == KVL_ERR_SYSTEM && bad.result == -EBADF);
    kvl_io neg = {-1, 0, b, SLOT, 0, 0};
    CHECK(kvl_blockio_run(io, &neg, 1) == KVL_ERR_INVALID_ARG);
    CHECK(strstr(kvl_last_error(), "operation 0") != NULL);
    CHECK(kvl_blockio_run(NULL, &neg, 1) == KVL_ERR_INVALID_ARG);
    CHECK(kvl_blockio_run(io, NULL, 0) == KVL_OK); /* an empty batch */
    free(b);
}

static void test_copy_and_spans(void)
{
    uint8_t src[3000], dst[3000];
    fill(src, sizeof src, 9);
    memset(dst, 0, sizeof dst);
    kvl_copy ops[3] = {{dst, src + 1000, 1000}, {dst + 1000, src, 1000}, {dst + 2000, src + 2000, 1000}};
    kvl_copy_batch(ops, 3);
    CHECK(memcmp(dst, src + 1000, 1000) == 0 && memcmp(dst + 1000, src, 1000) == 0 &&
          memcmp(dst + 2000, src + 2000, 1000) == 0);
    kvl_span spans[3] = {{src, 7}, {src + 7, 2000}, {src + 2007, 993}};
    CHECK(kvl_crc32c_spans(0, spans, 3) == kvl_crc32c(0, src, sizeof src));

    /* large pieces take the streaming path: odd offsets and lengths, both ends exact */
    size_t big = 300001;
    uint8_t *a = malloc(big + 64), *b = malloc(big + 64);
    fill(a, big + 64, 10);
    memset(b, 0xAB, big + 64);
    kvl_copy one = {b + 3, a + 5, big};
    kvl_copy_batch(&one, 1);
    CHECK(memcmp(b + 3, a + 5, big) == 0 && b[2] == 0xAB && b[3 + big] == 0xAB);

    /* copies with checksums, two blocks interleaved piece by piece (layer-major order) */
    memset(b, 0, big + 64);
    size_t q = big / 4;
    kvl_copy four[4] = {{b, a, q}, {b + 2 * q, a + 2 * q, q}, {b + q, a + q, q},
                        {b + 3 * q, a + 3 * q, q}};
    uint32_t blk[4] = {0, 1, 0, 1}, crcs[2] = {0, 0};
    CHECK(kvl_copy_crc_batch(four, blk, 4, crcs, 2) == KVL_OK);
    CHECK(memcmp(b, a, 4 * q) == 0);
    CHECK(crcs[0] == kvl_crc32c(0, a, 2 * q) && crcs[1] == kvl_crc32c(0, a + 2 * q, 2 * q));
    uint32_t bad[1] = {2};
    memset(b, 0, big + 64);
    CHECK(kvl_copy_crc_batch(four, bad, 1, crcs, 2) == KVL_ERR_INVALID_ARG);
    CHECK(b[0] == 0 && strstr(kvl_last_error(), "block 2 of 2") != NULL); /* nothing copied */
    free(a);
    free(b);
}

static void run_backend(int force_threads)
{
    kvl_blockio *io = NULL;
    CHECKF(kvl_blockio_open(32, 4, force_threads, &io) == KVL_OK, "%s", kvl_last_error());
    if (!io)
        return;
    const char *b = kvl_blockio_backend(io);
    printf("backend: %s\n", b);
#ifdef KVL_HAVE_URING
    if (!force_threads)
        CHECKF(strncmp(b, "io_uring", 8) == 0, "built with liburing but ran on %s", b);
#else
    CHECK(strncmp(b, "threads (4; ", 12) == 0);
#endif
    test_round_trip(io, 1 + (uint64_t)force_threads);
    test_errors(io);
    pthread_t th[4];
    shared s[4];
    for (int i = 0; i < 4; i++) {
        s[i] = (shared){io, i};
        pthread_create(&th[i], NULL, hammer, &s[i]);
    }
    for (int i = 0; i < 4; i++)
        pthread_join(th[i], NULL);
    kvl_blockio_close(io);
}

int main(void)
{
    double t0 = test_now_s();
    snprintf(path, sizeof path, "/var/tmp/kvl-blockio-%d", (int)getpid());
    fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_DIRECT, 0600);
    if (fd < 0) /* a file system without O_DIRECT: buffered */
        fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
    CHECK(fd >= 0);
    CHECK(ftruncate(fd, (off_t)SLOTS * SLOT) == 0);
    kvl_blockio *io = NULL;
    CHECK(kvl_blockio_open(0, 4, 0, &io) == KVL_ERR_INVALID_ARG && io == NULL);
    CHECK(kvl_blockio_open(8, 65, 0, &io) == KVL_ERR_INVALID_ARG && io == NULL);
    CHECK(kvl_blockio_open(8, 4, 0, NULL) == KVL_ERR_INVALID_ARG);
    kvl_blockio_close(NULL);
    run_backend(0);
    run_backend(1);
    test_copy_and_spans();
    close(fd);
    unlink(path);
    return test_report("blockio", t0);
}
