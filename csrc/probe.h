/* probe.h: re-connecting down paths (probe.c). */
#ifndef KVLINK_PROBE_H_
#define KVLINK_PROBE_H_

#include "base.h"

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
/* peer.c: blocking connect + handshake, shared by add_peer and the prober;
 * *met: the instance that answered when it is not p's (the peer restarted), else 0 */
kvl_err kvl_peer_open_conn(kvl_agent *a, kvl_peer *p, const char *local, const char *host,
                           uint16_t port, int kind, uint16_t path, kvl_ep **ep, uint64_t *met);

#endif
