/* blockio.c: the KV store's local byte moving: batches of file reads and
 * writes for its disk tier, and batches of memory copies into an engine's
 * paged layout (docs/store.md).
 *
 * File I/O goes through io_uring (liburing) when kvlink was built with
 * liburing's headers and the kernel lets this process set up a ring; else
 * through a small pool of threads doing pread / pwrite.  Either way one call
 * submits a whole batch and returns when every operation has completed: a
 * read or write the kernel has started cannot be called back, and the
 * caller's buffers must stay untouched until it ends, so there is no timeout
 * here.  The store's own deadlines (prefetch, loads) are kept above this
 * layer: a request that stops waiting leaves the batch to finish into memory
 * the store still owns.
 *
 * One batch at a time per kvl_blockio (a mutex): the store opens one for
 * reads and one for writes, so a write-back never queues a load behind it.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base.h"

#ifdef KVL_HAVE_URING
#include <liburing.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define KVL_BLOCKIO_MAX_DEPTH 4096u
#define KVL_BLOCKIO_MAX_THREADS 64u
#define KVL_BLOCKIO_MAX_OPS (1u << 24) /* per batch: bounds the work one call holds */

struct kvl_blockio {
    pthread_mutex_t run_mu; /* one batch at a time */
    char backend[160];
#ifdef KVL_HAVE_URING
    struct io_uring ring;
    int have_ring;
    uint32_t depth;
#endif
    /* the thread pool (when there is no ring) */
    pthread_mutex_t mu;
    pthread_cond_t work_cv; /* a batch was posted, or close */
    pthread_cond_t done_cv; /* the batch's last operation ended */
    pthread_t *threads;
    uint32_t n_threads;
    int stop;
    kvl_io *batch;      /* NULL when idle */
    size_t batch_n;
    size_t next;        /* next operation to take */
    size_t ended;       /* operations ended */
    uint64_t batch_gen; /* a new batch wakes workers that saw the last one end */
};

/* Moves op's bytes with plain system calls, resuming after short counts. */
static void io_sync(kvl_io *op)
{
    uint64_t done = 0;
    while (done < op->len) {
        ssize_t r = op->write
                        ? pwrite(op->fd, (const char *)op->buf + done, op->len - done,
                                 (off_t)(op->offset + done))
                        : pread(op->fd, (char *)op->buf + done, op->len - done,
                                (off_t)(op->offset + done));
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            op->result = -errno;
            return;
        }
        if (r == 0) { /* end of file on a read, a full device on a write */
            op->result = -EIO;
            return;
        }
        done += (uint64_t)r;
    }
    op->result = (int64_t)done;
}

static void *worker(void *arg)
{
    kvl_blockio *io = arg;
    pthread_mutex_lock(&io->mu);
    for (;;) {
        while (!io->stop && (!io->batch || io->next >= io->batch_n))
            pthread_cond_wait(&io->work_cv, &io->mu);
        if (io->stop)
            break;
        kvl_io *op = &io->batch[io->next++];
        pthread_mutex_unlock(&io->mu);
        io_sync(op);
        pthread_mutex_lock(&io->mu);
        if (++io->ended == io->batch_n)
            pthread_cond_broadcast(&io->done_cv);
    }
    pthread_mutex_unlock(&io->mu);
    return NULL;
}

static kvl_err start_threads(kvl_blockio *io, uint32_t n)
{
    io->threads = calloc(n, sizeof *io->threads);
    if (!io->threads)
        return kvl_fail(KVL_ERR_NOMEM, "blockio: no memory for %u threads", n);
    for (uint32_t i = 0; i < n; i++) {
        int rc = pthread_create(&io->threads[i], NULL, worker, io);
        if (rc != 0) {
            errno = rc;
            return kvl_fail_errno("blockio: pthread_create");
        }
        io->n_threads++;
    }
    return KVL_OK;
}

kvl_err kvl_blockio_open(uint32_t depth, uint32_t threads, int32_t force_threads,
                         kvl_blockio **out)
{
    if (!out)
        return kvl_fail(KVL_ERR_INVALID_ARG, "kvl_blockio_open: out is NULL");
    *out = NULL;
    if (depth == 0 || depth > KVL_BLOCKIO_MAX_DEPTH)
        return kvl_fail(KVL_ERR_INVALID_ARG, "blockio: depth %u is not in 1..%u", depth,
                        KVL_BLOCKIO_MAX_DEPTH);
    if (threads == 0 || threads > KVL_BLOCKIO_MAX_THREADS)
        return kvl_fail(KVL_ERR_INVALID_ARG, "blockio: threads %u is not in 1..%u", threads,
                        KVL_BLOCKIO_MAX_THREADS);
    kvl_blockio *io = calloc(1, sizeof *io);
    if (!io)
        return kvl_fail(KVL_ERR_NOMEM, "blockio: no memory");
    pthread_mutex_init(&io->run_mu, NULL);
    pthread_mutex_init(&io->mu, NULL);
    pthread_cond_init(&io->work_cv, NULL);
    pthread_cond_init(&io->done_cv, NULL);
    const char *why = "forced by the caller";
#ifdef KVL_HAVE_URING
    if (!force_threads) {
        int rc = io_uring_queue_init(depth, &io->ring, 0);
        if (rc == 0) {
            io->have_ring = 1;
            io->depth = depth;
            snprintf(io->backend, sizeof io->backend, "io_uring (depth %u)", depth);
            *out = io;
            return KVL_OK;
        }
        why = "the kernel refused io_uring_setup";
        snprintf(io->backend, sizeof io->backend, "threads (%u; %s: %s)", threads, why,
                 strerror(-rc));
    }
#else
    if (!force_threads)
        why = "kvlink was built without liburing's headers (install liburing-dev, rebuild)";
#endif
    if (!io->backend[0])
        snprintf(io->backend, sizeof io->backend, "threads (%u; %s)", threads, why);
    kvl_err e = start_threads(io, threads);
    if (e != KVL_OK) {
        kvl_blockio_close(io);
        return e;
    }
    *out = io;
    return KVL_OK;
}

const char *kvl_blockio_backend(const kvl_blockio *io)
{
    return io ? io->backend : "";
}

#ifdef KVL_HAVE_URING
/* Queues what is left of ops[i] (result holds the bytes done so far). */
static void uring_prep(kvl_blockio *io, kvl_io *ops, size_t i)
{
    struct io_uring_sqe *sqe = io_uring_get_sqe(&io->ring);
    uint64_t done = (uint64_t)ops[i].result;
    char *p = (char *)ops[i].buf + done;
    /* a single request moves at most 2 GiB - 4 KiB; the rest is resubmitted */
    unsigned len = (unsigned)((ops[i].len - done) > 0x7ffff000u ? 0x7ffff000u
                                                                : ops[i].len - done);
    if (ops[i].write)
        io_uring_prep_write(sqe, ops[i].fd, p, len, ops[i].offset + done);
    else
        io_uring_prep_read(sqe, ops[i].fd, p, len, ops[i].offset + done);
    io_uring_sqe_set_data64(sqe, i);
}

static void uring_run(kvl_blockio *io, kvl_io *ops, size_t n)
{
    size_t next = 0, inflight = 0, ended = 0;
    /* resubmissions of short transfers go first: a FIFO of indices */
    size_t *again = NULL, n_again = 0;
    for (size_t i = 0; i < n; i++)
        ops[i].result = 0;
    while (ended < n) {
        while (inflight < io->depth && (n_again || next < n)) {
            size_t i = n_again ? again[--n_again] : next++;
            uring_prep(io, ops, i);
            inflight++;
        }
        int rc = io_uring_submit_and_wait(&io->ring, 1);
        if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
            /* the ring itself failed: what has not ended gets the error (the
             * kernel no longer tells us about those) */
            for (size_t i = 0; i < n; i++)
                if (ops[i].result >= 0 && (uint64_t)ops[i].result < ops[i].len)
                    ops[i].result = rc;
            break;
        }
        struct io_uring_cqe *cqe;
        unsigned head, seen = 0;
        io_uring_for_each_cqe(&io->ring, head, cqe)
        {
            seen++;
            inflight--;
            size_t i = (size_t)io_uring_cqe_get_data64(cqe);
            if (cqe->res < 0 || (cqe->res == 0 && ops[i].len > 0)) {
                ops[i].result = cqe->res < 0 ? cqe->res : -EIO;
                ended++;
                continue;
            }
            ops[i].result += cqe->res;
            if ((uint64_t)ops[i].result < ops[i].len) {
                if (!again)
                    again = malloc(n * sizeof *again);
                if (!again) { /* cannot requeue: fail this one */
                    ops[i].result = -ENOMEM;
                    ended++;
                    continue;
                }
                again[n_again++] = i;
            } else {
                ended++;
            }
        }
        io_uring_cq_advance(&io->ring, seen);
    }
    free(again);
}
#endif

kvl_err kvl_blockio_run(kvl_blockio *io, kvl_io *ops, size_t n)
{
    if (!io || (!ops && n))
        return kvl_fail(KVL_ERR_INVALID_ARG, "kvl_blockio_run: io or ops is NULL");
    if (n > KVL_BLOCKIO_MAX_OPS)
        return kvl_fail(KVL_ERR_INVALID_ARG, "blockio: %zu operations in one batch (at most %u)",
                        n, KVL_BLOCKIO_MAX_OPS);
    for (size_t i = 0; i < n; i++)
        if (ops[i].fd < 0 || (!ops[i].buf && ops[i].len) ||
            ops[i].offset > (uint64_t)INT64_MAX - ops[i].len)
            return kvl_fail(KVL_ERR_INVALID_ARG,
                            "blockio: operation %zu: fd %d, buf %p, len %llu, offset %llu is "
                            "not a valid request",
                            i, ops[i].fd, ops[i].buf, (unsigned long long)ops[i].len,
                            (unsigned long long)ops[i].offset);
    if (n == 0)
        return KVL_OK;
    pthread_mutex_lock(&io->run_mu);
#ifdef KVL_HAVE_URING
    if (io->have_ring) {
        uring_run(io, ops, n);
        pthread_mutex_unlock(&io->run_mu);
        goto check;
    }
#endif
    pthread_mutex_lock(&io->mu);
    io->batch = ops;
    io->batch_n = n;
    io->next = 0;
    io->ended = 0;
    pthread_cond_broadcast(&io->work_cv);
    while (io->ended < n)
        pthread_cond_wait(&io->done_cv, &io->mu);
    io->batch = NULL;
    pthread_mutex_unlock(&io->mu);
    pthread_mutex_unlock(&io->run_mu);
#ifdef KVL_HAVE_URING
check:
#endif
    for (size_t i = 0; i < n; i++)
        if (ops[i].result < 0 || (uint64_t)ops[i].result != ops[i].len)
            return kvl_fail(KVL_ERR_SYSTEM, "blockio: %s of %llu bytes at offset %llu of fd %d: %s",
                            ops[i].write ? "write" : "read", (unsigned long long)ops[i].len,
                            (unsigned long long)ops[i].offset, ops[i].fd,
                            ops[i].result < 0 ? strerror((int)-ops[i].result) : "short");
    return KVL_OK;
}

void kvl_blockio_close(kvl_blockio *io)
{
    if (!io)
        return;
    pthread_mutex_lock(&io->mu);
    io->stop = 1;
    pthread_cond_broadcast(&io->work_cv);
    pthread_mutex_unlock(&io->mu);
    for (uint32_t i = 0; i < io->n_threads; i++)
        pthread_join(io->threads[i], NULL);
    free(io->threads);
#ifdef KVL_HAVE_URING
    if (io->have_ring)
        io_uring_queue_exit(&io->ring);
#endif
    pthread_cond_destroy(&io->work_cv);
    pthread_cond_destroy(&io->done_cv);
    pthread_mutex_destroy(&io->mu);
    pthread_mutex_destroy(&io->run_mu);
    free(io);
}

/* Copies of at least this many bytes skip the cache on the way in: a store moves a block's
 * pieces (tens of KiB and up) into pages the engine reads much later, usually more bytes than
 * the cache holds, and a streaming store spares the read of every destination line that a
 * plain store does first (measured on this repository's VMs: 32 KiB pieces at 0.5 x one
 * large memcpy with plain stores, which glibc makes streaming for large copies itself). */
#define STREAM_MIN 16384

#if defined(__x86_64__)
static int have_avx2;
static pthread_once_t avx2_once = PTHREAD_ONCE_INIT;

static void check_avx2(void)
{
    __builtin_cpu_init();
    have_avx2 = __builtin_cpu_supports("avx2");
}

/* dst 32-byte aligned, len a multiple of 128. */
__attribute__((target("avx2"))) static void copy_stream(void *dst, const void *src, size_t len)
{
    __m256i *d = dst;
    const __m256i *s = src;
    for (size_t i = 0; i < len / 32; i += 4) {
        __m256i a = _mm256_loadu_si256(s + i), b = _mm256_loadu_si256(s + i + 1);
        __m256i c = _mm256_loadu_si256(s + i + 2), e = _mm256_loadu_si256(s + i + 3);
        _mm256_stream_si256(d + i, a);
        _mm256_stream_si256(d + i + 1, b);
        _mm256_stream_si256(d + i + 2, c);
        _mm256_stream_si256(d + i + 3, e);
    }
}
#endif

/* memcpy, streaming where it pays (STREAM_MIN); returns 1 when a fence is owed. */
static int copy_one(void *dst, const void *src, size_t len)
{
#if defined(__x86_64__)
    pthread_once(&avx2_once, check_avx2);
    if (have_avx2 && len >= STREAM_MIN) {
        size_t head = (32 - ((uintptr_t)dst & 31)) & 31;
        memcpy(dst, src, head);
        size_t body = (len - head) & ~(size_t)127;
        copy_stream((char *)dst + head, (const char *)src + head, body);
        memcpy((char *)dst + head + body, (const char *)src + head + body, len - head - body);
        return 1;
    }
#endif
    memcpy(dst, src, len);
    return 0;
}

/* Streaming stores are weakly ordered: fence them before anyone is told the copy ended. */
static void copy_fence(int owed)
{
#if defined(__x86_64__)
    if (owed)
        _mm_sfence();
#else
    (void)owed;
#endif
}

void kvl_copy_batch(const kvl_copy *ops, size_t n)
{
    int owed = 0;
    for (size_t i = 0; i < n; i++)
        owed |= copy_one(ops[i].dst, ops[i].src, ops[i].len);
    copy_fence(owed);
}

kvl_err kvl_copy_crc_batch(const kvl_copy *ops, const uint32_t *block, size_t n, uint32_t *crcs,
                           size_t n_crcs)
{
    if ((!ops || !block) && n)
        return kvl_fail(KVL_ERR_INVALID_ARG, "kvl_copy_crc_batch: ops or block is NULL");
    for (size_t i = 0; i < n; i++)
        if (block[i] >= n_crcs || !crcs)
            return kvl_fail(KVL_ERR_INVALID_ARG,
                            "kvl_copy_crc_batch: op %zu names block %u of %zu", i, block[i],
                            n_crcs);
    int owed = 0;
    for (size_t i = 0; i < n; i++) {
        /* the crc reads the source from memory; the copy then reads it from the cache */
        crcs[block[i]] = kvl_crc32c(crcs[block[i]], ops[i].src, ops[i].len);
        owed |= copy_one(ops[i].dst, ops[i].src, ops[i].len);
    }
    copy_fence(owed);
    return KVL_OK;
}

uint32_t kvl_crc32c_spans(uint32_t crc, const kvl_span *spans, size_t n)
{
    for (size_t i = 0; i < n; i++)
        crc = kvl_crc32c(crc, spans[i].p, spans[i].len);
    return crc;
}
