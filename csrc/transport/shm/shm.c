/* shm.c: the same-host mover (cma.h; docs/ucx.md, "Same-host peers").
 *
 * Receiver-pulled: a chunk frame's cover is a descriptor of where its
 * payload lies in the sender's memory; the receiver copies it with
 * process_vm_readv straight into the destination, in batches, while the
 * sender holds that memory until the chunk's ACK (the stream does that for
 * every KVL_MV_RECEIVER_PULLED mover).  Set up by the HELLO alone: the
 * initiator names the mover when the peer's metadata says it runs on this
 * host; the listener agrees only when the connecting socket is in its
 * network namespace, and takes descriptors only of the process that owns
 * the connection's other end.
 *
 * post() runs on the I/O thread that sends the frame (or the engine), and
 * rx_begin / pull / skip on the one that receives: one frame at a time each
 * way, so the send side keeps no state and the receive side's cursor is
 * touched by one thread at a time.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../internal.h"
#include "cma.h"

typedef struct shm_mover {
    kvl_agent *a;
    kvl_ep *ep;
    struct sockaddr_storage local, peer; /* the connection, for the pid check */
    int have_addrs;
    /* receive: the descriptor of the frame arriving */
    uint32_t pid;       /* its process */
    uint32_t pid_ok;    /* the process checked to own the peer's socket (0: none yet) */
    struct iovec *rv;   /* its source ranges */
    uint32_t nrv, cap;
    int ri;             /* copy cursor in rv */
    size_t roff;
} shm_mover;

static shm_mover *S(kvl_mover *m) { return (shm_mover *)m; }

static kvl_err make(kvl_agent *a, kvl_ep *ep, kvl_mover **out)
{
    shm_mover *s = calloc(1, sizeof *s);
    if (!s)
        return kvl_fail(KVL_ERR_NOMEM, "out of memory for a same-host path");
    s->a = a;
    s->ep = ep;
    s->have_addrs = a->stream->addrs(ep, &s->local, &s->peer) == 0;
    *out = (kvl_mover *)s;
    return KVL_OK;
}

static kvl_err shm_start(kvl_agent *a, kvl_ep *ep, const char *local, uint64_t deadline_ns,
                         kvl_mover **out, char *note, size_t note_len)
{
    (void)local;
    (void)deadline_ns;
    (void)note;
    (void)note_len;
    return make(a, ep, out); /* the metadata and the permission probe said so (peer.c) */
}

static int shm_agree(kvl_agent *a, kvl_ep *ep, kvl_mover **out)
{
    struct sockaddr_storage l, p;
    if (a->stream->addrs(ep, &l, &p) != 0) {
        kvl_fail(KVL_ERR_PROTOCOL, "CMA: the connection's addresses are unknown");
        return -1;
    }
    /* a peer elsewhere asking for descriptors of our memory: no */
    if (kvl_cma_peer_here(&l, &p))
        return -1;
    return make(a, ep, out) ? -1 : 0;
}

static void shm_note(const kvl_mover *m, char *out, size_t len)
{
    (void)m;
    snprintf(out, len, "same host: payloads copied process to process (CMA), no socket");
}

static int shm_covers(const kvl_mover *m, const kvl_tp_frame *f)
{
    (void)m;
    /* never from a staging slot, which is given back once the frame left */
    return !f->stage && f->payload_len && f->n_payload > 0 &&
           (uint32_t)f->n_payload <= KVL_MAX_PIECES;
}

/* The trailer vouches for the source as it is now; the receiver's copy of it
 * must match.  Taken before the descriptor goes, so the trailer follows it
 * at once and the receiver copies without waiting on the socket. */
static kvl_err shm_post(kvl_mover *m, kvl_mv_send *s)
{
    (void)m;
    s->crc = 0;
    for (int i = 0; i < s->n_src; i++)
        s->crc = kvl_crc32c(s->crc, s->src[i].iov_base, s->src[i].iov_len);
    s->cover_len = kvl_cma_desc_len((uint32_t)s->n_src);
    if (!(s->cover = malloc(s->cover_len)))
        return kvl_fail(KVL_ERR_NOMEM, "out of memory for a same-host descriptor");
    kvl_cma_desc_encode(s->cover, s->src, s->n_src);
    s->ticket = 0;
    return KVL_OK;
}

static int shm_ready(kvl_mover *m, uint64_t ticket, char *why, size_t why_len)
{
    (void)m;
    (void)ticket;
    (void)why;
    (void)why_len;
    return 1; /* nothing to wait for: the receiver copies */
}

static int shm_wait(kvl_mover *m, uint64_t ticket, uint64_t deadline_ns)
{
    (void)m;
    (void)ticket;
    (void)deadline_ns;
    return 1;
}

/* The descriptor arrived: checked (bounds, sum, the process owns the peer's
 * socket) before one byte is copied. */
static kvl_err shm_rx_begin(kvl_mover *mv, const uint8_t *cover, size_t len, uint64_t payload_len)
{
    shm_mover *s = S(mv);
    uint32_t pid, n;
    if (len < KVL_CMA_HEAD_BYTES)
        return kvl_fail(KVL_ERR_PROTOCOL, "CMA: a descriptor of %zu bytes", len);
    kvl_err e = kvl_cma_desc_head(cover, KVL_MAX_PIECES, &pid, &n);
    if (e)
        return e;
    if (kvl_cma_desc_len(n) != len)
        return kvl_fail(KVL_ERR_PROTOCOL,
                        "CMA: a descriptor of %zu bytes announcing %u ranges (%zu bytes)", len,
                        n, kvl_cma_desc_len(n));
    if (n > s->cap) {
        struct iovec *nv = realloc(s->rv, n * sizeof *nv);
        if (!nv)
            return kvl_fail(KVL_ERR_NOMEM, "out of memory for a CMA descriptor");
        s->rv = nv;
        s->cap = n;
    }
    if ((e = kvl_cma_desc_ranges(cover + KVL_CMA_HEAD_BYTES, n, payload_len, s->rv)))
        return e;
    if (pid != s->pid_ok) {
        if (!s->have_addrs)
            return kvl_fail(KVL_ERR_PROTOCOL, "CMA: the connection's addresses are unknown");
        if ((e = kvl_cma_peer_check(&s->local, &s->peer, pid)))
            return e;
        s->pid_ok = pid;
    }
    s->pid = pid;
    s->nrv = n;
    s->ri = 0;
    s->roff = 0;
    return KVL_OK;
}

static ssize_t shm_pull(kvl_mover *mv, const struct iovec *v, int n)
{
    shm_mover *s = S(mv);
    return kvl_cma_read(s->pid, v, n, s->rv, (int)s->nrv, &s->ri, &s->roff);
}

static void shm_skip(kvl_mover *mv, size_t len)
{
    shm_mover *s = S(mv);
    kvl_cma_advance(s->rv, (int)s->nrv, &s->ri, &s->roff, len);
}

static void shm_free(kvl_mover *mv, uint32_t timeout_ms)
{
    (void)timeout_ms;
    shm_mover *s = S(mv);
    if (!s)
        return;
    free(s->rv);
    free(s);
}

const kvl_mover_ops kvl_shm_mover = {
    .name = "shm",
    .label = "shm",
    .what = "same-host copies",
    .kind = KVL_MOVER_SHM,
    .caps = KVL_MV_RECEIVER_PULLED | KVL_MV_NO_HEDGE | KVL_MV_SAME_HOST,
    .start = shm_start,
    .agree = shm_agree,
    .note = shm_note,
    .covers = shm_covers,
    .post = shm_post,
    .ready = shm_ready,
    .wait = shm_wait,
    .rx_begin = shm_rx_begin,
    .pull = shm_pull,
    .skip = shm_skip,
    .pull_what = "same-host copy from the peer's memory (process_vm_readv; run "
                 "transport='tcp' where the OS forbids it)",
    .free = shm_free,
};
