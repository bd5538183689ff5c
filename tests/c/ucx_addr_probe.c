/* ucx_addr_probe.c: what libucp does with a hostile worker address (a
 * measurement for docs/ucx.md, not a test: its finding is that it can kill
 * the process, so it runs one address per process).
 *
 * Usage: ucx_addr_probe LIBUCP MODE SEED
 *   MODE 0: the address of a live worker replaced by SEED's random bytes
 *   MODE 1: 1-3 random bytes of that address changed
 * Prints what kvl_ucx_ep_create returned; a process that dies did not.
 * `make -C tests/c ucx-addr-probe` runs 20 seeds of each mode and counts. */
#include <stdio.h>
#include <stdlib.h>

#include "internal.h"
#include "transport/ucx/ucx.h"

int main(int argc, char **argv)
{
    char why[512];
    if (argc != 4 || kvl_ucx_load(argv[1], why, sizeof why) != 0) {
        fprintf(stderr, "usage: %s LIBUCP MODE SEED (%s)\n", argv[0], argc == 4 ? why : "");
        return 2;
    }
    int mode = atoi(argv[2]);
    srand((unsigned)atoi(argv[3]));
    kvl_ucx_worker *wa = NULL, *wb = NULL;
    uint8_t addr[KVL_UCX_ADDR_MAX];
    size_t len = 0;
    if (kvl_ucx_worker_create("lo", NULL, &wa) || kvl_ucx_worker_create("lo", NULL, &wb) ||
        kvl_ucx_worker_address(wb, addr, sizeof addr, &len)) {
        fprintf(stderr, "%s\n", kvl_last_error());
        return 2;
    }
    if (mode == 0)
        for (size_t i = 0; i < len; i++)
            addr[i] = (uint8_t)rand();
    else
        for (int k = 1 + rand() % 3; k > 0; k--)
            addr[(size_t)rand() % len] = (uint8_t)rand();
    kvl_ucx_ep *ep = NULL;
    kvl_err e = kvl_ucx_ep_create(wa, addr, len, &ep);
    printf("%s\n", e ? "refused" : "accepted");
    kvl_ucx_ep_close(ep, 1, 1000);
    kvl_ucx_worker_destroy(wa);
    kvl_ucx_worker_destroy(wb);
    return 0;
}
