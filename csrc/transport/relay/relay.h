/* relay.h: what the relay folder's files share (relay.c: the two ends of a
 * relayed connection; forward.c: the relay in the middle; sock.c: blocking
 * socket helpers).  Nothing outside csrc/transport/relay/ includes it. */
#ifndef KVLINK_RELAY_H
#define KVLINK_RELAY_H

#include <netinet/in.h>

#include "../../internal.h"

/* The relay hop (docs/wire-protocol.md, "Relayed connections"):
 *  relay -> initiator  "KVR1" nonce_r[16]
 *  initiator -> relay  "KVRQ" target_ip[4] target_port[2] name_len[1] name
 *                      mac[32] = HMAC(secret, "kvlink relay request" | nonce_r | the bytes
 *                      before mac); zeros when the relay runs without a secret
 *  relay -> initiator  status[1] msg_len[1] msg      (status 0: forwarding from now on)
 * then, end to end through the relay, under the listener's e2e key K (its metadata):
 *  listener -> initiator  "KVE1" nonce_b[16]          (the sealed port greets first)
 *  initiator -> listener  "KVE1" nonce_a[16]
 *  listener -> initiator  HMAC(K, "kvlink e2e server" | nonce_a | nonce_b)
 *  initiator -> listener  HMAC(K, "kvlink e2e client" | nonce_a | nonce_b)
 * and sealed records both ways (tunnel.c).  The relay forwards nothing of the
 * initiator's until the target's first bytes were "KVE1" and the initiator's
 * are too (forward.c), and cuts a pair that has not shown both within
 * connect_timeout: what reaches a neighbour's service that is not a kvlink
 * sealed port is nothing at all. */
#define KVL_E2E_KEY 32
#define KVL_RELAY_MAGIC "KVR1"
#define KVL_RELAY_REQ "KVRQ"
#define KVL_E2E_MAGIC "KVE1"
#define KVL_RELAY_NONCE 16
#define KVL_RELAY_REQ_MAX (4 + 4 + 2 + 1 + 63 + 32)
enum {
    KVL_RELAY_OK = 0,
    KVL_RELAY_AUTH = 1,        /* the request's MAC does not verify under the relay's secret */
    KVL_RELAY_BUSY = 2,        /* the NIC is taken back for the relay host's own traffic, or full */
    KVL_RELAY_UNREACHABLE = 3, /* the relay could not connect to the target */
    KVL_RELAY_REFUSED = 4      /* the target is not on a network the relay lends a NIC to */
};

/* ---- sock.c ---- */
/* Blocking TCP connect from local (NULL: any) to ip:port within timeout_ms,
 * data-path options set.  The fd, or -1 with the reason in why. */
int kvl_relay_dial(const char *local, struct sockaddr_in *to, uint32_t timeout_ms, char *why,
                   size_t why_len);
/* Blocking I/O up to a CLOCK_MONOTONIC deadline; stop (may be NULL) set
 * ends the wait early.  0, or -1 (errno: ETIMEDOUT, ECONNRESET, ...). */
int kvl_relay_send(int fd, const void *buf, size_t len, uint64_t deadline_ns);
int kvl_relay_recv(int fd, void *buf, size_t len, uint64_t deadline_ns, atomic_int *stop);
/* Keep-alives and TCP_USER_TIMEOUT on an accepted socket, as dialled ones get. */
void kvl_relay_tune(int fd);
/* 1 at most once a second per *last (refusals a peer can cause are logged
 * rate-limited); any thread. */
int kvl_relay_log_ok(atomic_ullong *last);
/* The /24 of an IPv4 address in network order. */
static inline uint32_t kvl_relay_net24(uint32_t be) { return ntohl(be) >> 8; }

/* ---- forward.c ---- */
typedef struct kvl_forwarder kvl_forwarder;
/* Starts the relay of agent a on cfg.relay_addrs (or every address of a)
 * at cfg.relay_port; ports[i]: the port bound on the i-th. */
kvl_err kvl_forwarder_start(kvl_agent *a, kvl_forwarder **out, uint16_t *ports);
/* Stops it: every relayed connection closes. */
void kvl_forwarder_stop(kvl_forwarder *f);
void kvl_forwarder_stats(kvl_forwarder *f, kvl_relay_info *out);

#endif
