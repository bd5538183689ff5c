/* internal.h: declarations shared by the C core's files; not installed. */
#ifndef KVLINK_INTERNAL_H
#define KVLINK_INTERNAL_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* accept4, TCP_USER_TIMEOUT, getrandom */
#endif

#include "base.h"
#include "progress.h"

#include "wire.h"

/* ---- the transport interface (csrc/transport/transport.h) ---- */
#include "transport/transport.h"

#include "cuda.h"

#include "staging.h"

#include "region.h"

#include "share.h"

/* ---- engine structures ---- */
typedef struct kvl_conn kvl_conn;
typedef struct kvl_out kvl_out;

#include "path.h" /* kvl_path: one path to a peer, and what changes it */

struct kvl_peer {
    kvl_agent *agent;
    char name[KVL_NAME_MAX];
    uint64_t instance;
    uint32_t flags;            /* KVL_PEER_* from kvl_peer_connect, fixed */
    kvl_conn *ctrl;
    kvl_ep *ctrl_ep;           /* control endpoint until adoption */
    kvl_path ctrl_path;        /* where the control connection goes, and its probe state */
    uint8_t token[KVL_TOKEN_BYTES]; /* our session with this peer: in every HELLO */
    uint8_t e2e[32];           /* its end-to-end key (metadata): seals relayed paths */
    size_t e2e_len;            /* 0: none given, no path may be relayed */
    kvl_path paths[KVL_MAX_PATHS];
    uint32_t n_paths;
    int adopted;               /* engine has taken the connections over */
    atomic_int replaced;       /* removed, or a newer peer of the same name took over:
                                  out of the callers' list */
    atomic_int may_work;       /* some path is up or may come back (kvl_path_may_work):
                                  the engine keeps it, add_peer reads it as a hint */
    atomic_int gone;           /* a reconnect met another instance of the name (it
                                  restarted): no path comes back, submit refuses */
    char gone_why[192];        /* why, written once before gone is set (engine) */
    uint64_t wait_since_ns;    /* engine: every path down while transfers run, since
                                  (0: no transfer waits for a path) */
    uint32_t n_waiting;        /* engine: those transfers, as of the last check (paths()) */
    uint64_t wait_log_ns;      /* engine: the last "wait for a path" record (1 a second) */
    uint32_t wait_unlogged;    /* engine: waits not logged since; wait_logged: this one was */
    int wait_logged;
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
    uint32_t src;              /* IPv4 source of the connection that opened this session
                                  (network order): the per-source limits count it there */
    int conns;
    struct kvl_inbound *next;
} kvl_inbound;

typedef struct kvl_notif_node kvl_notif_node; /* notify.c */

typedef struct kvl_cmd {
    int type;
    kvl_peer *peer;
    kvl_xfer *xfer;
    int path;                  /* PROBED: path index, -1 for the control connection */
    kvl_ep *ep;                /* PROBED: the new endpoint, or NULL */
    char error[160];           /* PROBED: why it failed */
    uint64_t met;              /* PROBED: the instance that answered, not the peer's (0: none) */
    uint8_t *tag;              /* PREPARE: owned */
    int fd;                    /* ACCEPT: the socket, for stream->accept_fd */
    kvl_tp_wrap wrap;          /* ACCEPT: what describes it */
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
    KVL_CMD_REGIONS = 7,       /* no peer: this agent's regions changed (movers re-map) */
    KVL_CMD_ACCEPT = 8,        /* no peer: a relayed connection arrived (kvl_engine_accept) */
    KVL_CMD_CANCEL = 9         /* xfer (a reference of the command's): fail it; error: why */
};

struct kvl_rx_xfer;
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
    const struct kvl_loop_hooks *hooks; /* what the engine thread's loop runs (agent.c) */
    const struct kvl_conn_hooks *conn_hooks; /* what a closing connection tells (agent.c) */
    /* inbound.c: the copies still placing a push's chunks stop (place.c) */
    void (*revoke_rx)(kvl_agent *a, struct kvl_rx_xfer *r, int silent);
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
    kvl_inbound *inbound;      /* inbound peers by name (proto.c), at most KVL_MAX_PEER_NAMES */
    uint32_t n_inbound;
    uint32_t n_conns_in;       /* accepted connections alive (bounded: cfg.max_connections) */
    uint32_t n_preauth;        /* ...of them still in their handshake (KVL_MAX_PREAUTH) */
    uint64_t t_refused_log_ns; /* last "too many connections" log record */
    uint64_t loglim_t_ns;      /* kvl_log_limited's window (engine) */
    uint32_t loglim_n, loglim_dropped;
    struct kvl_rx_xfer *rx_buckets[KVL_RX_BUCKETS]; /* inbound pushes by (instance, xfer) */
    uint64_t rx_seed;          /* secret hash seed: senders cannot aim at one bucket */
    uint8_t token_seed[16];    /* secret: our session token with each peer (peer.c) */
    struct kvl_rx_xfer **rx_heap; /* live pushes with a deadline, soonest first (inbound.c) */
    uint32_t rx_heap_n;
    kvl_shares shares;         /* what each sender session holds here (share.c) */
    pthread_mutex_t inq_mu;    /* handles of inbound pushes nobody took yet */
    pthread_cond_t inq_cv;
    kvl_inxfer *inq_head, *inq_tail;
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
    uint64_t notif_dropped;    /* engine: notifications refused (not acknowledged) for room */
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
    void *relay_state;         /* transport/relay/: sealed listeners, the relay */
    atomic_int relay_tunnels;  /* relayed connections' tunnels alive (their threads log
                                  through this agent: close waits for them) */
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
    kvl_inbound_stats inbound_snap; /* kvl_inbound_stats_get's copy, every tick */
    uint64_t paths_gen;        /* bumped when a snapshot's path set or a state differs */
    pthread_cond_t paths_cv;   /* ...and broadcast (kvl_paths_wait), under stats_mu */
};

#include "conn.h"

#include "xfer.h"

#include "policy.h"

#include "scheduler.h"

#include "monitor.h"

#include "probe.h"

#include "inbound.h"

#include "sha256.h"

#include "auth.h"

#include "log.h"

#include "notify.h"

/* ---- loop.c, snapshot.c ---- */
#include "loop.h"
#include "snapshot.h"

#endif
