/* ucx.h: one path's UCX end (docs/ucx.md), over libucp loaded at run time.
 *
 * A kvl_ucx_worker is one UCP context + one worker restricted to one network
 * device: the local end of one kvlink path.  A kvl_ucx_ep connects it to the
 * peer worker of the same path; a kvl_ucx_mem is a region mapped in the
 * worker's context (its packed key goes to the peer); a kvl_ucx_rkey is a
 * peer's key unpacked on an endpoint, with the bounds of the region it names.
 *
 * Threads: libucp is loaded once per process (kvl_ucx_load, any thread).
 * Everything else on one worker (and its endpoints, maps and keys) runs on one
 * thread at a time: the engine thread in the product (UCS_THREAD_MODE_SINGLE).
 *
 * Completion: puts are posted with kvl_ucx_put; kvl_ucx_flush_start returns a
 * sequence number s; once kvl_ucx_flushed(ep) >= s, every put posted before
 * the flush is placed in the peer's memory (ucp_ep_flush_nbx's remote
 * completion).  Nothing here says "verified": the core still checks the
 * crc32c over the placed bytes at the receiver (docs/ucx.md).
 *
 * Built without UCX headers (no -DKVL_HAVE_UCX), every function except
 * kvl_ucx_load fails with KVL_ERR_SYSTEM and kvl_ucx_load says why.
 */
#ifndef KVLINK_UCX_H
#define KVLINK_UCX_H

#include <stddef.h>
#include <stdint.h>

#include "kvlink.h"

/* Largest worker address / packed key kvlink accepts from a peer: both are
 * parsed by libucp, which takes no length, so kvlink bounds them first. */
#define KVL_UCX_ADDR_MAX 4096
#define KVL_UCX_RKEY_MAX 256

typedef struct kvl_ucx_worker kvl_ucx_worker;
typedef struct kvl_ucx_ep kvl_ucx_ep;
typedef struct kvl_ucx_mem kvl_ucx_mem;
typedef struct kvl_ucx_rkey kvl_ucx_rkey;

/* Loads libucp once per process: lib is a path to libucp.so.0 (the wheel's,
 * found by Python) or NULL for the loader's search path.  0 on success; else
 * -1 and why (also on every later call: the first attempt decides).  Any
 * thread; blocks while another thread loads. */
int kvl_ucx_load(const char *lib, char *why, size_t why_len);
/* "1.22.0" once loaded, else "". */
const char *kvl_ucx_version(void);

/* Writes the name of the interface holding IPv4 address ip (dotted quad)
 * into dev; KVL_ERR_INVALID_ARG if no interface has it.  Any thread. */
kvl_err kvl_ucx_netdev_of(const char *ip, char *dev, size_t dev_len);

/* A context + worker whose network transports use only device netdev
 * ("lo", "eth1"), with wakeup support.  opts: NULL or name, value pairs
 * ending in NULL, applied with ucp_config_modify after NET_DEVICES (UCX's
 * names without "UCX_": {"TCP_TX_SEG_SIZE", "1m", NULL}); UCX_* variables
 * of the environment apply first (libucp reads them, the core does not).
 * The caller owns *out (kvl_ucx_worker_destroy).  Blocks (UCX opens its
 * transports). */
kvl_err kvl_ucx_worker_create(const char *netdev, const char *const *opts, kvl_ucx_worker **out);
/* Frees a worker; every endpoint and map of it must be gone. */
void kvl_ucx_worker_destroy(kvl_ucx_worker *w);
/* Copies the worker's address (what the peer's kvl_ucx_ep_create takes)
 * into buf; *len: its size.  KVL_ERR_INVALID_ARG if cap is too small. */
kvl_err kvl_ucx_worker_address(kvl_ucx_worker *w, uint8_t *buf, size_t cap, size_t *len);
/* The fd to watch for readability (epoll) instead of polling. */
int kvl_ucx_worker_fd(const kvl_ucx_worker *w);
/* Runs completions until none is left, then arms the fd: 1 if armed (safe
 * to sleep on the fd), 0 if events arrived meanwhile (call again). */
int kvl_ucx_worker_progress(kvl_ucx_worker *w);

/* Connects to a peer worker from its address (len bytes from the network:
 * 0 < len <= KVL_UCX_ADDR_MAX, else KVL_ERR_PROTOCOL before UCX sees it).
 * Only for an address from an authenticated peer: libucp 1.22 aborts the
 * process on most malformed addresses (docs/ucx.md, ucx-addr-probe), which
 * no bound checked here prevents.  Errors of the peer later show in
 * kvl_ucx_ep_status. */
kvl_err kvl_ucx_ep_create(kvl_ucx_worker *w, const uint8_t *addr, size_t len, kvl_ucx_ep **out);
/* 0 while healthy; else a negative ucs_status_t (and its text in why). */
int kvl_ucx_ep_status(const kvl_ucx_ep *ep, char *why, size_t why_len);
/* Closes ep and frees it once UCX let go (progresses the worker, at most
 * timeout_ms).  force: drop what is in flight at once (the fence of
 * docs/ucx.md: nothing more lands through this endpoint). */
void kvl_ucx_ep_close(kvl_ucx_ep *ep, int force, uint32_t timeout_ms);

/* Maps len bytes at base (host memory) in w's context and packs its remote
 * key into key (cap >= KVL_UCX_RKEY_MAX); *key_len: its size. */
kvl_err kvl_ucx_mem_map(kvl_ucx_worker *w, void *base, uint64_t len, kvl_ucx_mem **out,
                        uint8_t *key, uint32_t *key_len);
/* Unmaps; a peer's puts through its key fail from then on. */
void kvl_ucx_mem_unmap(kvl_ucx_mem *m);

/* Unpacks a peer's key (key_len bytes from the network, bounded as for
 * addresses) for the peer region [base, base + size) on ep.  KVL_ERR_PROTOCOL
 * for a bad length, KVL_ERR_ACCESS_DENIED if libucp refuses the key. */
kvl_err kvl_ucx_rkey_unpack(kvl_ucx_ep *ep, const uint8_t *key, uint32_t key_len, uint64_t base,
                            uint64_t size, kvl_ucx_rkey **out);
void kvl_ucx_rkey_destroy(kvl_ucx_rkey *k);

/* Posts a put of len bytes from src to offset off of k's region; the memory
 * at src must stay until a flush posted after it completed.  Refuses
 * (KVL_ERR_OUT_OF_BOUNDS) a range outside the region before UCX sees it;
 * KVL_ERR_CONN_LOST if the endpoint failed. */
kvl_err kvl_ucx_put(kvl_ucx_ep *ep, const void *src, size_t len, kvl_ucx_rkey *k, uint64_t off);
/* Starts a flush of everything posted on ep so far; *seq: its number. */
kvl_err kvl_ucx_flush_start(kvl_ucx_ep *ep, uint64_t *seq);
/* The highest flush number that completed (0: none yet). */
uint64_t kvl_ucx_flushed(const kvl_ucx_ep *ep);
/* Puts posted and not yet completed locally. */
uint64_t kvl_ucx_inflight(const kvl_ucx_ep *ep);

#endif
