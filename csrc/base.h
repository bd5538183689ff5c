/* base.h: what every core module shares: limits, errors (errors.c), the
 * clock (clock.c), the wire codec and the transport interface, and the
 * names of the core's types (each module's header defines its own). */
#ifndef KVLINK_BASE_H
#define KVLINK_BASE_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* accept4, TCP_USER_TIMEOUT, getrandom */
#endif

#include <pthread.h>
#include <time.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/uio.h>

#include "kvlink.h"

#define KVL_MAX_PATHS 64
#define KVL_MAX_IO_THREADS 64
#define KVL_MAX_REGIONS 8192     /* regions per agent: bounds the region table frame */
#define KVL_MAX_TAG 4096
#define KVL_ERR_MAX KVL_ERR_CANCELLED  /* the highest error code: a peer's status above is garbage */
#define KVL_SECRET_MAX 256        /* bytes of the cluster secret */
#define KVL_SECRET_MIN 16
#define KVL_HANDSHAKE_BODY_MAX (4u << 20) /* HELLO_ACK's region table: 8192 x ~350 bytes */
#define KVL_PREAUTH_BODY_MAX 256u /* a frame body before the handshake ends (HELLO, AUTH) */
#define KVL_MAX_ANSWERS_QUEUED 4096 /* frames queued to a peer that does not read them */
#define KVL_MAX_ANSWER_BYTES (16u << 20) /* ...or the memory they hold */
#define KVL_PARTIAL_FRAME_TIMEOUTS 6 /* x connect_timeout: a started frame's bytes stop coming */
#define KVL_MAX_CONNS_PER_PEER (4 * (KVL_MAX_PATHS + 1)) /* inbound, one peer name */
#define KVL_MAX_PREAUTH 256       /* accepted connections still in their handshake */
#define KVL_MAX_PEER_NAMES 4096   /* inbound peer names remembered */
/* Peer names with live connections from one source address: a host runs a
 * few agents per GPU at most (TP 8 prefill + decode: 16), and every agent
 * on loopback shares 127.0.0.1, so 64 leaves room; one admitted process
 * cannot take the whole name table. */
#define KVL_MAX_NAMES_PER_SOURCE 64
#define KVL_LOG_MAX 1024         /* log records kept for the application (log.c) */
#define KVL_MAX_CHUNK (1ull << 30)
#define KVL_MAX_XFER_CHUNKS 65536 /* chunks per transfer: bounds ANNOUNCE to 512 KiB */
#define KVL_MAX_LAYERS 65536      /* far above any model; bounds per-layer arrays */
#define KVL_RX_BUCKETS 4096       /* inbound transfer lookup (at most 16384 entries) */
/* Chunks per path a transfer is split into at least (above min_chunk_bytes):
 * enough that a path slowing down mid-transfer holds little of the work and
 * the tail evens out; measured on the testbed (docs/BENCHMARKS.md). */
#define KVL_CHUNKS_PER_PATH 32

/* ---- errors.c ---- */
kvl_err kvl_fail(kvl_err err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
kvl_err kvl_fail_errno(const char *what);
void kvl_clear_error(void);

/* ---- clock.c ---- */
uint64_t kvl_now_ns(void);
/* CLOCK_MONOTONIC deadline timeout_ms from now, for pthread_cond_timedwait. */
struct timespec kvl_deadline_ts(uint32_t timeout_ms);
/* A condition variable on CLOCK_MONOTONIC (every timed wait in the core). */
void kvl_cond_init(pthread_cond_t *cv);
/* With mu held: waits on cv until pred(obj, arg) or timeout_ms passed.
 * Returns 0 when pred holds, -1 on timeout. */
int kvl_cond_wait_until(pthread_cond_t *cv, pthread_mutex_t *mu, int (*pred)(void *, uint32_t),
                        void *obj, uint32_t arg, uint32_t timeout_ms);

#include "wire.h"
#include "transport/transport.h"

typedef struct kvl_peer kvl_peer;
typedef struct kvl_xfer kvl_xfer;
typedef struct kvl_inxfer kvl_inxfer;
typedef struct kvl_region kvl_region;
typedef struct kvl_regions kvl_regions;
typedef struct kvl_path kvl_path;
typedef struct kvl_inbound kvl_inbound;
typedef struct kvl_rx_xfer kvl_rx_xfer;
typedef struct kvl_cmd kvl_cmd;
typedef struct kvl_stage_buf kvl_stage_buf;

#endif
