/* tcp.h: the TCP transport's own declarations (tcp.c: sockets; stream.c: the
 * endpoint's byte stream).  Nothing outside csrc/transport/tcp/ includes it. */
#ifndef KVLINK_TCP_H
#define KVLINK_TCP_H

#include "../../internal.h"

struct kvl_out;

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
    int epout;             /* EPOLLOUT requested */
    int got_frame;         /* a valid header arrived (the version was right) */
    /* send */
    struct kvl_out *sq, *sq_tail;
    size_t sq_len;         /* frames in sq */
    size_t sq_bytes;       /* their heads (header + body): what queued frames cost us */
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
    int dst_idx;           /* cursor in the core's sink */
    size_t dst_off;
    uint64_t pay_got;
    uint32_t crc;
    uint8_t trailer[4];
    size_t trailer_got;
    int lowat;             /* SO_RCVLOWAT in force (0 = the kernel's default of 1) */
    int lowat_max;         /* its ceiling for the payload in progress */
};

kvl_ep *kvl_tcp_ep_new(kvl_agent *a, int fd, int listener);
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
