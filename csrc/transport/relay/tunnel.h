/* tunnel.h: the two threads that carry one sealed connection between the
 * stream's plaintext socket and the network (tunnel.c). */
#ifndef KVLINK_RELAY_TUNNEL_H
#define KVLINK_RELAY_TUNNEL_H

#include "aead.h"

/* The largest plaintext of one record. */
#define KVL_TUNNEL_RECORD (256u << 10)

typedef struct kvl_tunnel kvl_tunnel;

/* Starts a tunnel: what the stream writes to its end of plain_fd's pair is
 * sealed (out) and sent on outer_fd; records arriving on outer_fd are opened
 * (in) and written to plain_fd.  Takes plain_fd, outer_fd, out and in, also
 * on failure.  what names the connection in log records.  The tunnel holds
 * two references (its threads); the caller gets a third (kvl_tunnel_release).
 * Either side ending, a record failing to open, or a write failing ends both
 * sockets; the descriptors close when the last reference goes. */
kvl_err kvl_tunnel_start(kvl_agent *a, int plain_fd, int outer_fd, kvl_aead *out, kvl_aead *in,
                         const char *what, kvl_tunnel **t);
/* The network socket (valid until the last reference goes). */
int kvl_tunnel_outer_fd(const kvl_tunnel *t);
/* Drops one reference; the last closes both sockets and frees t. */
void kvl_tunnel_release(void *t);
/* The caller's release: ends both directions at once (a pump blocked on a
 * network that stopped moving returns), then drops the caller's reference. */
void kvl_tunnel_close(void *t);

#endif
