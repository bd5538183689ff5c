/* inbound.c: which copy of a pushed chunk may write into our memory.
 *
 * A chunk can reach us more than once: re-sent after its path was cut, or
 * hedged onto a second path while the first copy straggles.  Both copies name
 * the same destination bytes, so if both wrote, a slow or corrupt copy could
 * overwrite bytes another copy had already verified, even after the sender
 * reported the transfer complete.  So the receiver keeps, per sender instance
 * and transfer, the owner of every chunk: the newest attempt seen places its
 * bytes, an older attempt still arriving is drained to scratch from then on,
 * and once a copy is verified (settled) every other copy is drained.  After
 * the sender's END the transfer is a tombstone: late copies are drained too.
 * Engine thread only.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define ENDED_KEEP_NS (30ull * 1000000000ull) /* tombstones outlive any late copy */
#define IDLE_KEEP_NS (300ull * 1000000000ull) /* a sender that vanished without END */

static kvl_rx_xfer *find(kvl_agent *a, uint64_t instance, uint64_t xfer)
{
    for (kvl_rx_xfer *r = a->rx_xfers; r; r = r->next)
        if (r->instance == instance && r->xfer == xfer)
            return r;
    return NULL;
}

static int grow(kvl_rx_xfer *r, uint32_t chunk)
{
    if (chunk < r->n)
        return 0;
    uint32_t n = r->n ? r->n : 64;
    while (n <= chunk)
        n *= 2;
    kvl_rx_chunk *nc = realloc(r->chunks, n * sizeof *nc);
    if (!nc)
        return -1;
    memset(nc + r->n, 0, (n - r->n) * sizeof *nc);
    r->chunks = nc;
    r->n = n;
    return 0;
}

int kvl_rx_claim(kvl_agent *a, uint64_t instance, uint64_t xfer, uint32_t chunk,
                 uint32_t attempt, kvl_rx_xfer **out, uint32_t *drain_status)
{
    kvl_rx_xfer *r = find(a, instance, xfer);
    if (!r) {
        r = calloc(1, sizeof *r);
        if (!r) {
            *drain_status = KVL_ERR_NOMEM;
            return 0;
        }
        r->instance = instance;
        r->xfer = xfer;
        r->next = a->rx_xfers;
        a->rx_xfers = r;
    }
    r->t_last_ns = kvl_now_ns();
    if (r->ended || grow(r, chunk)) {
        *drain_status = r->ended ? KVL_RX_SUPERSEDED : KVL_ERR_NOMEM;
        return 0;
    }
    kvl_rx_chunk *ch = &r->chunks[chunk];
    if (ch->settled) {
        *drain_status = KVL_OK; /* another copy is verified in place already */
        return 0;
    }
    if (attempt < ch->owner) {
        *drain_status = KVL_RX_SUPERSEDED;
        return 0;
    }
    ch->owner = attempt;
    r->refs++;
    *out = r;
    return 1;
}

int kvl_rx_owns(const kvl_rx_xfer *r, uint32_t chunk, uint32_t attempt)
{
    return !r->ended && chunk < r->n && !r->chunks[chunk].settled &&
           r->chunks[chunk].owner == attempt;
}

void kvl_rx_done(kvl_rx_xfer *r, uint32_t chunk, uint32_t attempt, int verified)
{
    if (verified && kvl_rx_owns(r, chunk, attempt))
        r->chunks[chunk].settled = 1;
    r->refs--;
}

void kvl_rx_end(kvl_agent *a, uint64_t instance, uint64_t xfer)
{
    kvl_rx_xfer *r = find(a, instance, xfer);
    if (!r) {
        r = calloc(1, sizeof *r);
        if (!r)
            return;
        r->instance = instance;
        r->xfer = xfer;
        r->next = a->rx_xfers;
        a->rx_xfers = r;
    }
    r->ended = 1;
    free(r->chunks);
    r->chunks = NULL;
    r->n = 0;
    r->t_last_ns = kvl_now_ns();
}

void kvl_rx_expire(kvl_agent *a, uint64_t now)
{
    kvl_rx_xfer **pp = &a->rx_xfers;
    while (*pp) {
        kvl_rx_xfer *r = *pp;
        uint64_t keep = r->ended ? ENDED_KEEP_NS : IDLE_KEEP_NS;
        if (!r->refs && now - r->t_last_ns > keep) {
            *pp = r->next;
            free(r->chunks);
            free(r);
        } else {
            pp = &r->next;
        }
    }
}

void kvl_rx_free_all(kvl_agent *a)
{
    while (a->rx_xfers) {
        kvl_rx_xfer *r = a->rx_xfers;
        a->rx_xfers = r->next;
        free(r->chunks);
        free(r);
    }
}
