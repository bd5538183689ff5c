/* cma.c: the same-host descriptor, its checks and the copy (cma.h). */
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "../../internal.h"
#include "cma.h"

#define MAX_LOCAL_IOV 64

size_t kvl_cma_desc_len(uint32_t n)
{
    return KVL_CMA_HEAD_BYTES + (size_t)n * KVL_CMA_RANGE_BYTES;
}

static void put_u32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void put_u64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t get_u64(const uint8_t *p)
{
    return (uint64_t)get_u32(p) | (uint64_t)get_u32(p + 4) << 32;
}

void kvl_cma_desc_encode(uint8_t *out, const struct iovec *src, int n)
{
    put_u32(out, (uint32_t)getpid());
    put_u32(out + 4, (uint32_t)n);
    for (int i = 0; i < n; i++) {
        uint8_t *r = out + KVL_CMA_HEAD_BYTES + (size_t)i * KVL_CMA_RANGE_BYTES;
        put_u64(r, (uint64_t)(uintptr_t)src[i].iov_base);
        put_u64(r + 8, (uint64_t)src[i].iov_len);
    }
}

kvl_err kvl_cma_desc_head(const uint8_t in[KVL_CMA_HEAD_BYTES], uint32_t max_ranges,
                          uint32_t *pid, uint32_t *n)
{
    *pid = get_u32(in);
    *n = get_u32(in + 4);
    if (*pid == 0 || *pid > INT32_MAX)
        return kvl_fail(KVL_ERR_PROTOCOL, "CMA descriptor: pid %u", *pid);
    if (*n == 0 || *n > max_ranges)
        return kvl_fail(KVL_ERR_PROTOCOL, "CMA descriptor: %u source ranges (1..%u)", *n,
                        max_ranges);
    return KVL_OK;
}

kvl_err kvl_cma_desc_ranges(const uint8_t *in, uint32_t n, uint64_t total, struct iovec *out)
{
    uint64_t sum = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t addr = get_u64(in + (size_t)i * KVL_CMA_RANGE_BYTES);
        uint64_t len = get_u64(in + (size_t)i * KVL_CMA_RANGE_BYTES + 8);
        if (len == 0 || len > total || addr + len < addr || addr > UINTPTR_MAX - len)
            return kvl_fail(KVL_ERR_PROTOCOL, "CMA descriptor: range %u (%llu bytes at %#llx)",
                            i, (unsigned long long)len, (unsigned long long)addr);
        sum += len;
        if (sum > total)
            break;
        out[i].iov_base = (void *)(uintptr_t)addr;
        out[i].iov_len = (size_t)len;
    }
    if (sum != total)
        return kvl_fail(KVL_ERR_PROTOCOL,
                        "CMA descriptor: source ranges add up to more or less than the frame's "
                        "%llu payload bytes",
                        (unsigned long long)total);
    return KVL_OK;
}

/* The /proc/net/tcp form of an IPv4 address and port ("0100007F:1F90"). */
static void proc_addr(const struct sockaddr_in *s, char *out, size_t len)
{
    snprintf(out, len, "%08X:%04X", (unsigned)s->sin_addr.s_addr, (unsigned)ntohs(s->sin_port));
}

/* The inode of the socket whose local end is peer and remote end is local. */
static unsigned long peer_inode(const struct sockaddr_in *local, const struct sockaddr_in *peer)
{
    char want_l[32], want_r[32], line[512];
    proc_addr(peer, want_l, sizeof want_l);
    proc_addr(local, want_r, sizeof want_r);
    FILE *f = fopen("/proc/net/tcp", "r");
    if (!f)
        return 0;
    unsigned long inode = 0;
    while (!inode && fgets(line, sizeof line, f)) {
        char l[64], r[64];
        unsigned long ino;
        if (sscanf(line, " %*d: %63s %63s %*x %*s %*s %*s %*u %*d %lu", l, r, &ino) == 3 &&
            strcmp(l, want_l) == 0 && strcmp(r, want_r) == 0)
            inode = ino;
    }
    fclose(f);
    return inode;
}

/* The inode of the connection's peer socket in this network namespace
 * (0: not here). */
static kvl_err peer_inode_of(const struct sockaddr_storage *local,
                             const struct sockaddr_storage *peer, unsigned long *inode)
{
    if (local->ss_family != AF_INET || peer->ss_family != AF_INET)
        return kvl_fail(KVL_ERR_PROTOCOL, "CMA: the connection is not IPv4 TCP");
    *inode = peer_inode((const struct sockaddr_in *)local, (const struct sockaddr_in *)peer);
    if (!*inode)
        return kvl_fail(KVL_ERR_PROTOCOL,
                        "CMA: the peer's socket is not in this network namespace: not the same "
                        "host");
    return KVL_OK;
}

kvl_err kvl_cma_peer_here(const struct sockaddr_storage *local,
                          const struct sockaddr_storage *peer)
{
    unsigned long inode;
    return peer_inode_of(local, peer, &inode);
}

kvl_err kvl_cma_peer_check(const struct sockaddr_storage *local,
                           const struct sockaddr_storage *peer, uint32_t pid)
{
    unsigned long inode;
    kvl_err e = peer_inode_of(local, peer, &inode);
    if (e)
        return e;
    char dir[64], want[64];
    snprintf(dir, sizeof dir, "/proc/%u/fd", pid);
    snprintf(want, sizeof want, "socket:[%lu]", inode);
    DIR *d = opendir(dir);
    if (!d)
        return kvl_fail(KVL_ERR_PROTOCOL, "CMA: cannot look into process %u (%s)", pid,
                        strerror(errno));
    int found = 0;
    struct dirent *de;
    while (!found && (de = readdir(d))) {
        char path[96], link[64];
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        ssize_t n = readlink(path, link, sizeof link - 1);
        if (n > 0) {
            link[n] = 0;
            found = strcmp(link, want) == 0;
        }
    }
    closedir(d);
    if (!found)
        return kvl_fail(KVL_ERR_PROTOCOL,
                        "CMA: process %u does not own the peer's end of this connection", pid);
    return KVL_OK;
}

int kvl_cma_allowed(uint32_t pid)
{
    /* one byte at address 0, never mapped: EFAULT means "allowed" */
    char c;
    struct iovec l = {&c, 1}, r = {NULL, 1};
    if (pid == 0 || pid > INT32_MAX)
        return ESRCH;
    if (process_vm_readv((pid_t)pid, &l, 1, &r, 1, 0) >= 0 || errno == EFAULT)
        return 0;
    return errno;
}

void kvl_cma_advance(const struct iovec *r, int nr, int *ri, size_t *roff, size_t len)
{
    while (len && *ri < nr) {
        size_t rest = r[*ri].iov_len - *roff;
        size_t take = rest < len ? rest : len;
        *roff += take;
        len -= take;
        if (*roff == r[*ri].iov_len) {
            (*ri)++;
            *roff = 0;
        }
    }
}

ssize_t kvl_cma_read(uint32_t pid, const struct iovec *l, int nl, const struct iovec *r, int nr,
                     int *ri, size_t *roff)
{
    struct iovec rv[MAX_LOCAL_IOV];
    size_t want = 0;
    for (int i = 0; i < nl; i++)
        want += l[i].iov_len;
    int n = 0;
    size_t got = 0;
    int idx = *ri;
    size_t off = *roff;
    while (n < MAX_LOCAL_IOV && idx < nr && got < want) {
        size_t len = r[idx].iov_len - off;
        if (len > want - got)
            len = want - got;
        rv[n].iov_base = (uint8_t *)r[idx].iov_base + off;
        rv[n++].iov_len = len;
        got += len;
        if (off + len == r[idx].iov_len) {
            idx++;
            off = 0;
        } else {
            off += len;
        }
    }
    if (n == 0) {
        errno = EINVAL;
        return -1;
    }
    ssize_t done = process_vm_readv((pid_t)pid, l, (unsigned long)nl, rv, (unsigned long)n, 0);
    if (done <= 0) {
        if (done == 0)
            errno = EFAULT;
        return -1;
    }
    /* a partial copy stops at a remote range's page boundary */
    kvl_cma_advance(r, nr, ri, roff, (size_t)done);
    return done;
}
