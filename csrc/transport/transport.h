/* transport.h: what the core needs from a transport, and what it offers back.
 *
 * A path is one *stream* plus, optionally, one *mover*:
 *  - the stream (transport/tcp/) carries every frame of a connection
 *    (docs/wire-protocol.md); by default the payload of a chunk frame goes
 *    in the stream, right behind its header and body;
 *  - a mover (transport/shm/, transport/ucx/, tests' transport/fault/)
 *    places payloads out of band: the receiver copies them from the
 *    sender's memory (shm), or the sender puts them into the receiver's
 *    (ucx).  The stream then carries header, body, a *cover* (bytes only
 *    the mover reads) and the crc32c trailer: header flag OOB.
 * The core sees endpoints (kvl_ep) and movers (kvl_mover) as opaque
 * pointers and decides by the capability bits below, never by a name.
 * Transports register by name (registry.c); a new transport is one folder
 * and one line there.  Nothing in a transport folder includes another
 * folder; a mover reaches its stream only through the stream ops and the
 * kvl_stream_* services at the end of this file.
 *
 * Rules every transport keeps (the engine's correctness rests on them):
 *  - A chunk is done only when its bytes are verified at the destination:
 *    the receiver checks the crc32c trailer over the bytes as placed (for
 *    a one-sided mover, after the trailer came: the sender sends it only
 *    once its puts are complete) and answers ACK.
 *  - Duplicate copies: the receiver's ownership table (inbound.c) decides
 *    which copy may place bytes.  A mover whose writes land without the
 *    receiver's CPU cannot drain a late copy, so the core never hedges a
 *    chunk onto or off such a path (KVL_MV_NO_HEDGE), and the stream waits
 *    out (or fences) its posted writes before it lets go of a cancelled
 *    copy's memory (architecture.md, "Duplicate copies on a one-sided
 *    transport").  In-stream, cancel drops an unstarted frame and finishes
 *    a started one from zeros with a trailer that cannot verify.
 *  - Every endpoint op runs on the engine thread, except connect, send_all,
 *    recv_all and discard on a detached endpoint (add_peer's helper threads
 *    and the prober) and a mover's start, which runs there too.  A stream
 *    may move bytes on threads of its own (TCP with io_threads: iopool.c);
 *    the core's upcalls still arrive on the engine thread only.
 *  - Revocation is synchronous: when another copy of a chunk takes over its
 *    destination, or the receiver's handle of a push is about to report a
 *    failure, the core calls revoke() on every endpoint still placing that
 *    chunk; once it returns, no byte of that payload lands any more.
 */
#ifndef KVLINK_TRANSPORT_H
#define KVLINK_TRANSPORT_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/uio.h>

#include "../wire.h"

typedef struct kvl_agent kvl_agent;
typedef struct kvl_ep kvl_ep;         /* a stream's side of one connection */
typedef struct kvl_conn kvl_conn;     /* the core's side (proto.c) */
typedef struct kvl_mover kvl_mover;   /* a mover's side of one path */
typedef struct kvl_mover_ops kvl_mover_ops;
struct kvl_xfer;
struct kvl_region;

/* What the monitor reads of a path, every tick. */
typedef struct kvl_tp_sample {
    double rtt_us;
    double delivery_Bps;        /* the latest delivery-rate sample */
    int app_limited;            /* ... limited by us, not the path */
    uint64_t bytes_acked;       /* cumulative bytes the peer acknowledged */
    uint64_t bytes_received;    /* cumulative bytes received */
    uint32_t last_ack_recv_ms;  /* since the last acknowledgement arrived */
    uint32_t last_data_recv_ms; /* since the last data arrived */
} kvl_tp_sample;

/* What an outgoing frame holds on to until it has left or is dropped; the
 * transport hands it back through kvl_proto_release. */
typedef struct kvl_tp_hold {
    struct kvl_xfer *xfer;        /* DATA: the transfer whose memory it reads (an io_ref) */
    struct kvl_region **refs;     /* READ_RESP: regions it reads, referenced */
    int nrefs;
} kvl_tp_hold;

/* One frame to send.  send() takes over head, payload (the iovec array,
 * not the memory it points to), dst and hold, also when it fails. */
typedef struct kvl_tp_frame {
    kvl_buf head;                 /* header + body, finished */
    struct iovec *payload;        /* payload_len bytes of registered memory, or NULL */
    int n_payload;
    uint64_t payload_len;
    int is_chunk;                 /* DATA or READ_REQ: the copy below, for cancel() */
    uint64_t xid;
    uint32_t chunk, attempt;
    kvl_tp_hold hold;
    /* DATA / READ_RESP on a path whose mover is one-sided: where the
     * payload goes in the peer's regions, in payload order (n_dst pieces
     * summing to payload_len; owned by the frame, freed with it); else
     * NULL. */
    kvl_wire_piece *dst;
    uint32_t n_dst;
    /* KVL_STAGE_*: the payload's memory is not the stream's to read (GPU
     * memory, or host memory under stage_host_memory): the stream copies
     * it into host memory (kvl_stage_gather) right before the payload
     * starts, and sends from there.  A one-sided mover then puts from that
     * slot (kept until the frame has left, which waits for the writes); a
     * receiver-pulled one never gets such a frame (the receiver would read
     * the slot after it was given back) unless it has KVL_MV_GPU_MEM. */
    int stage;
} kvl_tp_frame;

/* A connected socket another transport hands the stream to carry (a
 * relayed connection: the plaintext end of its tunnel, transport/relay/). */
typedef struct kvl_tp_wrap {
    int sample_fd;                /* TCP_INFO comes from this socket (the network one) */
    struct sockaddr_storage local, peer; /* what addrs() reports */
    void (*release)(void *arg);   /* once, when the endpoint is freed (or not made) */
    void *arg;
    char note[96];                /* what carries the path, for paths() */
} kvl_tp_wrap;

/* ------------------------------------------------------------------ */
/* Streams                                                             */
/* ------------------------------------------------------------------ */

typedef struct kvl_stream_ops {
    const char *name; /* "tcp": what paths() shows when no mover carries the payloads */
    /* Listens on host:*port (0: ephemeral, the bound port written back) and
     * takes the listener into the engine's event loop.  Caller thread,
     * before the engine runs. */
    kvl_err (*listen)(kvl_agent *a, const char *host, uint16_t *port, kvl_ep **out);
    /* Connects from local to host:port within timeout_ms.  The endpoint is
     * detached (not in the event loop) and blocking, for the handshake.
     * Blocks; any thread. */
    kvl_err (*connect)(kvl_agent *a, const char *local, const char *host, uint16_t port,
                       uint32_t timeout_ms, kvl_ep **out);
    /* Blocking I/O on a detached endpoint, up to a CLOCK_MONOTONIC deadline. */
    kvl_err (*send_all)(kvl_ep *ep, const void *buf, size_t len, uint64_t deadline_ns);
    kvl_err (*recv_all)(kvl_ep *ep, void *buf, size_t len, uint64_t deadline_ns);
    /* Frees a detached endpoint (and its mover).  Any thread. */
    void (*discard)(kvl_ep *ep);
    /* Engine thread: takes a detached endpoint into the event loop for c
     * (and its mover: kvl_mover_ops.attach). */
    kvl_err (*attach)(kvl_ep *ep, kvl_conn *c);
    /* Engine thread: the event loop says ep is ready (EPOLL* bits). */
    void (*on_event)(kvl_ep *ep, uint32_t events);
    /* Queues a frame (see kvl_tp_frame); 0, or -1 if the endpoint is dead
     * or out of memory (the frame is released either way).  A chunk frame
     * goes by ep's mover when the mover covers it (header flag OOB). */
    int (*send)(kvl_ep *ep, kvl_tp_frame *f);
    /* Cancels the queued copy (xid, chunk, attempt) without disturbing the
     * connection; 1 if found.  Its memory is let go of at once (after a
     * mover's writes that read it are complete or fenced). */
    int (*cancel)(kvl_ep *ep, uint64_t xid, uint32_t chunk, uint32_t attempt);
    /* close(): drops chunk frames not yet started. */
    void (*drop_unstarted)(kvl_ep *ep);
    /* 1 while frames wait to go out. */
    int (*has_output)(const kvl_ep *ep);
    /* Frames queued and not yet fully sent; *bytes: the memory they hold
     * (header, body, payload and destination arrays, references). */
    size_t (*queued)(const kvl_ep *ep, size_t *bytes);
    /* When the last byte of a frame that has started arriving came in
     * (CLOCK_MONOTONIC ns; bytes the kernel holds for us count); 0 between
     * frames.  A frame body past its deadline fails ep here (on_error). */
    uint64_t (*rx_partial_since)(kvl_ep *ep, uint64_t now);
    /* Stops reading ep; it closes once its queued frames have left. */
    void (*refuse)(kvl_ep *ep);
    /* Takes a connected socket fd (any family) as a detached, blocking
     * endpoint, as connect() returns one; w describes it (copied).  On
     * failure fd is closed and w->release called.  Any thread. */
    kvl_err (*adopt)(kvl_agent *a, int fd, const kvl_tp_wrap *w, kvl_ep **out);
    /* Engine thread: takes fd as a connection a listener accepted (as
     * adopt, but straight into the event loop and kvl_proto_accepted). */
    void (*accept_fd)(kvl_agent *a, int fd, const kvl_tp_wrap *w);
    /* Engine thread, every monitor tick, for each listener: a listener that
     * stopped accepting after an error (out of kernel memory, ...) resumes. */
    void (*tick)(kvl_ep *listener, uint64_t now);
    /* The path's state as the stream (and its mover) see it; -1 if
     * unavailable. */
    int (*sample)(const kvl_ep *ep, kvl_tp_sample *out);
    /* Payload bytes sent / received over ep, however they travelled. */
    uint64_t (*bytes_sent)(const kvl_ep *ep);
    uint64_t (*bytes_recv)(const kvl_ep *ep);
    /* Of those, bytes a one-sided mover placed: sent (writes complete) and
     * received (an OOB frame's trailer came).  Engine thread. */
    uint64_t (*bytes_put)(const kvl_ep *ep);
    /* Closes ep (abortive: drop what is queued both ways at once) and
     * releases its queued frames, after its mover's writes are over.  ep
     * stays allocated until free(). */
    void (*close)(kvl_ep *ep, int abortive);
    void (*free)(kvl_ep *ep);
    /* Starts the stream's own I/O threads (cfg.io_threads; 0: none),
     * before the engine runs; stop() after every endpoint is freed. */
    kvl_err (*start)(kvl_agent *a, uint32_t io_threads);
    void (*stop)(kvl_agent *a);
    /* Engine thread, after every wakeup: hands the core what the I/O
     * threads finished (on_payload, release, on_error, as on_event would). */
    void (*progress)(kvl_agent *a);
    /* The payload arriving on ep may be placed no more: drain the rest.
     * Returns once no thread writes its destination. */
    void (*revoke)(kvl_ep *ep);
    /* ---- what a mover asks of its stream ---- */
    /* ep's mover from now on (the stream frees the previous one): ops and
     * m, or m NULL when ops was wanted but does not carry this path, with
     * why_not saying why (for paths()).  A detached endpoint, or the
     * engine thread. */
    void (*set_mover)(kvl_ep *ep, const kvl_mover_ops *ops, kvl_mover *m,
                      const char *why_not);
    /* ep's mover, or NULL (and *m NULL) when its payloads go in-stream. */
    const kvl_mover_ops *(*mover)(const kvl_ep *ep, kvl_mover **m);
    /* What carries ep's payloads and why (the mover's note, or why no mover
     * does: "" when none was wanted); 1 if a mover carries them. */
    int (*note)(const kvl_ep *ep, char *out, size_t len);
    /* The connection's own and its peer's addresses. */
    int (*addrs)(const kvl_ep *ep, struct sockaddr_storage *local,
                 struct sockaddr_storage *peer);
    /* Engine thread: watches fd for readiness on ep's behalf (a mover's
     * event source); on an event fn(arg) runs, then ep goes on with a frame
     * that waited for its mover.  unwatch_fd before fd closes. */
    int (*watch_fd)(kvl_ep *ep, int fd, void (*fn)(void *arg), void *arg);
    void (*unwatch_fd)(kvl_ep *ep, int fd);
    /* Engine thread: ep's mover failed or fenced itself: the connection
     * fails from the event loop with why (not from inside the caller). */
    void (*mover_failed)(kvl_ep *ep, const char *why);
} kvl_stream_ops;

/* ------------------------------------------------------------------ */
/* Movers                                                              */
/* ------------------------------------------------------------------ */

/* Capability bits (kvl_mover_ops.caps): what the core and the stream read. */
enum {
    /* The sender places the bytes (a put into the receiver's memory); the
     * frame's cover is empty and its trailer goes once the writes are
     * complete; the receiver checks the crc over its memory then.  Frames
     * carry their destination (kvl_tp_frame.dst, READ_REQ header flag DST). */
    KVL_MV_ONE_SIDED = 1,
    /* The receiver copies the bytes from the sender's memory after the frame
     * has left: the sender holds that memory until the chunk's ACK (or the
     * close) and the receiver pulls in batches (pull / skip). */
    KVL_MV_RECEIVER_PULLED = 2,
    /* Never two copies of one chunk where one goes over this mover's path. */
    KVL_MV_NO_HEDGE = 4,
    /* Moves device memory; without it staged frames stay in-stream. */
    KVL_MV_GPU_MEM = 8,
    /* Only between agents on one host (one boot, PID and network namespace). */
    KVL_MV_SAME_HOST = 16,
    /* A set-up exchange follows HELLO_ACK (MOVER_OFFER, answered ACCEPT or
     * REFUSE). */
    KVL_MV_OFFER = 32,
    /* Set up only between agents that proved the cluster secret (UCX: libucp
     * parses a peer's worker address unchecked). */
    KVL_MV_SECRET = 256,
    /* Maps this agent's regions: told when they change (sync). */
    KVL_MV_MAPS_REGIONS = 64,
    /* A path whose connection died while this mover carried it runs
     * in-stream for KVL_MOVER_FALLBACK_MS before it offers the mover again. */
    KVL_MV_FALLS_BACK = 128,
    /* Runs only where Config.transport names it (never by "auto"). */
    KVL_MV_ASKED = 512,
};

/* How long a path whose mover's connection died runs in-stream. */
#define KVL_MOVER_FALLBACK_MS 60000u

/* One payload a mover takes on the send side.  The stream owns it; the
 * mover fills crc, cover and ticket. */
typedef struct kvl_mv_send {
    const kvl_tp_frame *f;        /* the frame (payload, dst, stage) */
    const struct iovec *src;      /* what to place: f's payload, or zeros when cancelled */
    int n_src;
    uint32_t crc;                 /* out: crc32c of src, the frame's trailer */
    uint8_t *cover;               /* out: malloc'd cover bytes (freed by the stream), or NULL */
    size_t cover_len;
    uint64_t ticket;              /* out: names the writes for ready / wait */
} kvl_mv_send;

struct kvl_mover_ops {
    const char *name; /* "shm", "ucx": what paths() shows */
    const char *label; /* for messages and notes: "shm", "UCX" */
    const char *what; /* for messages: "same-host copies", "UCX puts" */
    uint32_t kind;    /* KVL_MOVER_*: its bit in HELLO and MOVER_* bodies */
    uint32_t caps;    /* KVL_MV_* */
    /* Caller thread, at Agent() (cfg: the whole configuration): KVL_OK if
     * this agent can run the mover, else an error a person can act on. */
    kvl_err (*usable)(const kvl_config *cfg, uint32_t secret_len);
    /* ---- set-up ---- */
    /* Initiator, on a detached data endpoint right after its handshake
     * (add_peer's helper threads, the prober; blocks up to deadline_ns):
     * sets the mover up and writes it to *out, or leaves *out NULL with
     * note saying why (the path runs in-stream).  Movers with KVL_MV_OFFER
     * send MOVER_OFFER and read the answer here.  An error only when the
     * connection itself failed or the peer broke the protocol. */
    kvl_err (*start)(kvl_agent *a, kvl_ep *ep, const char *local, uint64_t deadline_ns,
                     kvl_mover **out, char *note, size_t note_len);
    /* Listener, engine thread, when the HELLO named this mover (movers
     * without KVL_MV_OFFER): agrees (0, *out set) or refuses the whole
     * connection (-1, with the reason in kvl_last_error()). */
    int (*agree)(kvl_agent *a, kvl_ep *ep, kvl_mover **out);
    /* Listener, engine thread: a MOVER_OFFER body (after its kind byte)
     * arrived on an accepted data endpoint (proven: the peer proved the
     * secret).  Answers on ep (MOVER_ACCEPT or MOVER_REFUSE) and sets the
     * mover on ep when it accepts.  1 accepted, 0 refused, -1 ep failed. */
    int (*answer)(kvl_agent *a, kvl_ep *ep, const uint8_t *body, size_t len, int proven);
    /* Engine thread, when the core takes an outbound data endpoint over
     * (regions: the peer's table, n entries, borrowed): checks what the mover
     * learnt of the peer's regions against it.  0 keeps the mover; -1 drops
     * it (the caller calls set_mover(ep, NULL, NULL); note says why). */
    int (*check)(kvl_mover *m, const kvl_region_info *regions, size_t n, char *note,
                 size_t note_len);
    /* Engine thread: the agent's regions changed (KVL_MV_MAPS_REGIONS). */
    void (*sync)(kvl_mover *m);
    /* Engine thread: a MOVER_KEYS body (after its kind byte) arrived.  0, or
     * -1 with the reason (kvl_last_error) when the peer broke the protocol. */
    int (*keys)(kvl_mover *m, const uint8_t *body, size_t len);
    /* What carries the payloads and why, for paths(). */
    void (*note)(const kvl_mover *m, char *out, size_t len);
    /* Engine thread, when its endpoint joins the event loop: 0, or -1 when
     * the mover cannot run there (the stream drops it: in-stream). */
    int (*attach)(kvl_mover *m, kvl_ep *ep);
    /* Adds what the mover knows to the stream's sample (progress of writes
     * the stream does not see). */
    void (*sample)(const kvl_mover *m, kvl_tp_sample *out);
    /* ---- send side (engine thread, or an I/O thread for movers without
     *      KVL_MV_ONE_SIDED: those ops are then pure functions of s) ---- */
    /* 1 if the mover takes f's payload (else it goes in-stream). */
    int (*covers)(const kvl_mover *m, const kvl_tp_frame *f);
    /* Starts placing s->src (once per frame, after its header went): fills
     * s->crc, s->cover and s->ticket.  An error makes the connection fail. */
    kvl_err (*post)(kvl_mover *m, kvl_mv_send *s);
    /* 1 once the writes of ticket are complete (the trailer may go), 0
     * while not (the mover's event source wakes the stream), -1 if the
     * mover failed (why). */
    int (*ready)(kvl_mover *m, uint64_t ticket, char *why, size_t why_len);
    /* Engine thread: waits until ticket's writes are complete or deadline_ns:
     * 1 done, 0 timed out, -1 failed (a cancelled copy's memory waits on it). */
    int (*wait)(kvl_mover *m, uint64_t ticket, uint64_t deadline_ns);
    /* Engine thread: a pull whose peer may be placing into our memory was
     * cancelled: after this returns nothing more lands through the mover;
     * the stream then fails the connection. */
    void (*fence)(kvl_mover *m, const char *why);
    /* ---- receive side (KVL_MV_RECEIVER_PULLED; an I/O thread or the
     *      engine, one frame at a time per mover) ---- */
    /* An OOB frame's cover arrived (len <= KVL_MAX_COVER): checks it against
     * payload_len and the peer's identity.  KVL_OK, or KVL_ERR_PROTOCOL
     * with the reason (the connection fails). */
    kvl_err (*rx_begin)(kvl_mover *m, const uint8_t *cover, size_t len, uint64_t payload_len);
    /* Copies the next bytes into v[0..n): bytes copied, or -1 with errno
     * (EFAULT: the source is gone: the copy cannot verify; others fail the
     * connection). */
    ssize_t (*pull)(kvl_mover *m, const struct iovec *v, int n);
    /* Moves the source cursor len bytes on without copying (a drained copy). */
    void (*skip)(kvl_mover *m, size_t len);
    /* For messages: what the pull is ("same-host copy from the peer's memory"). */
    const char *pull_what;
    /* ---- lifecycle ---- */
    /* Engine thread (or the thread that holds a detached endpoint):
     * nothing more lands or is read through m (bounded by timeout_ms);
     * then frees it. */
    void (*free)(kvl_mover *m, uint32_t timeout_ms);
};

/* ---- the registry (registry.c) ---- */

/* The stream every path runs on (TCP, the one stream today). */
const kvl_stream_ops *kvl_stream_default(void);
/* The mover of that kind, or NULL. */
const kvl_mover_ops *kvl_mover_by_kind(uint32_t kind);
/* The mover a data path to a peer uses, from this agent's
 * Config.transport, whether the peer runs on this host and whether the
 * path runs in-stream for now (fallen back): NULL for none. */
const kvl_mover_ops *kvl_mover_choose(const kvl_config *cfg, uint32_t secret_len, int same_host,
                                      int fallen_back);
/* Whether this agent agrees to a mover a peer's HELLO names: KVL_OK, or an
 * error with a message naming the agents (cfg: ours). */
kvl_err kvl_mover_allowed(const kvl_config *cfg, const kvl_mover_ops *ops, const char *agent,
                          const char *peer);
/* The KVL_MV_* bits of every mover cfg.transport may use, ORed. */
uint32_t kvl_movers_caps(const kvl_config *cfg);
/* Checks cfg.transport at Agent(): every mover it may use is usable. */
kvl_err kvl_movers_usable(const kvl_config *cfg, uint32_t secret_len);

/* ---- relays (transport/relay/) ---- */

/* The relay transport: relayed paths end to end, and the relay itself. */
typedef struct kvl_relay_ops {
    /* Initiator (detached, blocking up to timeout_ms): a connection to
     * host:port through the relay at via:via_port from local, sealed under
     * the peer's end-to-end key (key_len 32); the endpoint as connect()
     * returns one, its handshake still to run (inside the seal). */
    kvl_err (*connect)(kvl_agent *a, const char *local, const char *via, uint16_t via_port,
                       const char *host, uint16_t port, const uint8_t *key, size_t key_len,
                       uint32_t timeout_ms, kvl_ep **out);
    /* Caller thread, at Agent() after the listeners: the sealed listeners
     * (cfg.sealed_listen) and the relay (cfg.relay).  stop() undoes it
     * before the engine stops; safe after a failed start. */
    kvl_err (*start)(kvl_agent *a);
    void (*stop)(kvl_agent *a);
    /* Any thread. */
    void (*info)(kvl_agent *a, kvl_relay_info *out);
} kvl_relay_ops;

const kvl_relay_ops *kvl_relay(void);

/* ---- what the core offers a transport (proto.c, engine.c) ---- */

/* A listener accepted ep: the core's connection for it, or NULL (then the
 * transport closes it). */
kvl_conn *kvl_proto_accepted(kvl_agent *a, kvl_ep *ep);
/* The largest body the core takes on c now: small until the handshake is
 * over.  The transport refuses a header announcing more (on_error). */
uint32_t kvl_proto_max_body(const kvl_conn *c);
/* A frame's header (decoded and bounds-checked: kvl_hdr_decode) and body
 * arrived.  For a frame with a payload the core has set the sink before it
 * returns.  The core may close the connection from here. */
void kvl_proto_on_frame(kvl_conn *c, const kvl_frame_hdr *h, const uint8_t *body);
/* The first header of a connection speaks another protocol version: the
 * core answers why and refuses the connection. */
void kvl_proto_on_version(kvl_conn *c, const char *why);
/* Where the payload in progress goes: n entries; iov_base NULL: drain. */
const struct iovec *kvl_proto_sink(kvl_conn *c, int *n);
/* 0 once the payload in progress may no longer be placed (another copy
 * owns its chunk, or its transfer failed): drain the rest. */
int kvl_proto_payload_live(kvl_conn *c);
/* The payload and its trailer arrived; crc: computed over what was placed. */
void kvl_proto_on_payload(kvl_conn *c, uint32_t crc, uint32_t trailer);
/* The endpoint failed or the peer closed it. */
void kvl_proto_on_error(kvl_conn *c, kvl_err err, const char *why);
/* A frame left or was dropped: let go of what it held. */
void kvl_proto_release(kvl_agent *a, kvl_tp_hold *h);
/* Engine: a buffer to drain payload bytes into (contents meaningless). */
uint8_t *kvl_engine_scratch(kvl_agent *a, size_t *len);
/* Any thread: fd (and w) go to the engine thread's stream->accept_fd; when
 * the agent is closing fd is closed and w->release called instead. */
void kvl_engine_accept(kvl_agent *a, int fd, const kvl_tp_wrap *w);
/* Engine: the event loop.  ptr comes back in on_event's ep. */
int kvl_engine_watch(kvl_agent *a, int fd, void *ptr, uint32_t events);
int kvl_engine_rewatch(kvl_agent *a, int fd, void *ptr, uint32_t events);
void kvl_engine_unwatch(kvl_agent *a, int fd);

#endif
