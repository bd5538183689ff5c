/*
 * kvlink.h: the one public header of the kvlink C core.
 *
 * This file is also the cffi cdef source (kvlink/_ffi_build.py strips the
 * preprocessor lines), so it holds only what cffi can parse: plain structs,
 * enums with explicit values and prototypes.  No macros carry meaning here.
 *
 * Conventions (every prototype below follows them):
 *  - Every function returns a kvl_err (KVL_OK == 0) and gives results through
 *    out-parameters.  On failure a message a person can act on is available
 *    from kvl_last_error() in the calling thread until its next kvlink call.
 *  - "Blocks" means the call may sleep; every blocking call takes a timeout.
 *  - "Thread-safe" means any thread may call it concurrently with the engine
 *    and other callers on the same object.
 *  - Ownership: pointers passed in are borrowed for the duration of the call
 *    unless the comment says otherwise; pointers returned are owned by the
 *    library and valid for the lifetime stated.
 */
#ifndef KVLINK_H
#define KVLINK_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Error codes: stable, never reused.  Keep kvlink/_errors.py in step. */
typedef enum kvl_err {
    KVL_OK = 0,
    KVL_ERR_INVALID_ARG = 1,     /* a caller argument is wrong (message names it) */
    KVL_ERR_NOMEM = 2,           /* allocation failed */
    KVL_ERR_SYSTEM = 3,          /* a system call failed; errno in the message */
    KVL_ERR_CLOSED = 4,          /* the agent was closed */
    KVL_ERR_TIMEOUT = 5,         /* a wait ran out of time (the operation goes on) */
    KVL_ERR_UNKNOWN_PEER = 6,    /* no peer by that name */
    KVL_ERR_PEER_EXISTS = 7,     /* a different agent already uses that peer name */
    KVL_ERR_UNREACHABLE = 8,     /* could not connect to any address of the peer */
    KVL_ERR_HANDSHAKE = 9,       /* peer speaks another protocol version or refused us */
    KVL_ERR_DUPLICATE_NAME = 10, /* two live agents share one name */
    KVL_ERR_UNKNOWN_REGION = 11, /* region id not registered on that side */
    KVL_ERR_OUT_OF_BOUNDS = 12,  /* a segment reaches outside its region */
    KVL_ERR_ACCESS_DENIED = 13,  /* region lacks remote_read / remote_write */
    KVL_ERR_BUSY = 14,           /* region still used by a transfer in flight */
    KVL_ERR_CONN_LOST = 15,      /* every path to the peer failed mid-transfer */
    KVL_ERR_CHECKSUM = 16,       /* payload failed crc32c more times than allowed */
    KVL_ERR_PROTOCOL = 17,       /* malformed frame */
    KVL_ERR_END = 18,            /* no more events: the transfer has finished */
    KVL_ERR_DEADLINE = 19,       /* the transfer's own deadline passed */
    KVL_ERR_AUTH = 20,           /* the peer failed, refused or skipped authentication */
    KVL_ERR_CANCELLED = 21       /* the transfer was cancelled (kvl_xfer_cancel) */
} kvl_err;

typedef enum kvl_op {
    KVL_OP_PUSH = 1,   /* local src -> remote dst (remote needs remote_write) */
    KVL_OP_PULL = 2,   /* remote src -> local dst (remote needs remote_read)  */
    KVL_OP_PREPARE = 3 /* not a transfer: a pre-warm request (kvl_peer_send_prepare) */
} kvl_op;

typedef enum kvl_rights {
    KVL_REMOTE_READ = 1,      /* peers may pull from the region */
    KVL_REMOTE_WRITE = 2,     /* peers may push into the region */
    KVL_LOCAL_READONLY = 0x100 /* the memory is read-only here: never pull into it (local
                                  only, never sent to peers; excludes KVL_REMOTE_WRITE) */
} kvl_rights;

typedef enum kvl_mem {
    KVL_MEM_HOST = 0,
    KVL_MEM_CUDA = 1
} kvl_mem;

typedef enum kvl_xfer_state {
    KVL_XFER_RUNNING = 0,
    KVL_XFER_DONE = 1,
    KVL_XFER_FAILED = 2
} kvl_xfer_state;

typedef enum kvl_path_state {
    KVL_PATH_UP = 0,
    KVL_PATH_DEGRADED = 1,
    KVL_PATH_DOWN = 2,
    KVL_PATH_PROBING = 3,
    KVL_PATH_STALLED = 4 /* connected, but nothing moved for a while: gets no chunks until it
                            moves again (a paused receiver), or is cut when it stays silent */
} kvl_path_state;

/* Engine configuration.  Python builds and validates it (kvlink.Config);
 * the core reads no environment variables.  Borrowed during kvl_agent_create. */
typedef struct kvl_config {
    const char *name;            /* agent name, 1..63 bytes, unique among peers */
    const char *const *addrs;    /* IPv4 addresses to listen on and send from: one per NIC */
    size_t n_addrs;              /* 1..64 */
    uint16_t port;               /* listen port on every address; 0 = ephemeral */
    uint64_t chunk_bytes;        /* upper bound of a chunk */
    uint64_t min_chunk_bytes;    /* floor when small transfers are split across paths */
    uint32_t connect_timeout_ms; /* per connect + handshake */
    uint32_t monitor_interval_ms;/* engine tick: deadlines, stats, handshake expiry */
    uint32_t max_attempts;       /* sends of one chunk before the transfer fails */
    uint32_t stall_factor;       /* a busy path without progress for max(3 ticks, this x its
                                    expected chunk time) is cut and its chunks re-queued */
    uint32_t probe_backoff_max_ms; /* re-probing a down path backs off up to this */
    int32_t hedge;               /* 1: copy straggling chunks onto idle paths */
    int32_t round_robin;         /* 1: static round-robin instead of earliest finish
                                    (a baseline for benchmarks, never the default) */
    uint32_t window_chunks;      /* chunks in flight per path */
    uint64_t window_bytes;       /* or bytes in flight per path, whichever admits more */
    int32_t sock_buf_bytes;      /* SO_SNDBUF/SO_RCVBUF; 0 keeps kernel autotuning */
    uint32_t close_linger_ms;    /* close() waits up to this for queued frames to leave and
                                    notifications to be acknowledged (0: stop at once) */
    const uint8_t *secret;       /* the cluster secret (copied), 16..256 bytes, or NULL: every
                                    connection then proves both ends hold it (docs/security.md) */
    size_t secret_len;
    int32_t allow_unauthenticated; /* 1: listen on non-loopback addresses without a secret */
    uint32_t max_connections;    /* accepted connections alive at once, from all peers (each
                                    peer opens 1 + its paths); more are closed at accept */
    uint32_t idle_conn_timeout_ms; /* an admitted connection that carried no frame this long,
                                      with nothing in flight, is closed (0: never); agents
                                      ping each of theirs every 5 monitor ticks */
    uint32_t io_threads;         /* threads that move payload bytes and their crc32c, 0..64;
                                    0: all I/O on the engine thread */
    uint32_t transport;          /* kvl_transport_mode: what carries data paths' payloads */
    int32_t stage_host_memory;   /* 1: host regions' payloads go through the staging slots that
                                    GPU memory needs (memcpy instead of cudaMemcpy): for tests
                                    and for measuring the staging overhead; 0 normally */
    uint64_t stage_chunk_bytes;  /* chunk size cap of transfers whose payloads are staged (GPU
                                    memory, stage_host_memory), so copies and sockets overlap */
    uint64_t stage_pool_bytes;   /* idle staging slots (pinned host memory) kept for reuse;
                                    slots given back beyond this are freed */
    char fault_spec[128];        /* KVL_TRANSPORT_FAULT only (tests): the faults its writes
                                    suffer, "drop=0.1,corrupt=0.05,dup=0.2,late=0.05,delay_ms=20,
                                    seed=7" (transport/fault/fault.c); "" none */
    /* Relays (transport/relay/, docs/architecture.md "Relayed paths"). */
    int32_t relay;               /* 1: forward relayed connections for cluster members */
    const char *const *relay_addrs; /* addresses whose NICs it lends (NULL: addrs) */
    size_t n_relay_addrs;
    uint16_t relay_port;         /* the relay's port on each of them; 0 = ephemeral */
    uint32_t relay_yield_mbps;   /* this host's own traffic above this on a lent NIC takes the
                                    NIC back at once (0: never) */
    uint32_t relay_max_conns;    /* relayed connections at once (each: 2 MiB of pipes) */
    int32_t sealed_listen;       /* 1: accept relayed connections (a sealed port per address) */
    uint16_t sealed_port;        /* that port; 0 = ephemeral */
} kvl_config;

/* kvl_config.transport: what carries data paths' payloads besides the TCP
 * stream (docs/architecture.md, "The transport interface").  AUTO: a data
 * path to a peer on this host (kvl_peer_connect's KVL_PEER_SAME_HOST) runs
 * the shm mover (the receiver copies the payload from the sender's memory:
 * transport/shm/); every other path runs in-stream.  No UCX: the only UCX
 * without RDMA is its TCP emulation, which does not enforce key bounds.
 * TCP: in-stream only, and a HELLO naming a mover that runs unasked (shm) is
 * refused.  UCX: every data path offers the UCX mover (needs a cluster
 * secret and UCX loaded, kvl_ucx_load_lib); a path whose offer is refused or
 * fails runs in-stream on the same connection (shm to a same-host peer), and
 * kvl_path_info.transport_note says why. */
enum kvl_transport_mode {
    KVL_TRANSPORT_AUTO = 0,
    KVL_TRANSPORT_TCP = 1,
    KVL_TRANSPORT_UCX = 2,
    /* For tests only, never for data that matters: every data path offers the
     * fault-injecting mover (transport/fault/fault.c), a one-sided mover whose
     * puts are memcpy's, valid only between agents of one process; its writes
     * go wrong as kvl_config.fault_spec says.  A path whose peer refuses it
     * runs in-stream. */
    KVL_TRANSPORT_FAULT = 3
};

/* One contiguous byte range.  Region ids are those of the side that owns the
 * memory: for a push src is local and dst remote, for a pull the reverse. */
typedef struct kvl_segment {
    uint64_t src_region;
    uint64_t src_offset;
    uint64_t dst_region;
    uint64_t dst_offset;
    uint64_t len;
    uint32_t layer;   /* layer this range belongs to (0 if not layered) */
    uint32_t _pad;
} kvl_segment;

/* A region as the other side exposes it (from the handshake). */
typedef struct kvl_region_info {
    uint64_t id;
    uint64_t size;
    uint32_t rights;  /* kvl_rights bits */
    uint32_t mem;     /* kvl_mem */
    char name[64];
    uint32_t rkey_len; /* the transport's remote key for one-sided access (0: none, as TCP) */
    uint8_t rkey[256];
} kvl_region_info;

/* A chunk that finished, in completion order. */
typedef struct kvl_chunk_event {
    uint32_t chunk;        /* index in the plan */
    uint32_t path;         /* path index that delivered it */
    uint64_t bytes;
    uint32_t layer_first;  /* layers this chunk completed: [first, first+count) */
    uint32_t layer_count;
    uint64_t t_ns;         /* CLOCK_MONOTONIC time of verification */
} kvl_chunk_event;

typedef struct kvl_xfer_info {
    uint64_t id;
    uint32_t state;        /* kvl_xfer_state */
    uint32_t err;          /* kvl_err when FAILED */
    uint64_t bytes_total;
    uint64_t bytes_done;
    uint32_t chunks_total;
    uint32_t chunks_done;
    uint32_t layers;       /* number of layers (max layer + 1) */
    uint32_t retries;      /* chunk sends beyond the first */
    uint64_t t_submit_ns;
    uint64_t t_first_byte_ns; /* first chunk verified; 0 if none yet */
    uint64_t t_first_layer_ns; /* every chunk of layer 0 verified: the receiver may start
                                  on it (CLOCK_MONOTONIC); 0 if not yet */
    uint64_t t_done_ns;
    char message[512];     /* error text when FAILED */
} kvl_xfer_info;

typedef struct kvl_path_info {
    char peer[64];
    uint32_t index;
    uint32_t state;        /* kvl_path_state */
    char local_addr[48];
    char remote_addr[48];
    uint64_t bytes_sent;   /* payload bytes we sent on this path */
    uint64_t bytes_recv;   /* payload bytes we received on this path */
    uint64_t chunks_done;  /* chunks this agent initiated that completed here */
    uint64_t inflight_bytes;
    double est_gbps;       /* GB/s (1e9 bytes/s): EWMA of the busy-period delivery rate */
    double rtt_us;         /* smoothed RTT: TCP_INFO while busy, probe frames while idle */
    double delivery_gbps;  /* the kernel's latest delivery-rate sample (TCP_INFO), GB/s */
    double nic_other_gbps; /* traffic on the local NIC that is not ours, GB/s (EWMA) */
    uint32_t stall_ms;     /* time since the path last made progress while busy */
    uint32_t reconnects;   /* times the path was re-established after going down */
    uint64_t hedges;       /* straggler copies sent on this path */
    uint64_t t_down_ns;    /* CLOCK_MONOTONIC time it last left service, STALLED or
                              DOWN (0: never) */
    char last_error[160];
    char transport[8];     /* what carries this path's payload: "tcp" or "ucx" */
    char transport_note[128]; /* why (UCX refused or failed: the reason) */
    uint64_t bytes_put;    /* payload bytes moved by UCX put, across connections: pushed
                              (part of bytes_sent, flushed) or pulled (part of bytes_recv);
                              the rest went in-stream over TCP (docs/ucx.md) */
    uint32_t reconnect_fails; /* reconnects that failed since the path was last up */
    uint32_t waiting;      /* transfers to this peer that wait for a path (every path is
                              DOWN or PROBING): each goes on when one is back, or fails at
                              its deadline */
    char relay[64];        /* the relay agent this path goes through ("" direct): hop one
                              local_addr -> relay_addr, hop two the relay -> remote_addr */
    char relay_addr[48];   /* the relay's address:port */
} kvl_path_info;

typedef struct kvl_notification {
    char peer[64];
    uint64_t xfer_id;      /* the initiator's transfer id */
    uint32_t op;           /* kvl_op of the transfer, as the initiator saw it */
    uint32_t tag_len;
    uint8_t tag[4096];
} kvl_notification;

/* A push arriving at this agent, as its receiver sees it. */
typedef struct kvl_inbound_info {
    uint64_t xfer_id;      /* the sender's transfer id */
    char peer[64];         /* the sending agent */
    uint32_t state;        /* kvl_xfer_state */
    uint32_t err;          /* kvl_err when FAILED */
    uint64_t bytes_total;
    uint64_t bytes_done;   /* verified here */
    uint32_t chunks_total;
    uint32_t chunks_done;
    uint32_t layers;
    uint32_t layers_ready; /* layers 0..layers_ready-1 are all verified */
    uint64_t t_announce_ns; /* CLOCK_MONOTONIC: the push was announced */
    uint64_t t_first_byte_ns;
    uint64_t t_done_ns;
    uint32_t tag_len;      /* the push's notify tag */
    uint8_t tag[4096];
    char message[512];     /* error text when FAILED */
} kvl_inbound_info;

/* The cheap part of kvl_inbound_info, for polling every engine step. */
typedef struct kvl_inbound_progress {
    uint32_t state;
    uint32_t chunks_done;
    uint32_t layers_ready;
    uint32_t _pad;
    uint64_t bytes_done;
} kvl_inbound_progress;

typedef struct kvl_agent kvl_agent;
typedef struct kvl_peer kvl_peer;
typedef struct kvl_xfer kvl_xfer;
typedef struct kvl_inxfer kvl_inxfer;

/* ---- errors ---------------------------------------------------------- */

/* Text for the last error in this thread; owned by the library, valid until
 * the thread's next kvlink call.  Never NULL.  Thread-safe, does not block. */
const char *kvl_last_error(void);

/* Static name of an error code ("KVL_ERR_TIMEOUT").  Never NULL. */
const char *kvl_err_name(int err);

/* ---- integrity -------------------------------------------------------- */

/* crc32c (Castagnoli) of buf, continuing from crc (pass 0 to start).  Uses
 * the CPU's crc32 instruction when present.  Thread-safe, does not block. */
uint32_t kvl_crc32c(uint32_t crc, const void *buf, size_t len);

/* 1 when kvl_crc32c runs on a hardware instruction, 0 for the table code. */
int kvl_crc32c_hw(void);

/* ---- planner ----------------------------------------------------------- */

/* One piece of a chunk: bytes [seg_offset, seg_offset+len) of segment seg. */
typedef struct kvl_piece {
    uint64_t seg;
    uint64_t seg_offset;
    uint64_t len;
} kvl_piece;

typedef struct kvl_chunk {
    uint64_t first_piece;  /* index into the piece array */
    uint32_t n_pieces;
    uint32_t layer_first;  /* lowest and highest layer it carries bytes of */
    uint32_t layer_last;
    uint32_t _pad;
    uint64_t bytes;
} kvl_chunk;

typedef struct kvl_plan {
    kvl_chunk *chunks;     /* owned by the plan */
    size_t n_chunks;
    kvl_piece *pieces;     /* owned by the plan */
    size_t n_pieces;
    uint32_t *order;       /* segment indices in layer-major order; owned */
    uint64_t chunk_target; /* the chunk size the planner settled on */
    uint32_t n_layers;
} kvl_plan;

/* Splits segs into chunks of at most chunk_bytes, layer-major (stable by
 * layer), shrinking the chunk size for small transfers so each of n_paths
 * paths gets several chunks but never below min_chunk_bytes, and never more
 * than max_pieces pieces per chunk.  Zero-length segments are rejected.
 * On success *out owns its arrays until kvl_plan_free.  Pure function:
 * thread-safe, does not block. */
kvl_err kvl_plan_make(const kvl_segment *segs, size_t n_segs, uint32_t n_paths,
                      uint64_t chunk_bytes, uint64_t min_chunk_bytes,
                      uint32_t max_pieces, kvl_plan *out);

/* Frees what kvl_plan_make allocated; safe on a zeroed plan. */
void kvl_plan_free(kvl_plan *plan);

/* ---- agent -------------------------------------------------------------- */

/* Creates an agent: binds a listener on every address in cfg and starts the
 * engine thread.  *out is owned by the caller until kvl_agent_close.
 * Thread-safe, blocks briefly (bind/listen). */
kvl_err kvl_agent_create(const kvl_config *cfg, kvl_agent **out);

/* Stops the engine, fails every running transfer with KVL_ERR_CLOSED,
 * closes every socket and frees the agent.  Transfer handles stay valid
 * until kvl_xfer_release.  Not thread-safe against other calls on the same
 * agent: the caller serialises close with its own use.  Blocks until the
 * engine thread has exited. */
kvl_err kvl_agent_close(kvl_agent *agent);

/* Number of listening addresses, and address i with its bound port.
 * host must hold 48 bytes.  Thread-safe, does not block. */
kvl_err kvl_agent_n_addrs(kvl_agent *agent, size_t *n);
kvl_err kvl_agent_addr(kvl_agent *agent, size_t i, char *host, uint16_t *port);

/* Random 64-bit id of this agent instance (a restarted agent gets a new
 * one), sent in every handshake.  Thread-safe, does not block. */
kvl_err kvl_agent_instance(kvl_agent *agent, uint64_t *id);

/* ---- regions ------------------------------------------------------------- */

/* Registers [ptr, ptr+len) under a new id.  rights is a kvl_rights mask;
 * name (may be NULL or "", at most 63 bytes) lets peers find the region by
 * name.  The memory must stay valid until kvl_region_deregister returns
 * KVL_OK or the agent is closed.  Thread-safe, does not block. */
kvl_err kvl_region_register(kvl_agent *agent, void *ptr, uint64_t len,
                            uint32_t rights, uint32_t mem, const char *name,
                            uint64_t *id);

/* kvl_region_register with the device the memory lives on.  For
 * mem = KVL_MEM_CUDA, *device (in) is the CUDA ordinal the caller's object
 * names, -1 for whichever; the pointer is checked with
 * cudaPointerGetAttributes to be device memory of that one device (so the
 * CUDA runtime must be loaded first: kvl_cuda_load_lib), and *device (out)
 * is the ordinal it is on.  For KVL_MEM_HOST *device is set to -1.  device
 * may be NULL (as -1, nothing written back).  Its payloads are staged
 * through host memory (docs/api.md, "GPU memory").  Ownership, blocking
 * and threads as kvl_region_register. */
kvl_err kvl_region_register_device(kvl_agent *agent, void *ptr, uint64_t len,
                                   uint32_t rights, uint32_t mem, int32_t *device,
                                   const char *name, uint64_t *id);

/* The access key of an exposed region (remote_read or remote_write): a
 * random 16 bytes made at registration that every DATA / READ_REQ piece
 * naming the region must carry.  Hand it to peers in the metadata only.
 * KVL_ERR_ACCESS_DENIED for a region not exposed.  Thread-safe. */
kvl_err kvl_region_key(kvl_agent *agent, uint64_t id, uint8_t key[16]);

/* Removes a region.  Fails with KVL_ERR_BUSY while a transfer or a frame in
 * flight still uses it (nothing is removed then).  Thread-safe. */
kvl_err kvl_region_deregister(kvl_agent *agent, uint64_t id);

/* ---- peers ---------------------------------------------------------------- */

/* Connects to a peer: a control connection and one data connection per
 * path, each with the versioned handshake, pairing our address i with the
 * peer address on the same /24 (else by index).  hosts/ports describe the
 * peer's listeners (from its metadata).  instance is the peer's instance id
 * from its metadata (0 = accept any); flags: KVL_PEER_* below.  Adding a
 * name that is already a peer with the same instance returns that peer; with
 * another instance it fails with KVL_ERR_PEER_EXISTS; a peer of that name
 * none of whose paths is up is
 * replaced (its transfers fail, it is freed: like kvl_peer_remove, the
 * caller serialises this with other calls using the old peer).  *out is
 * owned by the agent (valid until it is removed or replaced, or close).
 * Blocks up to connect_timeout_ms per connection.  Thread-safe. */
kvl_err kvl_peer_connect(kvl_agent *agent, const char *name, uint64_t instance,
                         const char *const *hosts, const uint16_t *ports,
                         size_t n, uint32_t flags, kvl_peer **out);

/* One data path of kvl_peer_connect_routes: from local address `local`
 * (index into this agent's addresses) to hosts[remote]:ports[remote],
 * directly (via "") or through the relay agent via_name at via:via_port,
 * which forwards to that address (the peer's sealed port). */
typedef struct kvl_route {
    uint32_t local;
    uint32_t remote;
    char via[48];
    uint16_t via_port;
    char via_name[64];
} kvl_route;

/* kvl_peer_connect with the data paths spelt out (1..64 routes; the
 * control connection goes from address 0 to the remote its /24 pairs it
 * with, directly).  e2e_key (32 bytes, the peer's metadata "e2e") seals the
 * relayed paths end to end; NULL when no route is relayed.  Blocking. */
kvl_err kvl_peer_connect_routes(kvl_agent *agent, const char *name, uint64_t instance,
                                const char *const *hosts, const uint16_t *ports, size_t n,
                                uint32_t flags, const kvl_route *routes, size_t n_routes,
                                const uint8_t *e2e_key, size_t e2e_len, kvl_peer **out);

/* What an agent offers for relays: its end-to-end key (handed out only in
 * its metadata), the sealed port on each address (relayed connections to
 * it arrive there), and when it relays (kvl_config.relay) its relay ports
 * (one per lent address) and counters. */
typedef struct kvl_relay_info {
    uint8_t e2e_key[32];
    uint32_t n_sealed;
    uint16_t sealed_ports[64];
    uint32_t n_relay;
    uint16_t relay_ports[64];
    uint32_t relayed_conns;     /* relayed connections open now */
    uint64_t relayed_total;     /* ... ever */
    uint64_t relayed_bytes;     /* bytes forwarded, both directions */
    uint64_t relay_refused;     /* requests refused (secret, busy, unreachable, full) */
    uint64_t relay_yields;      /* times a lent NIC was taken back for the host's own traffic */
} kvl_relay_info;

/* Thread-safe. */
kvl_err kvl_agent_relay_info(kvl_agent *agent, kvl_relay_info *out);

/* kvl_peer_connect flags.  SAME_HOST: the peer is another process on this
 * host, in the same PID and network namespace, that takes same-host copies
 * and whose memory this process may read (the caller compared the metadata's
 * host id and pid, and asked kvl_cma_allowed): unless transport is TCP its
 * data connections copy process to process.  DEFER_RETIRE: a peer this call
 * replaces is only hidden (lookups no longer find it; calls holding it see
 * its paths down) and stays allocated until kvl_peer_retire_replaced, so the
 * caller need not keep every other call out while it connects, only while it
 * retires. */
enum { KVL_PEER_SAME_HOST = 1u, KVL_PEER_DEFER_RETIRE = 2u };

/* Retires the peers kvl_peer_connect replaced under KVL_PEER_DEFER_RETIRE:
 * their transfers fail, they are freed (like kvl_peer_remove: the caller
 * serialises this with other calls that may hold one of them).  Does not
 * block.  Thread-safe against the engine. */
kvl_err kvl_peer_retire_replaced(kvl_agent *agent);

/* 0 if this process may copy from process pid's memory (process_vm_readv:
 * what a same-host path's receiver does), else the errno that forbids it
 * (EPERM: the OS's ptrace rules, ESRCH: no such process).  Reads nothing.
 * Any thread. */
int kvl_cma_allowed(uint32_t pid);

/* Removes a peer: its running transfers fail (KVL_ERR_CONN_LOST, "removed"),
 * queued frames are sent (bounded by close_linger_ms), its connections
 * close and it is freed once nothing refers to it.  The name may then be
 * added again.  Does not block.  Thread-safe against the engine, but not
 * against other calls that use this peer: the caller serialises (pointers
 * from kvl_peer_find / kvl_peer_connect are invalid once this returns). */
kvl_err kvl_peer_remove(kvl_agent *agent, const char *name);

/* Looks a connected peer up by name.  Thread-safe, does not block. */
kvl_err kvl_peer_find(kvl_agent *agent, const char *name, kvl_peer **out);

/* Records the access key of the peer's region id (from the peer's
 * metadata), replacing an older one.  Transfers naming a region whose key
 * is unknown are refused at submit.  Thread-safe. */
kvl_err kvl_peer_set_key(kvl_peer *peer, uint64_t id, const uint8_t key[16]);

/* Copies up to cap of the peer's exposed regions (as of the last handshake
 * or refresh) into out; *n gets the total count.  Thread-safe. */
kvl_err kvl_peer_regions(kvl_peer *peer, kvl_region_info *out, size_t cap,
                         size_t *n);

/* Asks the peer for its current region table over the control connection
 * (what to do when kvl_xfer_submit names a region the table lacks, e.g. one
 * registered after the handshake).  Blocks up to timeout_ms (call with the
 * GIL released).  Thread-safe. */
kvl_err kvl_peer_refresh(kvl_peer *peer, uint32_t timeout_ms);

/* Pre-warm: delivers tag (at most 4096 bytes; typically the size or layout
 * of an upcoming transfer) to the peer as a notification with op
 * KVL_OP_PREPARE, so it can allocate and register the destination while the
 * data is still being computed, and probes every up path with a PING.
 * Queued to the engine; does not wait.  Thread-safe. */
kvl_err kvl_peer_send_prepare(kvl_peer *peer, const void *tag, size_t len);

/* ---- transfers ----------------------------------------------------------- */

/* Validates segs against local regions and the peer's exposed regions
 * (bounds, rights), plans chunks and queues the transfer.  Nothing is sent
 * when validation fails.  The peer's regions are its table as of the
 * handshake or the last kvl_peer_refresh: a region the table lacks fails
 * with KVL_ERR_UNKNOWN_REGION at once (the peer is not asked; the caller
 * may kvl_peer_refresh and submit again).  notify (may be NULL, at most
 * 4096 bytes) is delivered to the peer once, after the last chunk is
 * verified.  timeout_ms is the transfer's deadline (0 = none).  *out is
 * owned by the caller until kvl_xfer_release.  Thread-safe, never blocks
 * (takes short locks only; sends nothing itself: the engine does). */
kvl_err kvl_xfer_submit(kvl_agent *agent, kvl_peer *peer, int op,
                        const kvl_segment *segs, size_t n_segs,
                        const void *notify, size_t notify_len,
                        uint32_t timeout_ms, kvl_xfer **out);

/* Waits until the transfer finishes or timeout_ms passes.  Returns KVL_OK
 * when done, the transfer's error when failed, KVL_ERR_TIMEOUT if still
 * running.  Blocks (call with the GIL released).  Thread-safe. */
kvl_err kvl_xfer_wait(kvl_xfer *x, uint32_t timeout_ms);

/* Waits until every chunk carrying bytes of layer is verified.  Returns as
 * kvl_xfer_wait; KVL_ERR_INVALID_ARG for a layer the transfer lacks. */
kvl_err kvl_xfer_wait_layer(kvl_xfer *x, uint32_t layer, uint32_t timeout_ms);

/* Takes the next chunk completion in completion order.  KVL_ERR_END once all
 * events are taken and the transfer has finished (or failed: then the
 * transfer's error is returned instead).  Blocks up to timeout_ms. */
kvl_err kvl_xfer_next_event(kvl_xfer *x, uint32_t timeout_ms,
                            kvl_chunk_event *ev);

/* Snapshot of progress and error.  Thread-safe, does not block. */
kvl_err kvl_xfer_info_get(kvl_xfer *x, kvl_xfer_info *out);

/* Cancels a running transfer: it fails with KVL_ERR_CANCELLED and why (NULL:
 * none; the first 150 bytes are kept), the copies of its chunks still queued
 * are dropped, and a push's receiver is told at once (its handle fails: its
 * destination never counts as received).  Once kvl_xfer_wait returns after
 * this, no byte of the transfer's local memory is read or written any more:
 * the memory may then be reused.  A finished transfer keeps its outcome
 * (KVL_OK is returned all the same).  Queued to the engine; does not wait
 * (kvl_xfer_wait does).  The agent must still be open (closing it fails
 * every running transfer anyway).  Thread-safe. */
kvl_err kvl_xfer_cancel(kvl_xfer *x, const char *why);

/* Drops the caller's reference; the transfer goes on if still running.
 * x must not be used afterwards.  Thread-safe. */
void kvl_xfer_release(kvl_xfer *x);

/* ---- inbound pushes (the receiver's handle) ------------------------------ */

/* Takes the handle of a push arriving at this agent: the first announced
 * push whose notify tag equals tag (any_tag = 0), or the first one
 * (any_tag = 1), in announcement order.  A push is announced before its
 * first chunk, so the handle reports it from its first frame on.  Handles
 * nobody takes are kept up to 1024, and finished ones for 60 s.  Blocks up
 * to timeout_ms (KVL_ERR_TIMEOUT).  *out is owned by the caller until
 * kvl_inxfer_release.  Thread-safe. */
kvl_err kvl_inbound_next(kvl_agent *agent, const void *tag, size_t tag_len, int any_tag,
                         uint32_t timeout_ms, kvl_inxfer **out);

/* Waits until every chunk is verified here (KVL_OK), the push failed (its
 * error: the sender's failure, its deadline passed, the agent closed) or
 * timeout_ms passed (KVL_ERR_TIMEOUT).  Blocks.  Thread-safe. */
kvl_err kvl_inxfer_wait(kvl_inxfer *t, uint32_t timeout_ms);

/* Waits until every chunk carrying bytes of layer is verified here.
 * Returns as kvl_inxfer_wait; KVL_ERR_INVALID_ARG for a layer the push
 * lacks.  Blocks.  Thread-safe. */
kvl_err kvl_inxfer_wait_layer(kvl_inxfer *t, uint32_t layer, uint32_t timeout_ms);

/* Takes the next verified chunk in arrival order (path is this side's
 * connection index).  KVL_ERR_END when all are taken and the push is done.
 * Blocks up to timeout_ms.  Thread-safe. */
kvl_err kvl_inxfer_next_event(kvl_inxfer *t, uint32_t timeout_ms, kvl_chunk_event *ev);

/* Snapshot (copies the tag: use kvl_inxfer_progress to poll).  Does not
 * block.  Thread-safe. */
kvl_err kvl_inxfer_info(kvl_inxfer *t, kvl_inbound_info *out);
/* State and counters only: one lock, no copy of the tag.  Does not block. */
kvl_err kvl_inxfer_progress(kvl_inxfer *t, kvl_inbound_progress *out);
/* *done = 1 if layer is verified here.  Does not block.  Thread-safe. */
kvl_err kvl_inxfer_layer_done(kvl_inxfer *t, uint32_t layer, int *done);

/* Drops the caller's reference.  t must not be used afterwards. */
void kvl_inxfer_release(kvl_inxfer *t);

/* ---- logging ------------------------------------------------------------- */

/* Log levels: the numbers of Python's logging module. */
typedef enum kvl_log_level {
    KVL_LOG_DEBUG = 10,
    KVL_LOG_INFO = 20,
    KVL_LOG_WARNING = 30,
    KVL_LOG_ERROR = 40
} kvl_log_level;

typedef struct kvl_log_record {
    uint32_t level;        /* kvl_log_level */
    int32_t path;          /* path index, -1: the control connection or none */
    uint64_t t_ns;         /* CLOCK_MONOTONIC */
    uint64_t dropped;      /* records lost before this one (the ring was full) */
    char peer[64];         /* "" when no peer is concerned */
    char msg[384];
} kvl_log_record;

/* Takes the next log record (path state changes with their reasons,
 * hedges, retries, cancels, failures).  The engine keeps up to 1024; older
 * ones are dropped and counted.  Blocks up to timeout_ms (KVL_ERR_TIMEOUT);
 * KVL_ERR_CLOSED once kvl_log_wake was called.  Thread-safe. */
kvl_err kvl_next_log(kvl_agent *agent, uint32_t timeout_ms, kvl_log_record *out);

/* Makes every kvl_next_log return KVL_ERR_CLOSED from now on (before
 * kvl_agent_close, so the thread draining the log can be joined).
 * Thread-safe, does not block. */
void kvl_log_wake(kvl_agent *agent);

/* ---- observation --------------------------------------------------------- */

/* Takes the next inbound notification.  Blocks up to timeout_ms; returns
 * KVL_ERR_TIMEOUT when none came.  Thread-safe. */
kvl_err kvl_next_notification(kvl_agent *agent, uint32_t timeout_ms,
                              kvl_notification *out);

/* What peers' pushes and notifications hold on this agent (share.c bounds
 * each sender's part: docs/security.md). */
typedef struct kvl_inbound_stats {
    uint32_t senders;              /* sender sessions holding state here */
    uint32_t pushes;               /* announced, unended inbound pushes */
    uint32_t tombstones;           /* ended pushes remembered (late copies drained) */
    uint32_t chunks, layers;       /* of the live pushes */
    uint32_t tag_bytes;            /* tags of handles the engine holds */
    uint32_t notifications;        /* queued for kvl_next_notification */
    uint32_t notification_bytes;
    uint32_t queued_handles;       /* waiting for kvl_inbound_next */
    uint64_t refused_pushes;       /* ANNOUNCEs refused: over a sender's share or out of room */
    uint64_t evicted_pushes;       /* pushes dropped to make room (their handles failed) */
    uint64_t refused_notifications; /* NOTIFYs not acknowledged for room (sent again) */
} kvl_inbound_stats;

/* Copies the inbound counters (refreshed every monitor tick) into *out.
 * Thread-safe, does not block. */
kvl_err kvl_inbound_stats_get(kvl_agent *agent, kvl_inbound_stats *out);

/* Copies up to cap path snapshots (refreshed every monitor tick, when a
 * transfer finishes and when a path changes state) into out; *n gets the
 * total.  Thread-safe, does not block. */
kvl_err kvl_paths(kvl_agent *agent, kvl_path_info *out, size_t cap, size_t *n);

/* Waits until what kvl_paths reports differs from generation seen: a path
 * changed state, or a peer's paths came or went (statistics alone do not
 * count); a peer's control connection changing state (kvl_paths does not
 * show it) counts too, so a caller waiting for kvl_peer_refresh to work
 * again wakes when it reconnects.  *gen (the caller's; written before the
 * return, never kept) gets the current generation, never 0: seen = 0
 * returns it at once, so a caller takes *gen, reads kvl_paths, then waits
 * with seen = *gen and misses no change in between.  KVL_OK once it
 * differs, KVL_ERR_TIMEOUT if not within timeout_ms, KVL_ERR_CLOSED once
 * kvl_agent_close began (it wakes every waiter; the agent must outlive the
 * call, as for any call on it).  Blocks (call with the GIL released).
 * Thread-safe. */
kvl_err kvl_paths_wait(kvl_agent *agent, uint64_t seen, uint32_t timeout_ms, uint64_t *gen);

/* ---- transports ----------------------------------------------------------- */

/* Loads UCX's libucp for the UCX transport (docs/ucx.md), once per process:
 * lib is a path to libucp.so.0 (NULL: the loader's search path).  KVL_OK if
 * UCX is usable; else KVL_ERR_SYSTEM and kvl_last_error() says why (kvlink
 * built without UCX headers, library missing, too old); the first attempt
 * decides for the whole process.  Blocks (dlopen); thread-safe. */
kvl_err kvl_ucx_load_lib(const char *lib);

/* The loaded UCX's version ("1.22.0"), "" before a successful load.  The
 * string is static.  Thread-safe. */
const char *kvl_ucx_loaded_version(void);

/* Loads the CUDA runtime for GPU memory (docs/api.md, "GPU memory"): tries
 * libs[0..n) in order (paths or sonames such as "libcudart.so.12"; borrowed
 * for the call; NULL or "" entries are skipped).  KVL_OK once
 * loaded in this process (a later call returns at once); else
 * KVL_ERR_SYSTEM with what was tried and what to install, and a later call
 * tries again.  Nothing needs CUDA before this.  Blocks (dlopen);
 * thread-safe. */
kvl_err kvl_cuda_load_lib(const char *const *libs, size_t n);

/* The PCI bus id ("0000:3b:00.0") of CUDA device `device` into out (len
 * bytes, at least 16; NUL-terminated).  Needs kvl_cuda_load_lib first.
 * Does not block; thread-safe. */
kvl_err kvl_cuda_pci_bus_id(int32_t device, char *out, size_t len);

/* ---- the KV store's local moves (csrc/blockio.c, docs/store.md) ---------- */

/* One file read or write of a batch. */
typedef struct kvl_io {
    int32_t fd;         /* an open file, the caller's; with O_DIRECT, buf, len and offset
                           must be aligned as the file system asks (4096 covers them) */
    int32_t write;      /* 1: write len bytes from buf at offset; 0: read them into buf */
    void *buf;          /* the caller's memory, borrowed until kvl_blockio_run returns */
    uint64_t len;
    uint64_t offset;
    int64_t result;     /* out: len when done in full, else -errno (-EIO: end of file) */
} kvl_io;

typedef struct kvl_blockio kvl_blockio;

/* Opens a file I/O engine: an io_uring of depth entries (1..4096) when kvlink
 * was built with liburing and the kernel allows one, else `threads` (1..64)
 * threads doing pread / pwrite (force_threads 1 chooses them).
 * kvl_blockio_backend says which and why.  *out is the caller's until
 * kvl_blockio_close.  Does not block; thread-safe. */
kvl_err kvl_blockio_open(uint32_t depth, uint32_t threads, int32_t force_threads,
                         kvl_blockio **out);

/* "io_uring (depth N)" or "threads (N; why not io_uring)"; owned by io. */
const char *kvl_blockio_backend(const kvl_blockio *io);

/* Runs ops[0..n) (at most 2^24) and returns when every one has ended: KVL_OK
 * when each moved its len bytes, else KVL_ERR_SYSTEM naming the first that did
 * not (each op's result says how it ended).  No timeout: an I/O the kernel has
 * started cannot be called back, and the buffers are in use until it ends.
 * Short transfers are resumed.  Blocks (call with the GIL released);
 * thread-safe: batches on one io run one after another. */
kvl_err kvl_blockio_run(kvl_blockio *io, kvl_io *ops, size_t n);

/* Waits for nothing (no batch may be running) and frees io.  NULL is a no-op. */
void kvl_blockio_close(kvl_blockio *io);

/* One memory copy of a batch. */
typedef struct kvl_copy {
    void *dst;
    const void *src;
    uint64_t len;
} kvl_copy;

/* memcpy of every op in order (a store block into an engine's pages: one op
 * per layer and block).  The caller guarantees the ranges are valid and that
 * no op's dst overlaps its src.  Blocks for the copy; thread-safe. */
void kvl_copy_batch(const kvl_copy *ops, size_t n);

/* kvl_copy_batch that also checksums what it copies, in one pass over the source: for each
 * op i in order, crcs[block[i]] = crc32c(crcs[block[i]], src, len) continued (start the
 * states at 0).  A block's pieces must come in payload order (they may interleave with
 * other blocks': layer by layer over many blocks).  KVL_ERR_INVALID_ARG, before any copy,
 * when a block index is >= n_crcs.  Blocks for the copy; thread-safe. */
kvl_err kvl_copy_crc_batch(const kvl_copy *ops, const uint32_t *block, size_t n, uint32_t *crcs,
                           size_t n_crcs);

/* A read-only span of memory. */
typedef struct kvl_span {
    const void *p;
    uint64_t len;
} kvl_span;

/* crc32c over spans[0..n) in order, continuing from crc (0 to start): the
 * checksum of a block scattered over an engine's layers.  Thread-safe. */
uint32_t kvl_crc32c_spans(uint32_t crc, const kvl_span *spans, size_t n);

/* ---- benchmarks ----------------------------------------------------------- */

/* What kvl_bench_tcp_move measured. */
typedef struct kvl_bench_tcp_result {
    uint64_t wall_ns;      /* the first thread's start to the last one's end */
    uint64_t cpu_ns;       /* user + system time of the moving threads, summed */
    uint64_t bytes;        /* bytes moved: len */
} kvl_bench_tcp_result;

/* The plain-TCP baseline of `kvlink-bench tcp-limit` (csrc/bench_tcp.c):
 * moves [buf, buf+len) over the n connected blocking sockets fds[0..n),
 * slice i (len/n bytes; the last one takes the rest) over fds[i], one thread
 * per socket, with plain send or recv: no framing, no checksum.  send_side 1
 * sends, then waits for one byte back on each socket (the receiver has all
 * of it); 0 receives, then sends that byte.  A socket that moves nothing for
 * timeout_ms fails the call (KVL_ERR_SYSTEM); a peer that closes early,
 * KVL_ERR_CONN_LOST.  fds stay the caller's and open (their SO_RCVTIMEO and
 * SO_SNDTIMEO set to timeout_ms); buf is borrowed for the call.  Blocks until
 * every slice moved or one failed; thread-safe. */
kvl_err kvl_bench_tcp_move(const int *fds, uint32_t n, void *buf, uint64_t len, int send_side,
                           uint32_t timeout_ms, kvl_bench_tcp_result *out);

#ifdef __cplusplus
}
#endif
#endif /* KVLINK_H */
