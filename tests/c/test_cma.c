/* test_cma.c: the same-host descriptor (csrc/transport/tcp/cma.c): round trip,
 * each bound, and the copy itself (process_vm_readv of this process, across
 * range and destination boundaries, partial steps, a gone source). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "test_main.h"
#include "transport/shm/cma.h"

int main(void)
{
    double t0 = test_now_s();
    test_rng r = {11};
    uint8_t src[3000], dst[3000];
    rng_fill(&r, src, sizeof src);

    /* round trip: three source ranges */
    struct iovec v[3] = {{src, 1000}, {src + 1000, 1}, {src + 1001, 1999}};
    uint8_t desc[KVL_CMA_HEAD_BYTES + 3 * KVL_CMA_RANGE_BYTES];
    CHECK(kvl_cma_desc_len(3) == sizeof desc);
    kvl_cma_desc_encode(desc, v, 3);
    uint32_t pid, n;
    CHECK(kvl_cma_desc_head(desc, 8, &pid, &n) == KVL_OK && pid == (uint32_t)getpid() && n == 3);
    struct iovec got[3];
    CHECK(kvl_cma_desc_ranges(desc + KVL_CMA_HEAD_BYTES, 3, 3000, got) == KVL_OK);
    CHECK(got[0].iov_base == src && got[2].iov_len == 1999);

    /* bounds: range count, sum, zero length, wrap, pid 0 */
    CHECK(kvl_cma_desc_head(desc, 2, &pid, &n) == KVL_ERR_PROTOCOL);
    CHECK(kvl_cma_desc_ranges(desc + KVL_CMA_HEAD_BYTES, 3, 2999, got) == KVL_ERR_PROTOCOL);
    CHECK(kvl_cma_desc_ranges(desc + KVL_CMA_HEAD_BYTES, 3, 3001, got) == KVL_ERR_PROTOCOL);
    uint8_t bad[sizeof desc];
    memcpy(bad, desc, sizeof bad);
    memset(bad + KVL_CMA_HEAD_BYTES + 8, 0, 8); /* range 0: length 0 */
    CHECK(kvl_cma_desc_ranges(bad + KVL_CMA_HEAD_BYTES, 3, 3000, got) == KVL_ERR_PROTOCOL);
    memcpy(bad, desc, sizeof bad);
    memset(bad + KVL_CMA_HEAD_BYTES, 0xff, 8); /* range 0 starts 1000 bytes below 2^64 */
    CHECK(kvl_cma_desc_ranges(bad + KVL_CMA_HEAD_BYTES, 3, 3000, got) == KVL_ERR_PROTOCOL);
    memset(bad, 0, 4); /* pid 0 */
    CHECK(kvl_cma_desc_head(bad, 8, &pid, &n) == KVL_ERR_PROTOCOL);
    memset(bad, 0, KVL_CMA_HEAD_BYTES); /* no range */
    bad[0] = 1;
    CHECK(kvl_cma_desc_head(bad, 8, &pid, &n) == KVL_ERR_PROTOCOL);

    /* the copy, in steps whose destination pieces cut the ranges elsewhere */
    struct iovec l1[2] = {{dst, 700}, {dst + 700, 1100}}, l2[1] = {{dst + 1800, 1200}};
    int ri = 0;
    size_t roff = 0;
    CHECK(kvl_cma_read((uint32_t)getpid(), l1, 2, got, 3, &ri, &roff) == 1800);
    CHECK(ri == 2 && roff == 799);
    CHECK(kvl_cma_read((uint32_t)getpid(), l2, 1, got, 3, &ri, &roff) == 1200);
    CHECK(ri == 3 && roff == 0 && memcmp(src, dst, sizeof src) == 0);

    /* a source that is gone: EFAULT, nothing claimed */
    long pg = sysconf(_SC_PAGESIZE);
    uint8_t *gone = mmap(NULL, (size_t)pg, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                         -1, 0);
    CHECK(gone != MAP_FAILED);
    munmap(gone, (size_t)pg);
    struct iovec g = {gone, 100};
    ri = 0;
    roff = 0;
    errno = 0;
    CHECK(kvl_cma_read((uint32_t)getpid(), l2, 1, &g, 1, &ri, &roff) == -1 && errno == EFAULT);
    CHECK(ri == 0 && roff == 0);
    return test_report("cma", t0);
}
