/* dl.h: the libucp functions kvlink calls, resolved at run time (dl.c).
 *
 * Only with -DKVL_HAVE_UCX (UCX's headers found by pkg-config at build
 * time): the pointer types come from UCX's own prototypes, so a signature
 * that changes between releases is a compile error here, not a crash.
 * Nothing links against libucp.
 */
#ifndef KVLINK_UCX_DL_H
#define KVLINK_UCX_DL_H

#ifdef KVL_HAVE_UCX
#include <ucp/api/ucp.h>

/* The oldest libucp accepted at run time: the *_nbx calls and
 * ucp_ep_flush_nbx's remote completion are relied on (1.10+); 1.12 is the
 * oldest tested-by-others floor (Debian 12 ships 1.13). */
#define KVL_UCX_MIN_MAJOR 1
#define KVL_UCX_MIN_MINOR 12

#define KVL_UCX_FNS(X)            \
    X(ucp_get_version)            \
    X(ucp_config_read)            \
    X(ucp_config_modify)          \
    X(ucp_config_release)         \
    X(ucp_init_version)           \
    X(ucp_cleanup)                \
    X(ucp_worker_create)          \
    X(ucp_worker_destroy)         \
    X(ucp_worker_query)           \
    X(ucp_worker_release_address) \
    X(ucp_worker_progress)        \
    X(ucp_worker_get_efd)         \
    X(ucp_worker_arm)             \
    X(ucp_ep_create)              \
    X(ucp_ep_close_nbx)           \
    X(ucp_ep_flush_nbx)           \
    X(ucp_mem_map)                \
    X(ucp_mem_unmap)              \
    X(ucp_rkey_pack)              \
    X(ucp_rkey_buffer_release)    \
    X(ucp_ep_rkey_unpack)         \
    X(ucp_rkey_destroy)           \
    X(ucp_put_nbx)                \
    X(ucp_request_check_status)   \
    X(ucp_request_free)           \
    X(ucs_status_string)

typedef struct kvl_ucx_fns {
#define KVL_UCX_FIELD(name) __typeof__(&name) name;
    KVL_UCX_FNS(KVL_UCX_FIELD)
#undef KVL_UCX_FIELD
} kvl_ucx_fns;

/* Filled by kvl_ucx_load; read only after it returned 0. */
extern kvl_ucx_fns kvl_ucx;
#endif

#endif
