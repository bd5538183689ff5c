/* cuda.h: the CUDA runtime, loaded at run time (cuda.c). */
#ifndef KVLINK_CUDA_H_
#define KVLINK_CUDA_H_

#include "base.h"

/* ---- cuda.c: the CUDA runtime, loaded at run time (kvl_cuda_load_lib) ---- */
/* 1 once kvl_cuda_load_lib succeeded in this process.  Thread-safe. */
int kvl_cuda_loaded(void);
/* Checks that [p, p+len) is CUDA device (or managed) memory of one device,
 * that device when device >= 0; *actual: its ordinal.  KVL_ERR_INVALID_ARG
 * with the reason otherwise (runtime not loaded, no device, host memory,
 * another device).  Thread-safe, does not block. */
kvl_err kvl_cuda_check_ptr(const void *p, uint64_t len, int32_t device, int32_t *actual);
/* cudaMemcpy(cudaMemcpyDefault): blocks until the copy is issued and, for
 * device->host, done.  The runtime must be loaded.  Any thread. */
kvl_err kvl_cuda_copy(void *dst, const void *src, size_t len);
/* Waits until every copy issued on the legacy default stream is done. */
kvl_err kvl_cuda_sync(void);
/* Pinned host memory (cudaMallocHost), or NULL; freed with kvl_cuda_host_free. */
void *kvl_cuda_host_alloc(size_t len);
void kvl_cuda_host_free(void *p);

#endif
