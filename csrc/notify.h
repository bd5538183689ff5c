/* notify.h: notifications delivered exactly once (notify.c). */
#ifndef KVLINK_NOTIFY_H_
#define KVLINK_NOTIFY_H_

#include "base.h"

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

#endif
