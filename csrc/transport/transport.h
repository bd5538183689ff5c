/* transport.h: what the core needs from a transport, and what it offers back.
 *
 * A transport carries kvlink frames (docs/wire-protocol.md) over endpoints:
 * one per data path and one per control connection.  The core (proto.c,
 * engine.c, sched.c, monitor.c, peer.c, probe.c) sees endpoints only as
 * kvl_ep pointers and calls the ops below; every socket call of the TCP
 * transport lives in csrc/transport/tcp/.  Included by internal.h.
 *
 * The unit is the frame, and for data the chunk: the core hands a transport
 * a whole chunk frame (header + body + the payload as an iovec over
 * registered memory) naming the copy it carries (transfer id, chunk,
 * attempt), can cancel that copy, and learns when the frame has let go of
 * the memory (kvl_proto_release).  On the receiving side the transport hands
 * the core each frame's header and body; for a payload frame the core says
 * where the bytes go (kvl_proto_sink, checked again before every batch with
 * kvl_proto_payload_live) and gets the payload's crc32c at the end.
 *
 * Rules every transport keeps (the engine's correctness rests on them):
 *  - A chunk is done only when its bytes are verified at the destination:
 *    over TCP the receiver checks the crc32c trailer and answers ACK; a
 *    one-sided transport (KVL_TP_ONE_SIDED) writes, flushes, then sends a
 *    small frame with the chunk's id and crc that the receiver checks
 *    (software crc over the placed bytes) before it answers ACK.
 *  - Duplicate copies: the receiver's ownership table (inbound.c) decides
 *    which copy may place bytes.  A transport whose writes land without the
 *    receiver's CPU cannot drain a late copy, so it must make cancel()
 *    complete or flush every other copy of a chunk before the core reports
 *    that chunk done (architecture.md, "Duplicate copies on a one-sided
 *    transport").  TCP cancels in the stream: an unstarted frame is dropped,
 *    a frame part-way out is finished from zeros with a trailer that cannot
 *    verify.
 *  - Every endpoint op runs on the engine thread, except connect, send_all,
 *    recv_all and discard on a detached endpoint (add_peer's helper threads
 *    and the prober).  A transport may move bytes on threads of its own
 *    (TCP with io_threads: iopool.c); the core's upcalls still arrive on
 *    the engine thread only, from on_event or progress.
 *  - Revocation is synchronous: when another copy of a chunk takes over its
 *    destination, or the receiver's handle of a push is about to report a
 *    failure, the core calls revoke() on every endpoint still placing that
 *    chunk; once it returns, no byte of that payload lands any more (the
 *    rest is drained).
 */
#ifndef KVLINK_TRANSPORT_H
#define KVLINK_TRANSPORT_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

/* Capability bits (kvl_transport_ops.caps). */
enum {
    KVL_TP_ONE_SIDED = 1, /* chunk writes land without the receiver's CPU (RDMA put) */
    KVL_TP_GPU_MEM = 2,   /* can read and write device memory */
    KVL_TP_SW_CRC = 4     /* payload crc32c is computed by the core's software, not offloaded */
};

typedef struct kvl_ep kvl_ep;     /* the transport's side of one connection */
typedef struct kvl_conn kvl_conn; /* the core's side (proto.c) */

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
 * not the memory it points to) and hold, also when it fails. */
typedef struct kvl_tp_frame {
    kvl_buf head;                 /* header + body, finished */
    struct iovec *payload;        /* payload_len bytes of registered memory, or NULL */
    int n_payload;
    uint64_t payload_len;
    int is_chunk;                 /* DATA or READ_REQ: the copy below, for cancel() */
    uint64_t xid;
    uint32_t chunk, attempt;
    kvl_tp_hold hold;
    /* DATA: where the payload goes in the peer's regions, in payload order
     * (n_dst pieces summing to payload_len; owned by the frame, freed with
     * it), for a transport that puts the bytes one-sided; else NULL. */
    kvl_wire_piece *dst;
    uint32_t n_dst;
    /* KVL_STAGE_*: the payload's memory is not the socket's to read (GPU
     * memory, or host memory under stage_host_memory): the transport copies
     * it into host memory (kvl_stage_gather) right before the payload
     * starts, and sends from there. */
    int stage;
} kvl_tp_frame;

typedef struct kvl_transport_ops {
    const char *name;
    uint32_t caps; /* KVL_TP_* */
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
    /* Frees a detached endpoint.  Any thread. */
    void (*discard)(kvl_ep *ep);
    /* Engine thread: takes a detached endpoint into the event loop for c. */
    kvl_err (*attach)(kvl_ep *ep, kvl_conn *c);
    /* Engine thread: the event loop says ep is ready (EPOLL* bits). */
    void (*on_event)(kvl_ep *ep, uint32_t events);
    /* Queues a frame (see kvl_tp_frame); 0, or -1 if the endpoint is dead
     * or out of memory (the frame is released either way). */
    int (*send)(kvl_ep *ep, kvl_tp_frame *f);
    /* Cancels the queued copy (xid, chunk, attempt) without disturbing the
     * connection; 1 if found.  Its memory is let go of at once. */
    int (*cancel)(kvl_ep *ep, uint64_t xid, uint32_t chunk, uint32_t attempt);
    /* close(): drops chunk frames not yet started. */
    void (*drop_unstarted)(kvl_ep *ep);
    /* 1 while frames wait to go out. */
    int (*has_output)(const kvl_ep *ep);
    /* Frames queued and not yet fully sent; *bytes: their headers and bodies. */
    size_t (*queued)(const kvl_ep *ep, size_t *bytes);
    /* When the last byte of a frame that has started arriving came in
     * (CLOCK_MONOTONIC ns; bytes the kernel holds for us count); 0 between
     * frames. */
    uint64_t (*rx_partial_since)(kvl_ep *ep, uint64_t now);
    /* Stops reading ep; it closes once its queued frames have left. */
    void (*refuse)(kvl_ep *ep);
    /* Engine thread, every monitor tick, for each listener: a listener that
     * stopped accepting after an error (out of kernel memory, ...) resumes. */
    void (*tick)(kvl_ep *listener, uint64_t now);
    /* The path's state as the transport sees it; -1 if unavailable. */
    int (*sample)(const kvl_ep *ep, kvl_tp_sample *out);
    /* Payload bytes sent / received over ep. */
    uint64_t (*bytes_sent)(const kvl_ep *ep);
    uint64_t (*bytes_recv)(const kvl_ep *ep);
    /* Payload bytes placed one-sided: sent (a put whose flush completed;
     * part of bytes_sent) and received (a REMOTE frame whose trailer came;
     * part of bytes_recv); 0 without one-sided writes.  Engine thread. */
    uint64_t (*bytes_put)(const kvl_ep *ep);
    /* Closes ep (abortive: drop what is queued both ways at once) and
     * releases its queued frames.  ep stays allocated until free(). */
    void (*close)(kvl_ep *ep, int abortive);
    void (*free)(kvl_ep *ep);
    /* Registers memory with the transport; writes the remote key a peer
     * needs (none for TCP: *rkey_len = 0). */
    kvl_err (*reg_mem)(kvl_agent *a, void *base, uint64_t len, uint32_t mem, uint8_t *rkey,
                       uint32_t *rkey_len);
    /* Starts the transport's own I/O threads (cfg.io_threads; 0: none),
     * before the engine runs; stop() after every endpoint is freed. */
    kvl_err (*start)(kvl_agent *a, uint32_t io_threads);
    void (*stop)(kvl_agent *a);
    /* Engine thread, after every wakeup: hands the core what the I/O
     * threads finished (on_payload, release, on_error, as on_event would). */
    void (*progress)(kvl_agent *a);
    /* The payload arriving on ep may be placed no more: drain the rest.
     * Returns once no thread writes its destination. */
    void (*revoke)(kvl_ep *ep);
    /* One-sided companion of a data endpoint (UCX, docs/ucx.md).  On a
     * detached data endpoint whose HELLO carried KVL_HELLO_UCX, right after
     * its handshake (add_peer's helper threads, the prober): sends the
     * offer and reads the answer, up to deadline_ns.  Whatever the answer,
     * ep stays usable, carrying payloads in-stream unless the set-up
     * succeeded; remote_note says which and why.  Returns an error only
     * when the connection itself failed or the peer broke the protocol
     * (the caller discards ep then).  Blocks; any thread. */
    kvl_err (*remote_offer)(kvl_ep *ep, const char *local, uint64_t deadline_ns);
    /* Engine thread, when the core takes an outbound data endpoint over
     * (the peer's region table is known then; regions: n entries, borrowed
     * for the call): checks the peer's one-sided keys against the table.
     * A key that disagrees with it (size, rights) drops ep's one-sided
     * companion: its payloads go in-stream and remote_note says which key
     * and why.  Returns 1 if ep's payloads still travel one-sided. */
    int (*remote_check)(kvl_ep *ep, const kvl_region_info *regions, size_t n);
    /* Engine thread: the agent's regions changed.  A one-sided ep maps the
     * regions it shows the peer that are new (and tells the peer their keys)
     * and unmaps those deregistered.  Failures leave ep usable (new regions
     * then go in-stream on it). */
    void (*remote_sync)(kvl_ep *ep);
    /* Engine thread: a UCX_KEYS body arrived on a one-sided ep: the peer's
     * keys of regions it registered after the set-up.  0, or -1 with the
     * reason (kvl_last_error) when the peer broke the protocol. */
    int (*remote_keys)(kvl_ep *ep, const uint8_t *body, size_t len);
    /* 1 if ep's payloads travel one-sided; note (len bytes): why, or "". */
    int (*remote_note)(const kvl_ep *ep, char *note, size_t len);
    /* Engine thread: a UCX_OFFER body arrived on an accepted data endpoint
     * (its handshake over, the peer proven when proven is 1).  Answers on
     * ep (UCX_ACCEPT or UCX_REFUSE); 1 if accepted, 0 if refused, -1 if ep
     * failed (the core was told through on_error). */
    int (*remote_answer)(kvl_ep *ep, const uint8_t *body, size_t len, int proven);
    /* Engine thread: ep's peer runs on this host and both ends agreed (HELLO
     * flag CMA): from now on ep sends its payloads as same-host descriptors
     * (header flag CMA, transport/tcp/cma.h) and takes the peer's.  With
     * verify (the listener) it first checks that the peer's socket is on
     * this host: -1 with the reason (kvl_last_error) and nothing enabled if
     * not. */
    int (*cma_enable)(kvl_ep *ep, int verify);
} kvl_transport_ops;

extern const kvl_transport_ops kvl_tcp_ops;

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
/* The payload and its trailer arrived; crc: computed over what was read. */
void kvl_proto_on_payload(kvl_conn *c, uint32_t crc, uint32_t trailer);
/* The endpoint failed or the peer closed it. */
void kvl_proto_on_error(kvl_conn *c, kvl_err err, const char *why);
/* A frame left or was dropped: let go of what it held. */
void kvl_proto_release(kvl_agent *a, kvl_tp_hold *h);
/* Engine: a buffer to drain payload bytes into (contents meaningless). */
uint8_t *kvl_engine_scratch(kvl_agent *a, size_t *len);
/* Engine: the event loop.  ptr comes back in on_event's ep. */
int kvl_engine_watch(kvl_agent *a, int fd, void *ptr, uint32_t events);
int kvl_engine_rewatch(kvl_agent *a, int fd, void *ptr, uint32_t events);
void kvl_engine_unwatch(kvl_agent *a, int fd);

#endif
