/* tunnel.c: a sealed connection's two pumps.  One thread reads plaintext the
 * stream wrote into its socketpair end, seals it into records
 *     u32 length (big-endian, <= KVL_TUNNEL_RECORD) | ciphertext | 16-byte tag
 * (the length is authenticated as associated data) and writes them to the
 * network; the other reads records, opens them and writes the plaintext to
 * the stream.  Blocking I/O on both sockets: the stream's own pings and
 * TCP_USER_TIMEOUT on the network socket bound every wait (a silent peer
 * makes the stream close its end, which ends the reading pump's peer too).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "../../internal.h"
#include "../../log.h"
#include "tunnel.h"

struct kvl_tunnel {
    kvl_agent *a;
    int plain, outer;
    kvl_aead *seal, *open;
    atomic_int refs;
    atomic_int ended;
    char what[128];
    pthread_t th[2];
};

int kvl_tunnel_outer_fd(const kvl_tunnel *t) { return t->outer; }

void kvl_tunnel_release(void *arg)
{
    kvl_tunnel *t = arg;
    if (atomic_fetch_sub(&t->refs, 1) != 1)
        return;
    atomic_fetch_sub(&t->a->relay_tunnels, 1);
    close(t->plain);
    close(t->outer);
    kvl_aead_free(t->seal);
    kvl_aead_free(t->open);
    free(t);
}

/* Both directions stop: each pump's blocking call returns. */
static void end_both(kvl_tunnel *t)
{
    atomic_store(&t->ended, 1);
    shutdown(t->plain, SHUT_RDWR);
    shutdown(t->outer, SHUT_RDWR);
}

void kvl_tunnel_close(void *arg)
{
    kvl_tunnel *t = arg;
    /* a pump blocked on the network (a relay that stopped reading) returns now */
    end_both(t);
    kvl_tunnel_release(t);
}

static int write_all(int fd, const uint8_t *p, size_t len)
{
    while (len) {
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

/* 1 read, 0 the peer ended cleanly before the first byte, -1 error */
static int read_all(int fd, uint8_t *p, size_t len)
{
    size_t got = 0;
    while (got < len) {
        ssize_t n = recv(fd, p + got, len - got, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return n == 0 && got == 0 ? 0 : -1;
        got += (size_t)n;
    }
    return 1;
}

static void *seal_main(void *arg)
{
    kvl_tunnel *t = arg;
    uint8_t *rec = malloc(4 + KVL_TUNNEL_RECORD + KVL_AEAD_TAG);
    while (rec && !atomic_load(&t->ended)) {
        ssize_t n = recv(t->plain, rec + 4, KVL_TUNNEL_RECORD, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        uint32_t len = (uint32_t)n;
        rec[0] = (uint8_t)(len >> 24);
        rec[1] = (uint8_t)(len >> 16);
        rec[2] = (uint8_t)(len >> 8);
        rec[3] = (uint8_t)len;
        if (kvl_aead_seal(t->seal, rec, 4, rec + 4, len, rec + 4 + len) != 0) {
            kvl_log(t->a, KVL_LOG_ERROR, NULL, -1, "%s: sealing a record failed (libcrypto)",
                    t->what);
            break;
        }
        if (write_all(t->outer, rec, 4 + len + KVL_AEAD_TAG) != 0)
            break;
    }
    free(rec);
    end_both(t);
    kvl_tunnel_release(t);
    return NULL;
}

static void *open_main(void *arg)
{
    kvl_tunnel *t = arg;
    uint8_t *rec = malloc(4 + KVL_TUNNEL_RECORD + KVL_AEAD_TAG);
    while (rec && !atomic_load(&t->ended)) {
        if (read_all(t->outer, rec, 4) != 1)
            break;
        uint32_t len = (uint32_t)rec[0] << 24 | (uint32_t)rec[1] << 16 |
                       (uint32_t)rec[2] << 8 | rec[3];
        if (len == 0 || len > KVL_TUNNEL_RECORD) {
            kvl_log(t->a, KVL_LOG_WARNING, NULL, -1,
                    "%s: a record announced %u bytes (1..%u): the relay or the path changed "
                    "bytes; connection closed",
                    t->what, len, KVL_TUNNEL_RECORD);
            break;
        }
        if (read_all(t->outer, rec + 4, len + KVL_AEAD_TAG) != 1)
            break;
        if (kvl_aead_open(t->open, rec, 4, rec + 4, len, rec + 4 + len) != 0) {
            kvl_log(t->a, KVL_LOG_WARNING, NULL, -1,
                    "%s: a record failed its end-to-end check (the relay or the path changed, "
                    "dropped or replayed bytes); connection closed, its chunks go again",
                    t->what);
            break;
        }
        if (write_all(t->plain, rec + 4, len) != 0)
            break;
    }
    free(rec);
    end_both(t);
    kvl_tunnel_release(t);
    return NULL;
}

kvl_err kvl_tunnel_start(kvl_agent *a, int plain_fd, int outer_fd, kvl_aead *out, kvl_aead *in,
                         const char *what, kvl_tunnel **tp)
{
    kvl_tunnel *t = calloc(1, sizeof *t);
    if (!t) {
        close(plain_fd);
        close(outer_fd);
        kvl_aead_free(out);
        kvl_aead_free(in);
        return kvl_fail(KVL_ERR_NOMEM, "relayed connection: out of memory");
    }
    t->a = a;
    t->plain = plain_fd;
    t->outer = outer_fd;
    t->seal = out;
    t->open = in;
    snprintf(t->what, sizeof t->what, "%s", what);
    atomic_init(&t->refs, 3);
    atomic_init(&t->ended, 0);
    atomic_fetch_add(&a->relay_tunnels, 1);
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&at, 128 << 10);
    int started = 0;
    if (pthread_create(&t->th[0], &at, seal_main, t) == 0)
        started++;
    if (started == 1 && pthread_create(&t->th[1], &at, open_main, t) == 0)
        started++;
    pthread_attr_destroy(&at);
    if (started < 2) {
        end_both(t);
        /* the references of the threads that did not start, then the caller's */
        for (int i = started; i < 2; i++)
            kvl_tunnel_release(t);
        kvl_tunnel_release(t);
        return kvl_fail(KVL_ERR_SYSTEM, "relayed connection: cannot start its threads");
    }
    *tp = t;
    return KVL_OK;
}
