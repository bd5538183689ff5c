/* conn.h: a connection as the modules outside conn.c see it (conn.c, handshake.c, place.c, proto.c). */
#ifndef KVLINK_CONN_H_
#define KVLINK_CONN_H_

#include "base.h"

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
/* What conn.c tells the modules above it when a connection closes (engine
 * thread), registered by the agent at create so that conn.c calls none of
 * them by name. */
typedef struct kvl_conn_hooks {
    /* Before the stream closes: let go of what the payload in progress holds
     * (ownership of its chunk, the regions it reads, its transfer). */
    void (*payload_dropped)(kvl_conn *c);
    /* After the stream closed (no I/O thread writes any more): its slot. */
    void (*slot_free)(kvl_conn *c);
    /* An outbound connection of p is gone (path: its index, or -1 for a
     * control connection; was_ctrl: it was p's control connection; why: the
     * reason): notifications move, the path goes down and is re-probed. */
    void (*outbound_lost)(kvl_conn *c, kvl_peer *p, int path, int was_ctrl, const char *why);
} kvl_conn_hooks;
/* place.c's payload_dropped and slot_free hooks. */
void kvl_place_payload_dropped(kvl_conn *c);
void kvl_place_slot_free(kvl_conn *c);
/* The initiator's half of a connection's handshake (handshake.c), on the
 * detached endpoint ep (add_peer's helper threads, the prober; blocks until
 * deadline, CLOCK_MONOTONIC ns): HELLO naming the mover this path wants, the
 * challenge-response when this agent holds a secret, HELLO_ACK checked
 * against p (its name; *instance: the one expected, 0 for any, then the one
 * met, also when it is not the one expected; a control connection's region
 * table copied into p), then the mover's set-up from local.  On an error the
 * caller discards ep. */
kvl_err kvl_handshake_initiate(kvl_agent *a, kvl_peer *p, kvl_ep *ep, int kind, uint16_t path,
                               const char *local, const char *where, uint64_t deadline,
                               uint64_t *instance);
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

#endif
