/* internal.h: declarations shared by the C core's files; not installed. */
#ifndef KVLINK_INTERNAL_H
#define KVLINK_INTERNAL_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* accept4, TCP_USER_TIMEOUT, getrandom */
#endif

#include <pthread.h>
#include <time.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/uio.h>

#include "kvlink.h"
#include "progress.h"

#define KVL_MAX_PATHS 64
#define KVL_MAX_IO_THREADS 64
#define KVL_MAX_REGIONS 8192     /* regions per agent: bounds the region table frame */
#define KVL_MAX_TAG 4096
#define KVL_ERR_MAX KVL_ERR_AUTH  /* the highest error code: a peer's status above is garbage */
#define KVL_SECRET_MAX 256        /* bytes of the cluster secret */
#define KVL_SECRET_MIN 16
#define KVL_HANDSHAKE_BODY_MAX (4u << 20) /* HELLO_ACK's region table: 8192 x ~350 bytes */
#define KVL_PREAUTH_BODY_MAX 256u /* a frame body before the handshake ends (HELLO, AUTH) */
#define KVL_MAX_ANSWERS_QUEUED 4096 /* frames queued to a peer that does not read them */
#define KVL_MAX_ANSWER_BYTES (16u << 20) /* ...or their headers and bodies */
#define KVL_PARTIAL_FRAME_TIMEOUTS 6 /* x connect_timeout: a started frame's bytes stop coming */
#define KVL_MAX_CONNS_PER_PEER (4 * (KVL_MAX_PATHS + 1)) /* inbound, one peer name */
#define KVL_MAX_PREAUTH 256       /* accepted connections still in their handshake */
#define KVL_MAX_PEER_NAMES 4096   /* inbound peer names remembered */
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

/* ---- the transport interface (csrc/transport/transport.h) ---- */
#include "transport/transport.h"

/* ---- cuda.c: the CUDA runtime, loaded at run time (kvl_cuda_load_lib) ---- */
/* 1 once kvl_cuda_load_lib succeeded in this process.  Thread-safe. */
int kvl_cuda_loaded(void);
/* Checks that [p, p+len) is CUDA device (or managed) memory of one device,
 * that device when device >= 0; *actual: its ordinal.  KVL_ERR_INVALID_ARG
 * with the reason otherwise (runtime not loaded, no device, host memory,
 * another device).  Thread-safe, does not block. */
kvl_err kvl_cuda_check_ptr(const void *p, uint64_t len, int32_t device, int32_t *actual);
/* cudaMemcpy(cudaMemcpyDefault): blocks until the copy is issued and, for
 * device->host, done.  The runtime must be loaded.  Any thread. */
kvl_err kvl_cuda_copy(void *dst, const void *src, size_t len);
/* Waits until every copy issued on the legacy default stream is done. */
kvl_err kvl_cuda_sync(void);
/* Pinned host memory (cudaMallocHost), or NULL; freed with kvl_cuda_host_free. */
void *kvl_cuda_host_alloc(size_t len);
void kvl_cuda_host_free(void *p);

/* ---- staging.c: payloads of memory the sockets cannot touch, via host slots ---- */
enum { KVL_STAGE_NONE = 0, KVL_STAGE_MEMCPY = 1, KVL_STAGE_CUDA = 2 };
/* One slot of host memory: one payload's bytes while it is staged. */
typedef struct kvl_stage_buf {
    uint8_t *p;
    size_t cap;
    int pinned; /* from kvl_cuda_host_alloc */
    struct kvl_stage_buf *next; /* in the agent's idle list */
} kvl_stage_buf;
/* How payloads of a region of memory type mem move: KVL_STAGE_CUDA for
 * device memory, KVL_STAGE_MEMCPY for host memory under
 * cfg.stage_host_memory (tests, overhead measurements), else NONE. */
int kvl_stage_kind(const kvl_agent *a, uint32_t mem);
/* A slot of at least len bytes from a's pool (a new one when none idle
 * fits), pinned for KVL_STAGE_CUDA where the runtime gives pinned memory;
 * the caller owns it until kvl_stage_give.  KVL_ERR_NOMEM.  Thread-safe. */
kvl_err kvl_stage_take(kvl_agent *a, int kind, size_t len, kvl_stage_buf **out);
/* Gives b (NULL: nothing) back to a's pool: kept idle up to
 * cfg.stage_pool_bytes, freed beyond.  Thread-safe. */
void kvl_stage_give(kvl_agent *a, kvl_stage_buf *b);
/* Frees every idle slot: agent teardown, after every connection is gone. */
void kvl_stage_pool_destroy(kvl_agent *a);
/* Copies the n pieces of src (len bytes in all, at most b->cap) into b.
 * Blocks for the copies.  Errors: a CUDA copy failed (kvl_last_error says
 * which). */
kvl_err kvl_stage_gather(kvl_stage_buf *b, int kind, const struct iovec *src, int n, size_t len);
/* Copies b's first bytes out to the n pieces of dst and, for CUDA, waits
 * until they are in device memory. */
kvl_err kvl_stage_scatter(const kvl_stage_buf *b, int kind, const struct iovec *dst, int n);

/* ---- region.c ---- */
typedef struct kvl_region {
    uint64_t id;
    uint8_t *base;
    uint64_t size;
    uint32_t rights;
    uint32_t mem;
    int32_t device;           /* KVL_MEM_CUDA: the device's ordinal; -1 for host memory */
    char name[KVL_NAME_MAX];
    uint32_t rkey_len;        /* the transport's remote key (reg_mem) */
    uint8_t rkey[KVL_MAX_RKEY];
    uint8_t key[KVL_KEY_BYTES]; /* exposed regions: the access key every piece must carry */
    int refs; /* transfers / frames using it; under regions_mu */
} kvl_region;

/* A remote region's access key, as its owner's metadata gave it. */
typedef struct kvl_rkey_entry {
    uint64_t id;
    uint8_t key[KVL_KEY_BYTES];
} kvl_rkey_entry;
/* bsearch of a bare uint64_t id (a) in kvl_rkey_entry elements sorted by id (b). */
int kvl_region_key_cmp(const void *a, const void *b);

typedef struct kvl_regions {
    pthread_mutex_t mu;
    kvl_region **v; /* sorted by id (ids only grow) */
    size_t n, cap;
    uint64_t next_id;
} kvl_regions;

void kvl_regions_init(kvl_regions *t);
void kvl_regions_destroy(kvl_regions *t);
/* Finds and references the region holding [off, off+len) with the rights
 * bits required; on failure returns the specific code and message naming
 * what (a prefix, e.g. "segments[3].dst") and which side ("this agent"). */
/* The memory type of region id (KVL_MEM_HOST when not registered).
 * Thread-safe (regions.mu). */
uint32_t kvl_regions_mem(kvl_regions *t, uint64_t id);
kvl_err kvl_regions_acquire(kvl_regions *t, uint64_t id, uint64_t off, uint64_t len,
                            uint32_t need, const char *what, kvl_region **out);
void kvl_regions_release(kvl_regions *t, kvl_region *r);
/* The exposed regions (remote_read / remote_write) in wire form, for
 * handshakes; no access keys.  Caller frees *out. */
kvl_err kvl_regions_snapshot(kvl_regions *t, kvl_region_info **out, size_t *n);

/* ---- engine structures ---- */
typedef struct kvl_conn kvl_conn;
typedef struct kvl_out kvl_out;

typedef struct kvl_path {
    uint32_t index;
    kvl_conn *conn;
    kvl_ep *ep;                /* connected endpoint waiting for the engine to adopt it */
    uint32_t state;            /* kvl_path_state */
    char local[48], remote[48];
    uint64_t inflight_bytes;
    uint32_t inflight_chunks;
    double bw_Bps;             /* EWMA of the busy-period delivery rate; 0 = no sample yet */
    double rtt_us;             /* smoothed RTT from TCP_INFO, sampled every tick */
    uint64_t busy_start_ns;    /* when the path last went from idle to busy */
    uint64_t busy_bytes;       /* bytes verified since busy_start_ns */
    char rhost[48];            /* the peer address and port this path connects to */
    uint16_t rport;
    int nic;                   /* index into agent->nics */
    /* monitor (monitor.c) */
    double delivery_Bps;
    double nic_other_Bps;
    uint64_t t_progress_ns;    /* last time bytes moved either way (tick resolution) */
    uint64_t t_chunk_ns;       /* last chunk verified on this path */
    uint64_t seen_acked, seen_received;
    uint32_t stall_ms;
    uint64_t t_last_ping_ns, ping_sent_ns; /* ping_sent_ns != 0: a probe is outstanding */
    uint64_t bytes_sent_prev, bytes_recv_prev; /* totals of earlier connections */
    uint64_t bytes_put_prev;   /* ... of which placed by a one-sided mover (bytes_put) */
    /* re-probing (probe.c) */
    uint64_t next_probe_ns;
    uint32_t backoff_ms;
    uint32_t reconnects;
    uint64_t hedges;
    uint64_t t_down_ns;
    uint32_t probe_fails;      /* reconnects that failed since the path last was up */
    char down_cause[96];       /* why it left service, kept through failed reconnects */
    uint64_t t_stall_ns;       /* STALLED since */
    uint64_t stall_acked, stall_received; /* TCP counters when it stalled */
    uint32_t stall_limit_ms;   /* silence that counted as a stall at that moment */
    double jitter_ms;          /* longest silence the path recovered from (decays) */
    uint64_t chunks_done;
    char last_error[160];
    /* what carries the connection's payloads (transport.h): its mover's kind and
     * KVL_MV_* bits, 0 in-stream; the scheduler reads the bits, never a name */
    uint32_t mover_kind, mover_caps;
    char tnote[128];           /* why this transport (kvl_path_info.transport_note) */
    /* a connection that a KVL_MV_FALLS_BACK mover carried died: the path's next
     * connections run in-stream on the same NIC (no mover) until this
     * CLOCK_MONOTONIC time; atomic (the connecting threads read it) */
    uint64_t mover_off_until_ns;
    char mover_died[96];       /* engine: why it died (for the fallen-back path's note) */
    uint32_t mover_died_kind;  /* engine: the mover that carried it */
} kvl_path;

struct kvl_peer {
    kvl_agent *agent;
    char name[KVL_NAME_MAX];
    uint64_t instance;
    uint32_t flags;            /* KVL_PEER_* from kvl_peer_connect, fixed */
    kvl_conn *ctrl;
    kvl_ep *ctrl_ep;           /* control endpoint until adoption */
    kvl_path ctrl_path;        /* where the control connection goes, and its probe state */
    uint8_t token[KVL_TOKEN_BYTES]; /* our session with this peer: in every HELLO */
    kvl_path paths[KVL_MAX_PATHS];
    uint32_t n_paths;
    int adopted;               /* engine has taken the connections over */
    atomic_int replaced;       /* removed, or a newer peer of the same name took over:
                                  out of the callers' list */
    atomic_int may_work;       /* some path is up or may come back (kvl_path_may_work):
                                  the engine keeps it, submit reads it as a hint */
    int retiring;              /* engine: being removed; freed once nothing refers to it */
    uint64_t retire_by_ns;     /* engine: stop waiting for its queues to drain */
    uint32_t probes;           /* engine: reconnects in flight on the prober thread */
    struct kvl_xfer *active;   /* running transfers, FIFO (engine-owned) */
    uint32_t rr_next;          /* round-robin baseline: next path */
    struct kvl_xfer *active_tail;
    struct kvl_pnotify *notifs; /* NOTIFYs sent, not yet acknowledged (notify.c) */
    /* remote region table: written by handshake / refresh, read by submit */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    kvl_region_info *regions;
    size_t n_regions;
    kvl_rkey_entry *keys;      /* access keys from the metadata, sorted by id */
    size_t n_keys, cap_keys;
    uint64_t regions_gen;
    int refresh_pending;
    struct kvl_peer *next;     /* callers' list, under agent->mu */
    struct kvl_peer *eng_next; /* engine's list, engine thread only */
};

struct kvl_xfer {
    atomic_int refs;           /* one for the caller, one for the engine */
    uint64_t id;
    int op;
    kvl_peer *peer;
    kvl_agent *agent;
    kvl_segment *segs;
    size_t n_segs;
    kvl_plan plan;
    uint8_t **local_ptr;       /* per segment: our side's address of its first byte */
    int stage;                 /* KVL_STAGE_*: our side's memory goes through staging slots */
    kvl_region **held;         /* local regions referenced until retirement */
    size_t n_held;
    kvl_rkey_entry *keys;      /* access keys of the remote regions it names, sorted by id */
    size_t n_keys;
    uint32_t *key_used;        /* per key: the last chunk frame (key_frames) that carried it */
    uint32_t key_frames;       /* chunk frames built so far (engine) */
    uint8_t *notify;
    uint32_t notify_len;
    uint64_t deadline_ns;
    /* engine-owned scheduling state */
    uint8_t *cstate;           /* per chunk: KVL_CHUNK_* */
    uint32_t *attempt;         /* per chunk: sends so far */
    uint8_t *cpath;            /* per chunk: path of the attempt in flight */
    uint32_t *pattempt;        /* per chunk: attempt number of that copy */
    uint8_t *hpath;            /* per chunk: path of a hedge copy, or KVL_NO_PATH */
    uint32_t *hattempt;        /* per chunk: attempt number of the hedge copy */
    uint8_t *fails;            /* per chunk: copies lost to errors (limit: max_attempts) */
    uint32_t *powner;          /* pull, per chunk: the attempt placing bytes (newest wins) */
    uint32_t next_chunk;       /* next never-sent chunk */
    uint64_t bytes_pending;    /* bytes of chunks not in flight and not done */
    uint32_t *retry;           /* chunks to resend first */
    uint32_t n_retry;
    uint64_t ann_serial[KVL_MAX_PATHS]; /* push: connection (serial) of each path that
                                           carried its ANNOUNCE */
    int io_refs;               /* frames / receives touching this transfer's memory */
    struct kvl_xfer *next_active;
    struct kvl_xfer *next_all;
    uint64_t t_submit_ns;
    atomic_uint retries;       /* chunk sends beyond the first */
    /* shared with callers.  prog.fin is the engine's view of the outcome; callers
     * see it only once the transfer has let go of its regions (deferred), so
     * "done" means deregister() will succeed */
    kvl_progress prog;
};

enum { KVL_CHUNK_PENDING = 0, KVL_CHUNK_INFLIGHT = 1, KVL_CHUNK_DONE = 2 };
#define KVL_NO_PATH 0xff

/* Inbound identities seen in handshakes, for duplicate-name detection. */
typedef struct kvl_inbound {
    char name[KVL_NAME_MAX];
    uint64_t instance;
    uint8_t token[KVL_TOKEN_BYTES]; /* the session its live connections belong to */
    uint64_t sender;           /* that session's key for inbound state: a hash of the name,
                                  instance and token (another name or token: other pushes) */
    int conns;
    struct kvl_inbound *next;
} kvl_inbound;

typedef struct kvl_notif_node kvl_notif_node; /* notify.c */
#define KVL_NOTIFY_SEEN_MAX 4096 /* transfer notifications remembered for de-duplication */

typedef struct kvl_cmd {
    int type;
    kvl_peer *peer;
    kvl_xfer *xfer;
    int path;                  /* PROBED: path index, -1 for the control connection */
    kvl_ep *ep;                /* PROBED: the new endpoint, or NULL */
    char error[160];           /* PROBED: why it failed */
    uint8_t *tag;              /* PREPARE: owned */
    uint32_t tag_len;
    struct kvl_cmd *next;
} kvl_cmd;
enum {
    KVL_CMD_ADOPT_PEER = 1,
    KVL_CMD_SUBMIT = 2,
    KVL_CMD_REFRESH = 3,
    KVL_CMD_PROBED = 4,
    KVL_CMD_PREPARE = 5,
    KVL_CMD_REMOVE_PEER = 6,   /* error: why */
    KVL_CMD_REGIONS = 7        /* no peer: this agent's regions changed (movers re-map) */
};

struct kvl_agent {
    kvl_config cfg;            /* addrs copied below; secret copied to secret[] */
    char name[KVL_NAME_MAX];
    uint8_t secret[KVL_SECRET_MAX]; /* the cluster secret; secret_len 0: none */
    size_t secret_len;
    char (*addrs)[48];
    uint16_t *ports;
    size_t n_addrs;
    uint64_t instance;
    const kvl_stream_ops *stream; /* every connection's (transport/registry.c) */
    void *tp_state;            /* the transport's own (TCP: its I/O threads) */
    kvl_regions regions;
    int epfd, wakefd;
    kvl_ep **listeners;
    pthread_t thread;
    int thread_started;
    atomic_int stopping;
    atomic_int closed;
    atomic_int closing;        /* close() asked: send what is queued, then stop */
    uint64_t linger_end_ns;    /* engine: when close() stops waiting for the queues */
    /* command queue: callers -> engine */
    pthread_mutex_t mu;        /* cmds, peers list, xfer ids */
    kvl_cmd *cmd_head, *cmd_tail;
    kvl_peer *peers;
    uint64_t next_xfer_id;
    /* engine-owned */
    kvl_peer *eng_peers;       /* peers adopted by the engine */
    kvl_conn *conns;           /* every live connection */
    kvl_conn *dead;            /* closed this iteration; freed at its end */
    kvl_xfer *all_xfers;
    kvl_inbound *inbound;      /* inbound peers by name (proto.c), at most KVL_MAX_PEER_NAMES */
    uint32_t n_inbound;
    uint32_t n_conns_in;       /* accepted connections alive (bounded: cfg.max_connections) */
    uint32_t n_preauth;        /* ...of them still in their handshake (KVL_MAX_PREAUTH) */
    uint64_t t_refused_log_ns; /* last "too many connections" log record */
    uint64_t loglim_t_ns;      /* kvl_log_limited's window (engine) */
    uint32_t loglim_n, loglim_dropped;
    struct kvl_rx_xfer *rx_xfers; /* chunk ownership of inbound pushes (inbound.c) */
    struct kvl_rx_xfer *rx_buckets[KVL_RX_BUCKETS]; /* the same entries by (instance, xfer) */
    uint64_t rx_seed;          /* secret hash seed: senders cannot aim at one bucket */
    uint8_t token_seed[16];    /* secret: our session token with each peer (peer.c) */
    uint32_t n_rx_xfers;
    uint32_t rx_chunks_live;   /* chunks of announced pushes not yet ended (bounded) */
    uint32_t rx_layers_live;   /* and their layers (bounded) */
    pthread_mutex_t inq_mu;    /* handles of inbound pushes nobody took yet */
    pthread_cond_t inq_cv;
    kvl_inxfer *inq_head;
    uint64_t next_conn_serial; /* engine: kvl_conn serial numbers */
    uint8_t *scratch;          /* sink for payload bytes that must be drained */
    /* staging slots not in use (staging.c), under stage_mu */
    pthread_mutex_t stage_mu;
    kvl_stage_buf *stage_idle;
    uint64_t stage_idle_bytes;
    size_t scratch_len;
    uint64_t next_tick_ns;
    uint64_t next_stall_ns;
    /* notifications: engine -> callers */
    pthread_mutex_t notif_mu;
    pthread_cond_t notif_cv;
    kvl_notif_node *notif_head, *notif_tail;
    uint32_t notif_count;
    uint64_t notif_dropped;    /* engine: notifications refused by a full queue */
    struct {
        uint64_t instance, xfer;
    } seen[KVL_NOTIFY_SEEN_MAX]; /* engine: notifications delivered, for de-duplication */
    uint32_t seen_next;
    /* local NICs behind our addresses, for competing-traffic counters */
    struct kvl_nic {
        char ifname[32];
        uint64_t tx;           /* tx_bytes at the previous tick */
        uint64_t ours_tx;      /* our payload bytes through it at the previous tick */
        double other_Bps;
    } *nics;
    size_t n_nics;
    int nic_of_addr[KVL_MAX_PATHS];
    uint64_t t_nic_ns;
    /* prober thread: re-connects down paths (blocking) outside the engine */
    pthread_t prober;
    int prober_started;
    pthread_mutex_t probe_mu;
    pthread_cond_t probe_cv;
    struct kvl_probe_job *jobs;
    /* log records for the application (log.c) */
    pthread_mutex_t log_mu;
    pthread_cond_t log_cv;
    kvl_log_record log_ring[KVL_LOG_MAX];
    uint32_t log_head, log_count;
    uint64_t log_dropped;
    int log_woken;
    /* path snapshots for kvl_paths */
    pthread_mutex_t stats_mu;
    kvl_path_info *snap;
    size_t n_snap, cap_snap;
};

/* ---- proto.c: the protocol over a transport's endpoints ---- */
/* A connection over endpoint ep (outbound after its handshake, or just
 * accepted); the endpoint is attached to the engine.  NULL: out of memory. */
kvl_conn *kvl_conn_new(kvl_agent *a, kvl_ep *ep);
/* Engine thread: takes a connected (detached) endpoint into the event loop
 * as a connection; NULL on failure (the endpoint is discarded). */
kvl_conn *kvl_conn_adopt(kvl_agent *a, kvl_ep *ep);
void kvl_conn_fail(kvl_conn *c, kvl_err err, const char *why);
int kvl_conn_is_dead(const kvl_conn *c);
uint64_t kvl_conn_serial(const kvl_conn *c);
/* Frees connections failed during this engine iteration. */
void kvl_conn_reap(kvl_agent *a);
/* Teardown (engine stopped): frees every connection without callbacks. */
void kvl_conn_close_all(kvl_agent *a);
/* Queues a control frame (buf is taken over).  Returns 0, or -1 if dead. */
int kvl_conn_send_frame(kvl_conn *c, kvl_buf *buf);
/* Queues a DATA frame (push) or READ_REQ (pull) for chunk ci of x. */
int kvl_conn_send_chunk(kvl_conn *c, kvl_xfer *x, uint32_t ci);
void kvl_conn_bind_outbound(kvl_conn *c, kvl_peer *p, int path);
void kvl_conn_expire(kvl_agent *a, uint64_t now);
int kvl_conn_sample(const kvl_conn *c, kvl_tp_sample *out);
/* Iterates a->conns (live connections). */
kvl_conn *kvl_conn_next(const kvl_conn *c);
/* 1 while frames wait in the send queue. */
int kvl_conn_has_output(const kvl_conn *c);
/* close(): drops chunk frames (DATA, READ_REQ) not yet started. */
void kvl_conn_drop_unstarted(kvl_conn *c);
uint64_t kvl_conn_bytes_sent(const kvl_conn *c);
uint64_t kvl_conn_bytes_recv(const kvl_conn *c);
/* Engine thread: this agent's regions changed: c's mover, if it maps
 * regions (KVL_MV_MAPS_REGIONS), maps the new ones and drops the gone ones. */
void kvl_conn_regions_changed(kvl_conn *c);
/* Payload bytes a one-sided mover placed on c, either way (bytes_put).  Engine thread. */
uint64_t kvl_conn_bytes_put(const kvl_conn *c);
/* Cancels the copy (xid, ci, attempt) queued on c without disturbing the
 * connection (the transport's cancel()).  Returns 1 if the copy was found. */
int kvl_conn_cancel_chunk(kvl_conn *c, uint64_t xid, uint32_t ci, uint32_t attempt);
/* Fails the connection with an abortive close (RST): used to cut a path
 * that stayed silent while stalled. */
void kvl_conn_abort(kvl_conn *c, const char *why);

/* ---- xfer.c ---- */
/* Chunk ci verified: progress, layer and event bookkeeping, wakes waiters. */
void kvl_xfer_chunk_done(kvl_xfer *x, uint32_t ci, uint32_t path, uint64_t now);
/* Marks the transfer failed (first error wins) and wakes waiters. */
void kvl_xfer_set_failed(kvl_xfer *x, kvl_err err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
int kvl_xfer_running(kvl_xfer *x);
/* Builds x's ANNOUNCE frame (a push's tag, size and chunk-to-layer map). */
void kvl_xfer_announce(kvl_xfer *x, kvl_buf *b, uint64_t now);
/* Makes the outcome visible to callers (info.state) and wakes them. */
void kvl_xfer_publish(kvl_xfer *x);
void kvl_xfer_ref(kvl_xfer *x);

/* ---- policy.c: the scheduler's decisions, pure functions ---- */
/* What the scheduler needs to know of a path, at one instant. */
typedef struct kvl_path_view {
    int usable;               /* UP or DEGRADED with a live connection */
    double bw_Bps;            /* EWMA of its delivery rate; 0: no sample yet */
    double rtt_us;
    double nic_other_Bps;     /* traffic on its NIC that is not ours */
    uint64_t inflight_bytes;
    uint32_t inflight_chunks;
    uint64_t idle_ns;         /* since it last verified a chunk or got busy */
} kvl_path_view;
/* Mean rate of the usable paths that have one, else 1 GB/s. */
double kvl_policy_prior(const kvl_path_view *v, uint32_t n);
/* The rate a path is planned with (measured, prior, less competing traffic). */
double kvl_policy_rate(const kvl_path_view *pv, double prior);
int kvl_policy_window_open(const kvl_path_view *pv, uint32_t window_chunks, uint64_t window_bytes);
/* The path for a chunk of `bytes`: the earliest predicted finish
 * ((in flight + bytes) / rate + rtt) among usable paths with window room; a
 * full best path gives way to one with room only if that one still beats
 * the remaining work (pending_bytes + all in flight) at the aggregate rate.
 * -1: wait (no usable path, or the chunk should wait for the best one). */
int kvl_policy_pick(const kvl_path_view *v, uint32_t n, uint64_t bytes, uint64_t pending_bytes,
                    uint32_t window_chunks, uint64_t window_bytes);
/* Seconds the chunk's current copy on `slow` is predicted to need, if an
 * idle path would deliver a copy in under half of that; else 0 (no hedge). */
double kvl_policy_hedge_late_s(const kvl_path_view *slow, const kvl_path_view *idle,
                               uint64_t chunk_bytes, double prior);

/* ---- sched.c: dispatch and path scoring ---- */
void kvl_sched_dispatch(kvl_peer *p);
/* Chunk ci verified; path delivered the winning copy. */
void kvl_sched_on_chunk_done(kvl_peer *p, kvl_xfer *x, uint32_t ci, uint32_t path, uint64_t now);
/* A chunk failed on its path (checksum, or the path went down): requeue it
 * or fail the transfer when it ran out of attempts. */
void kvl_sched_requeue(kvl_peer *p, kvl_xfer *x, uint32_t ci, kvl_err err, const char *why);
void kvl_sched_path_down(kvl_peer *p, uint32_t path, const char *why);
/* The copy (path, attempt) of chunk ci was drained because a newer copy
 * took the chunk over: the newer copy carries on if it is still in flight,
 * else the chunk is sent again (not counted as a failure). */
void kvl_sched_superseded(kvl_peer *p, kvl_xfer *x, uint32_t ci, uint32_t path,
                          uint32_t attempt);
/* Path went silent while busy: its copies are cancelled in the stream and
 * re-queued (not counted as failures); the connection stays, the path gets
 * no chunks until it moves again (monitor.c). */
void kvl_sched_path_stalled(kvl_peer *p, uint32_t path, const char *why);
/* Fails p's running transfers if every path is known dead (a reconnect
 * failed since it went down); a path still being re-probed, or stalled,
 * may come back within the deadline. */
void kvl_sched_check_reachable(kvl_peer *p);
/* 0 once a reconnect of the path failed since it went down. */
int kvl_path_may_work(const kvl_path *pa);
/* Fails a running transfer from the engine: drops its chunks' in-flight
 * accounting, records the error and wakes waiters. */
void kvl_sched_fail(kvl_xfer *x, kvl_err err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
void kvl_sched_expire(kvl_agent *a, uint64_t now);
/* Releases finished transfers' resources once no I/O touches them.  Runs at
 * the end of each engine iteration, so handlers never see a freed transfer. */
void kvl_sched_reap(kvl_agent *a);
kvl_xfer *kvl_sched_find_xfer(kvl_peer *p, uint64_t id);

/* ---- monitor.c: the per-tick path monitor ---- */
void kvl_monitor_init(kvl_agent *a);
void kvl_monitor_tick(kvl_agent *a, uint64_t now);
/* The stall check, run every quarter tick while a path is busy. */
void kvl_monitor_stall_check(kvl_agent *a, uint64_t now);
/* 1 while some path has chunks in flight or is STALLED (the stall check has
 * work), else 0: an idle engine then wakes only for its tick. */
int kvl_monitor_any_busy(const kvl_agent *a);
/* Sends a PING on every idle, up data path of p (pre-warm). */
void kvl_monitor_probe_all(kvl_peer *p, uint64_t now);
/* A PONG came back on an outbound data connection. */
void kvl_monitor_on_pong(kvl_peer *p, int path, uint64_t sent_ns, uint64_t now);
/* A probe failed: the path waits twice as long (up to the cap) before the next. */
void kvl_monitor_probe_failed(kvl_peer *p, kvl_path *pa, uint64_t now, const char *why);

/* ---- probe.c: re-connecting down paths ---- */
typedef struct kvl_probe_job {
    kvl_peer *peer;
    int path; /* -1: the control connection */
    char local[48], host[48];
    uint16_t port;
    struct kvl_probe_job *next;
} kvl_probe_job;
kvl_err kvl_prober_start(kvl_agent *a);
void kvl_prober_stop(kvl_agent *a);
/* Asks the prober to re-connect path (or -1 for control) of p. */
void kvl_prober_request(kvl_agent *a, kvl_peer *p, int path);
/* Engine side: a probe finished (cmd->fd >= 0 on success). */
void kvl_prober_done(kvl_agent *a, kvl_cmd *cmd);
/* peer.c: frees a peer nothing refers to any more (its lists, its memory). */
void kvl_peer_free(kvl_peer *p);
/* peer.c: blocking connect + handshake, shared by add_peer and the prober */
kvl_err kvl_peer_open_conn(kvl_agent *a, kvl_peer *p, const char *local, const char *host,
                           uint16_t port, int kind, uint16_t path, kvl_ep **ep);

/* ---- inbound.c: which copy of a pushed chunk may write ---- */
#define KVL_RX_SUPERSEDED 100 /* wire-only ACK status: a newer copy owns the chunk */
typedef struct kvl_rx_chunk {
    uint32_t owner;   /* newest attempt seen: the only one allowed to place */
    uint8_t settled;  /* a copy was verified in place */
} kvl_rx_chunk;
typedef struct kvl_rx_xfer {
    uint64_t instance, xfer;  /* the sender session (kvl_inbound.sender) and its transfer id */
    kvl_rx_chunk *chunks;     /* NULL until announced, and again once ended */
    uint32_t n;               /* announced chunk count */
    uint32_t n_layers;        /* announced layer count */
    int ended;                /* the sender said END: every late copy is drained */
    int refs;                 /* connections placing bytes for it right now */
    uint64_t t_last_ns;
    uint64_t deadline_ns;     /* the sender's deadline, as announced (0: none) */
    kvl_inxfer *h;            /* the application's handle, until the push ends */
    struct kvl_rx_xfer *next;  /* a->rx_xfers: every entry */
    struct kvl_rx_xfer *hnext; /* a->rx_buckets: entries of one hash bucket */
} kvl_rx_xfer;
/* ANNOUNCE from sender `instance` (agent `peer`): creates the entry and
 * queues its handle for kvl_inbound_next.  A repeat is ignored. */
kvl_err kvl_rx_announce(kvl_agent *a, uint64_t instance, const char *peer,
                        const kvl_msg_announce *m);
/* 1: this copy owns the chunk and may place (*out referenced); 0: drain it
 * and answer *drain_status (KVL_OK if another copy is already verified,
 * KVL_ERR_PROTOCOL if the transfer was not announced or the chunk is not
 * in it). */
int kvl_rx_claim(kvl_agent *a, uint64_t instance, uint64_t xfer, uint32_t chunk,
                 uint32_t attempt, kvl_rx_xfer **out, uint32_t *drain_status);
/* Still the owner?  Checked before every read into the destination. */
int kvl_rx_owns(const kvl_rx_xfer *r, uint32_t chunk, uint32_t attempt);
/* The copy finished (verified or not; path and bytes for the handle's
 * chunk event); drops the reference. */
void kvl_rx_done(kvl_rx_xfer *r, uint32_t chunk, uint32_t attempt, int verified, uint32_t path,
                 uint64_t bytes);
/* END: the sender finished the push (m->status says how). */
void kvl_rx_end(kvl_agent *a, uint64_t instance, const kvl_msg_status *m);
void kvl_rx_expire(kvl_agent *a, uint64_t now);
/* Sender session `sender` (kvl_inbound.sender) is over: what it left is
 * dropped, handles failed. */
void kvl_rx_forget_sender(kvl_agent *a, uint64_t sender);
void kvl_rx_free_all(kvl_agent *a);
/* proto.c: every copy placing a chunk of r stops placing before this
 * returns (the handle is about to report a failure).  silent: the sender's
 * END never came, so writes of r it posted on a one-sided path may still
 * land: every such path from it is fenced too. */
void kvl_proto_revoke_rx(kvl_agent *a, kvl_rx_xfer *r, int silent);

/* ---- sha256.c ---- */
#define KVL_SHA256_BYTES 32
typedef struct kvl_sha256 {
    uint32_t h[8];
    uint64_t len;
    uint8_t buf[64];
    size_t fill;
} kvl_sha256;
typedef struct kvl_hmac {
    kvl_sha256 inner, outer;
} kvl_hmac;
void kvl_sha256_init(kvl_sha256 *s);
void kvl_sha256_update(kvl_sha256 *s, const void *data, size_t n);
void kvl_sha256_final(kvl_sha256 *s, uint8_t out[KVL_SHA256_BYTES]);
void kvl_hmac_init(kvl_hmac *m, const void *key, size_t key_len);
void kvl_hmac_update(kvl_hmac *m, const void *data, size_t n);
void kvl_hmac_final(kvl_hmac *m, uint8_t out[KVL_SHA256_BYTES]);
/* 1 if a and b hold the same n bytes; the time taken does not depend on where they differ. */
int kvl_ct_equal(const void *a, const void *b, size_t n);

/* ---- auth.c: the handshake's mutual challenge-response ---- */
/* What both proofs of one connection cover: who connects to whom, as which
 * connection, and both fresh nonces. */
typedef struct kvl_auth_ctx {
    const char *server_name, *client_name;
    uint64_t server_instance, client_instance;
    uint8_t kind;
    uint16_t path;
    const uint8_t *nonce_c, *nonce_s; /* KVL_NONCE_BYTES each */
} kvl_auth_ctx;
/* The listener's (server 1) or the initiator's (server 0) proof that it
 * holds a's secret: HMAC-SHA256 over a direction label and x, so one side's
 * proof is never valid as the other's. */
void kvl_auth_mac(const kvl_agent *a, int server, const kvl_auth_ctx *x,
                  uint8_t out[KVL_MAC_BYTES]);
/* A fresh random nonce.  Returns KVL_OK, or KVL_ERR_SYSTEM without entropy. */
kvl_err kvl_auth_nonce(uint8_t out[KVL_NONCE_BYTES]);

/* ---- log.c ---- */
/* Queues a record for the application's logger (any thread).  path -1: none. */
void kvl_log(kvl_agent *a, int level, const char *peer, int path, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

/* Engine thread: kvl_log for what a peer's frames cause (refused
 * handshakes, wrong keys): at most 10 records a second, then a count. */
void kvl_log_limited(kvl_agent *a, int level, const char *peer, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* ---- path.c: the path state machine ---- */
/* Moves pa (a data path of p, or &p->ctrl_path) to state, logging why;
 * DOWN and STALLED keep why as last_error. */
void kvl_path_set_state(kvl_peer *p, kvl_path *pa, uint32_t state, const char *why);
const char *kvl_path_state_name(uint32_t state);
/* Refreshes p->may_work after a path's state or probe count changed. */
void kvl_peer_update_hint(kvl_peer *p);

/* ---- notify.c: notifications delivered exactly once ---- */
/* Sender: keeps the NOTIFY of transfer xfer pending on p and sends a copy. */
void kvl_notify_queue(kvl_peer *p, uint64_t xfer, uint32_t op, const void *tag, uint32_t len);
/* Sender: the receiver's NOTIFY_ACK for xfer arrived. */
void kvl_notify_acked(kvl_peer *p, uint64_t xfer);
/* Sender: connection c of p died; copies it carried are sent again elsewhere. */
void kvl_notify_conn_lost(kvl_peer *p, const kvl_conn *c);
/* Sender: (re)sends copies whose connection died or that wait too long (every tick). */
void kvl_notify_resend(kvl_peer *p, uint64_t now);
/* Sender: 1 while a notification of p is unacknowledged and p is reachable. */
int kvl_notify_pending(const kvl_peer *p);
void kvl_notify_free_all(kvl_peer *p);
/* Receiver: a NOTIFY arrived from agent `peer` (instance); queues it for the
 * application unless it is a re-sent copy.  Returns 1: acknowledge it. */
int kvl_notify_inbound(kvl_agent *a, const char *peer, uint64_t instance,
                       const kvl_msg_notify *m);
/* Teardown: frees notifications nobody read. */
void kvl_notify_queue_free(kvl_agent *a);

/* ---- engine.c ---- */
/* Queues a command for the engine thread and wakes it.  Takes cmd over. */
void kvl_engine_post(kvl_agent *a, kvl_cmd *cmd);
void kvl_engine_snapshot_paths(kvl_agent *a);

#endif
