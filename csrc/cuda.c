/* cuda.c: the CUDA runtime, loaded at run time on the first GPU registration.
 *
 * kvlink never links against CUDA and needs no CUDA header to build: the few
 * types and entry points used here are declared below, and libcudart is
 * dlopen()ed from the candidates Python hands over (kvlink/_cuda.py: the
 * nvidia-cuda-runtime-cu12 wheel's lib/ first, then libcudart.so.12 and
 * libcudart.so on the loader's search path).  A failed load is not remembered (a later call tries
 * again); a successful one is kept for the life of the process (the runtime
 * cannot be unloaded safely once it made a context).
 *
 * What it is used for: checking that a registered pointer is device memory
 * of the ordinal the caller named, the device<->host copies of the staging
 * path (staging.c) and the pinned host memory those copies go through, and
 * a device's PCI bus id for paths() (topology).
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

/* The CUDA runtime's ABI, as far as kvlink uses it (cuda_runtime_api.h,
 * CUDA 11 and later: cudaPointerAttributes lost its memoryType field). */
typedef int cu_err;             /* cudaError_t; 0 = cudaSuccess */
typedef void *cu_stream;        /* cudaStream_t; NULL = the legacy default stream */
enum { CU_MEMCPY_DEFAULT = 4 }; /* cudaMemcpyDefault: direction from unified addressing */
enum { CU_MEM_UNREGISTERED = 0, CU_MEM_HOST = 1, CU_MEM_DEVICE = 2, CU_MEM_MANAGED = 3 };
typedef struct cu_ptr_attr {    /* struct cudaPointerAttributes */
    int type;
    int device;
    void *device_pointer;
    void *host_pointer;
} cu_ptr_attr;

static struct {
    cu_err (*cudaMemcpy)(void *, const void *, size_t, int);
    cu_err (*cudaStreamSynchronize)(cu_stream);
    cu_err (*cudaMallocHost)(void **, size_t);
    cu_err (*cudaFreeHost)(void *);
    cu_err (*cudaGetDeviceCount)(int *);
    cu_err (*cudaPointerGetAttributes)(cu_ptr_attr *, const void *);
    cu_err (*cudaDeviceGetPCIBusId)(char *, int, int);
    const char *(*cudaGetErrorString)(cu_err);
} cu;

static pthread_mutex_t load_mu = PTHREAD_MUTEX_INITIALIZER;
static int loaded; /* under load_mu to write; read with __atomic */
static char loaded_from[512];

/* Resolves every entry point from h; 0, or -1 with why set. */
static int resolve(void *h, const char *name, char *why, size_t why_len)
{
#define SYM(fn)                                                                            \
    *(void **)&cu.fn = dlsym(h, #fn);                                                      \
    if (!cu.fn) {                                                                          \
        snprintf(why, why_len, "%s has no symbol %s (not a CUDA runtime?)", name, #fn);    \
        return -1;                                                                         \
    }
    SYM(cudaMemcpy)
    SYM(cudaStreamSynchronize)
    SYM(cudaMallocHost)
    SYM(cudaFreeHost)
    SYM(cudaGetDeviceCount)
    SYM(cudaPointerGetAttributes)
    SYM(cudaDeviceGetPCIBusId)
    SYM(cudaGetErrorString)
#undef SYM
    return 0;
}

kvl_err kvl_cuda_load_lib(const char *const *libs, size_t n)
{
    kvl_clear_error();
    pthread_mutex_lock(&load_mu);
    if (loaded) {
        pthread_mutex_unlock(&load_mu);
        return KVL_OK;
    }
    char tried[1024] = "", why[512] = "";
    for (size_t i = 0; libs && i < n; i++) {
        const char *name = libs[i];
        if (!name || !name[0])
            continue;
        size_t used = strlen(tried);
        snprintf(tried + used, sizeof tried - used, "%s%s", used ? ", " : "", name);
        /* RTLD_LOCAL: our copy's symbols stay out of the global namespace */
        void *h = dlopen(name, RTLD_NOW | RTLD_LOCAL);
        if (!h)
            continue;
        if (resolve(h, name, why, sizeof why) != 0) {
            dlclose(h);
            continue;
        }
        snprintf(loaded_from, sizeof loaded_from, "%s", name);
        __atomic_store_n(&loaded, 1, __ATOMIC_RELEASE); /* h stays open for the process */
        pthread_mutex_unlock(&load_mu);
        return KVL_OK;
    }
    pthread_mutex_unlock(&load_mu);
    return kvl_fail(KVL_ERR_SYSTEM,
                    "GPU memory needs the CUDA runtime (libcudart.so.12): not found (tried %s)%s%s; "
                    "install nvidia-cuda-runtime-cu12 (pip) or the CUDA toolkit, or register "
                    "host memory",
                    tried[0] ? tried : "no candidates", why[0] ? "; " : "", why);
}

int kvl_cuda_loaded(void) { return __atomic_load_n(&loaded, __ATOMIC_ACQUIRE); }

static kvl_err cu_fail(const char *what, cu_err e)
{
    return kvl_fail(KVL_ERR_SYSTEM, "%s failed: CUDA error %d (%s)", what, e,
                    cu.cudaGetErrorString ? cu.cudaGetErrorString(e) : "?");
}

kvl_err kvl_cuda_check_ptr(const void *p, uint64_t len, int32_t device, int32_t *actual)
{
    if (!kvl_cuda_loaded())
        return kvl_fail(KVL_ERR_INVALID_ARG,
                        "register: CUDA memory needs the CUDA runtime, which is not loaded "
                        "(kvl_cuda_load_lib)");
    int count = 0;
    cu_err e = cu.cudaGetDeviceCount(&count);
    if (e || count == 0)
        return kvl_fail(KVL_ERR_INVALID_ARG,
                        "register: the object says its memory is on a CUDA device, but the CUDA "
                        "runtime (%s) sees no device (%s); register host memory",
                        loaded_from, e ? cu.cudaGetErrorString(e) : "0 devices");
    /* room to spare: a later runtime may append fields to the struct it fills */
    union {
        cu_ptr_attr a;
        uint8_t room[256];
    } at[2];
    const void *ends[2] = {p, (const uint8_t *)p + len - 1};
    for (int i = 0; i < 2; i++) {
        memset(&at[i], 0, sizeof at[i]);
        if ((e = cu.cudaPointerGetAttributes(&at[i].a, ends[i])))
            return kvl_fail(KVL_ERR_INVALID_ARG,
                            "register: cudaPointerGetAttributes(%p) failed: %s; is it a live "
                            "device allocation?",
                            ends[i], cu.cudaGetErrorString(e));
        if (at[i].a.type != CU_MEM_DEVICE && at[i].a.type != CU_MEM_MANAGED)
            return kvl_fail(KVL_ERR_INVALID_ARG,
                            "register: %p is not CUDA device memory (the runtime says memory "
                            "type %d); register it as host memory",
                            ends[i], at[i].a.type);
    }
    if (at[0].a.device != at[1].a.device)
        return kvl_fail(KVL_ERR_INVALID_ARG,
                        "register: the memory spans CUDA devices %d and %d; register one "
                        "allocation per device",
                        at[0].a.device, at[1].a.device);
    if (device >= 0 && at[0].a.device != device)
        return kvl_fail(KVL_ERR_INVALID_ARG,
                        "register: the memory is on CUDA device %d, not on device %d as its "
                        "owner object says",
                        at[0].a.device, device);
    *actual = at[0].a.device;
    return KVL_OK;
}

kvl_err kvl_cuda_copy(void *dst, const void *src, size_t len)
{
    cu_err e = cu.cudaMemcpy(dst, src, len, CU_MEMCPY_DEFAULT);
    return e ? cu_fail("cudaMemcpy", e) : KVL_OK;
}

kvl_err kvl_cuda_sync(void)
{
    /* the legacy default stream, which cudaMemcpy runs on: once it returns,
     * every copy issued before is in its destination */
    cu_err e = cu.cudaStreamSynchronize(NULL);
    return e ? cu_fail("cudaStreamSynchronize", e) : KVL_OK;
}

void *kvl_cuda_host_alloc(size_t len)
{
    void *p = NULL;
    return cu.cudaMallocHost(&p, len) == 0 ? p : NULL;
}

void kvl_cuda_host_free(void *p)
{
    if (p)
        (void)cu.cudaFreeHost(p);
}

kvl_err kvl_cuda_pci_bus_id(int32_t device, char *out, size_t len)
{
    kvl_clear_error();
    if (!out || len < 16)
        return kvl_fail(KVL_ERR_INVALID_ARG, "cuda_pci_bus_id: out must hold 16 bytes or more");
    if (!kvl_cuda_loaded())
        return kvl_fail(KVL_ERR_INVALID_ARG,
                        "cuda_pci_bus_id: the CUDA runtime is not loaded (kvl_cuda_load_lib)");
    cu_err e = cu.cudaDeviceGetPCIBusId(out, (int)(len > 64 ? 64 : len), device);
    if (e)
        return cu_fail("cudaDeviceGetPCIBusId", e);
    return KVL_OK;
}
