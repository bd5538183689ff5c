/* tcp.h: the TCP stream's own declarations (tcp.c: sockets; stream.c: the
 * endpoint's byte stream and the generic side of movers; iopool.c: I/O
 * threads).  Nothing outside csrc/transport/tcp/ includes it. */
#ifndef KVLINK_TCP_H
#define KVLINK_TCP_H

#include <pthread.h>

#include "../../internal.h"

struct kvl_out;
struct kvl_iothread;

/* The agent's budgets across its TCP connections (stream.c; engine thread
 * only).  Answers: the true memory of frames queued on accepted connections
 * (frame struct, head buffer, payload and dst arrays, region refs, cover),
 * which pause reading from a connection that holds too much (backpressure,
 * never a dropped answer).  Bodies: frame body buffers above each
 * connection's free allowance, taken from one pool; when it is full the
 * body that has been arriving longest is cut.  docs/security.md, "Stream
 * budgets". */
typedef struct kvl_tcp_budget {
    size_t answer_bytes;       /* queued on accepted connections, all of them */
    size_t answer_cap;         /* over it, a connection holding KVL_TCP_ANSWER_FLOOR pauses */
    size_t body_bytes;         /* body buffers in the pool */
    size_t body_cap;           /* the pool's size */
    kvl_ep *body_head, *body_tail; /* connections with a pooled body arriving, oldest first */
    kvl_ep *paused;            /* accepted connections not read for their queued answers */
    uint64_t body_cut;         /* bodies cut for the pool (the oldest one) */
    uint64_t body_late;        /* bodies cut at their deadline */
    uint64_t pauses;           /* times a connection stopped being read for its answers */
    size_t released;           /* answer bytes closed connections let go since the last trim */
    uint64_t t_trim_ns;        /* the last malloc_trim (tcp_tick) */
} kvl_tcp_budget;

/* Where a connection's receive side is (kvl_ep.rs): a frame's parts in order. */
enum { RS_HDR, RS_BODY, RS_COVER, RS_PAYLOAD, RS_TRAILER };

/* One TCP connection (or listener) as a kvlink endpoint. */
struct kvl_ep {
    kvl_agent *a;
    kvl_conn *c;           /* the core's side; NULL while detached */
    int fd;
    int listener;
    int spare;             /* listener: a descriptor held back for EMFILE (accept_all) */
    uint64_t shed, t_shed_log_ns; /* listener: connections shed at the fd limit */
    uint64_t paused_until_ns;  /* listener: not accepting after an error until then */
    int dead;              /* closed: no I/O, waiting to be freed */
    int refused;           /* read no more; close once the queue is out */
    int watched;           /* in the engine's event loop */
    int epout;             /* frames wait to go out (watch()) */
    int got_frame;         /* a valid header arrived (the version was right) */
    /* send */
    struct kvl_out *sq, *sq_tail;
    size_t sq_len;         /* frames in sq */
    size_t sq_bytes;       /* their true memory (out_cost): what queued frames cost us */
    int acct;              /* accepted: in the agent's answer and body budgets */
    int ans_paused;        /* not read until its queued answers drain (answers_check) */
    kvl_ep *pz_prev, *pz_next; /* in the budget's paused list */
    uint64_t t_rx_ns;      /* the last byte received (a partial frame's progress) */
    int inq_seen;          /* bytes the kernel held for us at the last progress check */
    uint64_t tx_payload, rx_payload;
    /* receive */
    int rs;
    uint8_t hdr[KVL_HDR_BYTES];
    size_t hdr_got;
    kvl_frame_hdr h;
    uint8_t *body;
    size_t body_cap, body_got;
    size_t body_pooled;    /* of body_cap, what the agent's body pool lent (0 or body_cap) */
    int body_listed;       /* in the budget's body list (a pooled body arriving) */
    kvl_ep *bl_prev, *bl_next;
    uint64_t body_deadline_ns; /* the frame's header + body are in by then, or it is cut */
    int dst_idx;           /* cursor in the core's sink */
    size_t dst_off;
    uint64_t pay_got;
    uint32_t crc;
    uint8_t trailer[4];
    size_t trailer_got;
    int lowat;             /* SO_RCVLOWAT in force (0 = the kernel's default of 1) */
    int lowat_max;         /* its ceiling for the payload in progress */
    /* events the engine's epoll watches for ep (watch()) */
    uint32_t ev_mask;
    /* I/O thread (iopool.c): payloads go out and come in there; NULL: on
     * the engine thread.  While a job runs the engine leaves ep's fd in
     * that direction, the frame or payload in progress and the fields
     * marked "job" to the I/O thread; jmu is held around every step the
     * I/O thread takes, so the engine takes it to cancel, revoke or kill
     * and knows no syscall or byte placement is under way meanwhile. */
    struct kvl_iothread *io;
    pthread_mutex_t jmu;
    int rx_busy, tx_busy;  /* engine: a job of that direction is out */
    int rx_job, tx_job;    /* jmu: ... and not finished yet */
    int rx_fin, tx_fin;    /* jmu: finished, for the engine to collect */
    int rx_err, tx_err;    /* jmu: errno of a failed job; -1: the peer closed */
    int killed;            /* jmu: the engine closed ep: hands off */
    int live;              /* jmu, rx job: the payload may still be placed */
    struct iovec *sink;    /* rx job: the core's sink, copied at its start */
    int nsink, sink_cap;
    int listed, pins;      /* io->mu: in the thread's list / being served now */
    int done_queued;       /* pool mu: in the finished list */
    kvl_ep *done_next;
    /* the path's mover (transport.h), NULL: every payload in-stream */
    const kvl_mover_ops *mv_ops; /* kept after the mover is gone: what carried the path */
    kvl_mover *mv;
    char mv_note[128];     /* why the mover is gone (paths()), or "" */
    int rx_pull;           /* job: the payload arriving is pulled by the mover */
    int rx_fault;          /* job: its source was gone (EFAULT): the copy cannot verify */
    int rx_put;            /* the payload arriving was put: only its trailer comes */
    uint8_t *cov;          /* the cover arriving: u32 length, then the mover's bytes */
    size_t cov_cap, cov_got, cov_need;
    /* receiver-pulled DATA frames sent, whose memory the receiver may still
     * be copying: held until their ACK arrives or the connection closes */
    struct kvl_oob_held *held;
    size_t nheld, capheld;
    uint64_t put_tx;       /* payload bytes of one-sided frames whose writes completed */
    uint64_t put_rx;       /* payload bytes the peer put here (OOB frames ended) */
    int mv_broken;         /* the mover failed or fenced: fail ep from the event loop */
    char mv_broken_why[160];
    uint32_t oob_reads;    /* READ_REQs with DST sent whose READ_RESP has not ended: the
                              peer's mover may be placing into our memory */
    /* a mover's event sources (watch_fd): pseudo endpoints in the event loop */
    kvl_ep *aux;           /* ep's, in a list (freed with ep) */
    kvl_ep *aux_next;
    kvl_ep *aux_owner;     /* set on a pseudo endpoint: the data endpoint */
    void (*aux_fn)(void *arg); /* NULL once unwatched */
    void *aux_arg;
    /* a socket another transport handed over (adopt / accept_fd: a relayed
     * connection's plaintext end); wrapped 0: a TCP socket of our own */
    int wrapped;
    kvl_tp_wrap wrap;
};

/* ---- I/O threads (iopool.c) ---- */
/* Starts n I/O threads for a (0: none, all I/O on the engine thread). */
kvl_err kvl_tcp_pool_start(kvl_agent *a, uint32_t n);
/* Stops them; every endpoint must be freed first. */
void kvl_tcp_pool_stop(kvl_agent *a);
/* The thread a new data endpoint is served by (round robin), or NULL. */
struct kvl_iothread *kvl_tcp_pool_pick(kvl_agent *a);
/* Engine: hands ep's payload in progress (rx) or its head frame (tx) to its
 * I/O thread; the result comes back through kvl_tcp_pool_next_done. */
void kvl_tcp_job_start(kvl_ep *ep, int tx);
/* Engine: no I/O thread touches ep's fd after this returns. */
void kvl_tcp_job_kill(kvl_ep *ep);
/* Engine: returns once ep's I/O thread holds no pointer to it (ep may
 * then be freed). */
void kvl_tcp_job_forget(kvl_ep *ep);
/* Engine: the next endpoint with a finished job, or NULL. */
kvl_ep *kvl_tcp_pool_next_done(kvl_agent *a);
/* The agent's stream budgets (allocated by kvl_tcp_pool_start, whatever the
 * number of I/O threads); NULL before it and after kvl_tcp_pool_stop. */
kvl_tcp_budget *kvl_tcp_budget_of(kvl_agent *a);
/* Its defaults (stream.c). */
void kvl_tcp_budget_init(kvl_tcp_budget *b);
/* I/O thread, under ep->jmu: one step of ep's jobs (stream.c).  Return 1
 * when the job finished (its *_err set on failure), 0 when the socket
 * would block. */
int kvl_tcp_rx_step(kvl_ep *ep, uint8_t *scratch, size_t scratch_len);
int kvl_tcp_tx_step(kvl_ep *ep);

kvl_ep *kvl_tcp_ep_new(kvl_agent *a, int fd, int listener);
/* Frees ep (closing its descriptors) once its I/O thread let go of it. */
void kvl_tcp_ep_free(kvl_ep *ep);
kvl_err kvl_tcp_listen(kvl_agent *a, const char *host, uint16_t *port, kvl_ep **out);
kvl_err kvl_tcp_connect(kvl_agent *a, const char *local, const char *host, uint16_t port,
                        uint32_t timeout_ms, kvl_ep **out);
kvl_err kvl_tcp_send_all(kvl_ep *ep, const void *buf, size_t len, uint64_t deadline_ns);
kvl_err kvl_tcp_recv_all(kvl_ep *ep, void *buf, size_t len, uint64_t deadline_ns);
/* Data-path socket options (both ends). */
kvl_err kvl_tcp_tune(int fd, int sock_buf);
/* TCP_INFO as a path sample; -1 if unavailable. */
int kvl_tcp_sample(int fd, kvl_tp_sample *out);
/* Makes the next close abortive (RST), discarding queued data. */
void kvl_tcp_abort(int fd);
kvl_err kvl_sock_nonblock(int fd, int on);

#endif
