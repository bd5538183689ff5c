/* dl.c: loads libucp at run time, once per process (ucx.h, dl.h).
 *
 * kvlink never links against UCX, so a machine without it builds, imports
 * and runs the TCP transport; the UCX transport exists only where this load
 * succeeds.  The first attempt decides for the whole process (a second
 * agent with another library path gets the first answer): libucp cannot be
 * unloaded safely once a context was created.
 */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"
#include "ucx.h"

#ifdef KVL_HAVE_UCX
#include <dlfcn.h>

#include "dl.h"

kvl_ucx_fns kvl_ucx;
#endif

static pthread_mutex_t load_mu = PTHREAD_MUTEX_INITIALIZER;
static int load_state; /* 0: not tried, 1: loaded, -1: failed */
static char load_why[512];
static char load_version[32];

#ifdef KVL_HAVE_UCX
/* 0, or -1 with load_why set.  Under load_mu. */
static int load_locked(const char *lib)
{
    const char *name = lib && lib[0] ? lib : "libucp.so.0";
    /* RTLD_LOCAL: UCX's symbols stay out of the global namespace, so another
     * copy of UCX in the process (a framework's) cannot bind to ours. */
    void *h = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *e = dlerror();
        snprintf(load_why, sizeof load_why, "cannot load UCX (%s): %s", name, e ? e : "?");
        return -1;
    }
    kvl_ucx_fns f;
#define KVL_UCX_SYM(fn)                                                                    \
    *(void **)&f.fn = dlsym(h, #fn);                                                       \
    if (!f.fn) {                                                                           \
        snprintf(load_why, sizeof load_why, "%s has no symbol %s (UCX too old?)", name, #fn); \
        dlclose(h);                                                                        \
        return -1;                                                                         \
    }
    KVL_UCX_FNS(KVL_UCX_SYM)
#undef KVL_UCX_SYM
    unsigned major = 0, minor = 0, release = 0;
    f.ucp_get_version(&major, &minor, &release);
    if (major != KVL_UCX_MIN_MAJOR || minor < KVL_UCX_MIN_MINOR) {
        snprintf(load_why, sizeof load_why,
                 "UCX %u.%u.%u at %s is older than %d.%d, the oldest kvlink accepts", major,
                 minor, release, name, KVL_UCX_MIN_MAJOR, KVL_UCX_MIN_MINOR);
        dlclose(h);
        return -1;
    }
    snprintf(load_version, sizeof load_version, "%u.%u.%u", major, minor, release);
    kvl_ucx = f; /* h stays open for the life of the process */
    return 0;
}
#endif

int kvl_ucx_load(const char *lib, char *why, size_t why_len)
{
    pthread_mutex_lock(&load_mu);
    if (load_state == 0) {
#ifdef KVL_HAVE_UCX
        load_state = load_locked(lib) == 0 ? 1 : -1;
#else
        (void)lib;
        snprintf(load_why, sizeof load_why,
                 "kvlink was built without UCX headers (pkg-config found no ucx at build "
                 "time; pip install 'kvlink[ucx]' and rebuild)");
        load_state = -1;
#endif
    }
    int st = load_state;
    if (st < 0 && why && why_len)
        snprintf(why, why_len, "%s", load_why);
    pthread_mutex_unlock(&load_mu);
    return st > 0 ? 0 : -1;
}

const char *kvl_ucx_version(void)
{
    pthread_mutex_lock(&load_mu);
    const char *v = load_state > 0 ? load_version : "";
    pthread_mutex_unlock(&load_mu);
    return v;
}

kvl_err kvl_ucx_load_lib(const char *lib)
{
    char why[512];
    if (kvl_ucx_load(lib, why, sizeof why) != 0)
        return kvl_fail(KVL_ERR_SYSTEM, "%s", why);
    return KVL_OK;
}

const char *kvl_ucx_loaded_version(void) { return kvl_ucx_version(); }
