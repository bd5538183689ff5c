/* cma.h: same-host payloads by cross-memory attach (docs/ucx.md, "Same-host
 * peers").  Between two agents on one host (one boot, PID and network
 * namespace) a DATA or READ_RESP frame with header flag OOB carries no
 * payload bytes: its cover (shm.c, the shm mover) is a descriptor (the sender's
 * pid and where the payload lies in the sender's memory), then the usual
 * crc32c trailer over the source.  The receiver copies the bytes with
 * process_vm_readv(2) straight into the destination the core resolved and
 * checks the trailer against the bytes placed.  The receiver reads, the
 * sender never writes into the receiver: a peer's descriptor can make us
 * read only from the process that owns the connection's other socket
 * (kvl_cma_peer_check), into memory the core already allowed. */
#ifndef KVLINK_SHM_CMA_H
#define KVLINK_SHM_CMA_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/uio.h>

#include "kvlink.h"

#define KVL_CMA_HEAD_BYTES 8 /* u32 pid, u32 number of source ranges */
#define KVL_CMA_RANGE_BYTES 16 /* u64 address, u64 length */

/* Bytes of a descriptor of n ranges. */
size_t kvl_cma_desc_len(uint32_t n);

/* Writes the descriptor of src[0..n) (this process's pid) into out, which
 * holds kvl_cma_desc_len(n) bytes. */
void kvl_cma_desc_encode(uint8_t *out, const struct iovec *src, int n);

/* Decodes a descriptor's head: KVL_ERR_PROTOCOL unless 1 <= n <= max_ranges
 * and pid > 0. */
kvl_err kvl_cma_desc_head(const uint8_t in[KVL_CMA_HEAD_BYTES], uint32_t max_ranges,
                          uint32_t *pid, uint32_t *n);

/* Decodes n ranges (in: n * KVL_CMA_RANGE_BYTES) into out[0..n):
 * KVL_ERR_PROTOCOL unless every length is positive, no range wraps the
 * address space, and the lengths add up to total (the frame's payload). */
kvl_err kvl_cma_desc_ranges(const uint8_t *in, uint32_t n, uint64_t total, struct iovec *out);

/* KVL_OK when process pid owns the socket at the other end of the TCP
 * connection local <-> peer (in this network namespace: /proc/net/tcp names
 * its inode, /proc/<pid>/fd holds it); else KVL_ERR_PROTOCOL naming what
 * failed.  Reads /proc: call once per connection. */
kvl_err kvl_cma_peer_check(const struct sockaddr_storage *local,
                           const struct sockaddr_storage *peer, uint32_t pid);

/* KVL_OK when the socket at the other end of local <-> peer is in this
 * network namespace (on this host: /proc/net/tcp lists it), else
 * KVL_ERR_PROTOCOL saying so.  What a listener asks before it agrees to
 * same-host copies on a connection. */
kvl_err kvl_cma_peer_here(const struct sockaddr_storage *local,
                          const struct sockaddr_storage *peer);

/* Moves the cursor (*ri, *roff) in ranges r[0..nr) forward by len bytes
 * (at most what is left: the cursor stops at the end). */
void kvl_cma_advance(const struct iovec *r, int nr, int *ri, size_t *roff, size_t len);

/* Copies up to max bytes from process pid's ranges r[*ri..nr) (starting
 * *roff into r[*ri]) into local l[0..nl), advancing *ri / *roff.  Returns
 * bytes copied (> 0), or -1 with errno (EFAULT: the sender's memory is
 * gone; EPERM / ESRCH: not allowed / no such process). */
ssize_t kvl_cma_read(uint32_t pid, const struct iovec *l, int nl, const struct iovec *r, int nr,
                     int *ri, size_t *roff);

#endif
