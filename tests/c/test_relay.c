/* test_relay.c: relayed paths (csrc/transport/relay/) under the sanitizers.
 *
 * 1. Sealed records (aead.c): a record opens only as it was sealed, in order,
 *    under its key: a changed byte of the ciphertext, the length or the tag, a
 *    replayed or skipped record, another key: all refused.
 * 2. Three whole agents on loopback: b with its sealed port, r relaying, a
 *    connecting to b over one direct and one relayed route with b's end-to-end
 *    key; pushes and pulls from several threads land byte-exact, the relayed
 *    path carries some of them, the relay counts what it forwarded; a route
 *    with a wrong key stays DOWN saying why, and the direct path carries on.
 *    Run under ASan/UBSan here and under TSan (tests/c/Makefile, tsan).
 */
#include <string.h>
#include <unistd.h>

#include "internal.h"
#include "test_main.h"
#include "transport/relay/aead.h"

#define MiB (1u << 20)
#define THREADS 4
#define ROUNDS 6
#define SLOT (4 * MiB)

static void test_records(void)
{
    if (kvl_aead_load() != KVL_OK) {
        printf("  records: SKIPPED (%s)\n", kvl_last_error());
        return;
    }
    uint8_t key[32], other[32], salt[4] = {1, 2, 3, 4};
    for (int i = 0; i < 32; i++) {
        key[i] = (uint8_t)(i * 7 + 1);
        other[i] = (uint8_t)(i * 7 + 2);
    }
    uint8_t msg[3000], buf[3000], tag[16], aad[4] = {0, 0, 11, 184};
    for (size_t i = 0; i < sizeof msg; i++)
        msg[i] = (uint8_t)(i * 13);
    kvl_aead *tx = kvl_aead_new(key, salt), *rx = kvl_aead_new(key, salt);
    kvl_aead *wrong = kvl_aead_new(other, salt);
    CHECK(tx && rx && wrong);
    /* in order, untouched: opens to the same bytes; the ciphertext is not the plaintext */
    memcpy(buf, msg, sizeof buf);
    CHECK(kvl_aead_seal(tx, aad, 4, buf, sizeof buf, tag) == 0);
    CHECK(memcmp(buf, msg, sizeof buf) != 0);
    uint8_t copy[3000], ctag[16];
    memcpy(copy, buf, sizeof copy);
    memcpy(ctag, tag, sizeof ctag);
    CHECK(kvl_aead_open(rx, aad, 4, buf, sizeof buf, tag) == 0);
    CHECK(memcmp(buf, msg, sizeof buf) == 0);
    /* the same record again (a replay): the receiver expects the next number */
    memcpy(buf, copy, sizeof buf);
    CHECK(kvl_aead_open(rx, aad, 4, buf, sizeof buf, ctag) != 0);
    /* each kind of change to the next record is refused */
    for (int what = 0; what < 4; what++) {
        kvl_aead *s = kvl_aead_new(key, salt), *r = kvl_aead_new(key, salt);
        uint8_t a2[4];
        memcpy(a2, aad, 4);
        memcpy(buf, msg, sizeof buf);
        CHECK(kvl_aead_seal(s, a2, 4, buf, sizeof buf, tag) == 0);
        if (what == 0)
            buf[1234] ^= 0x40;
        else if (what == 1)
            a2[3] ^= 1;
        else if (what == 2)
            tag[0] ^= 1;
        CHECKF(kvl_aead_open(what == 3 ? wrong : r, a2, 4, buf, sizeof buf, tag) != 0,
               "change %d was not refused", what);
        kvl_aead_free(s);
        kvl_aead_free(r);
    }
    /* a record skipped (dropped by the relay): the next one does not open */
    kvl_aead *s = kvl_aead_new(key, salt), *r = kvl_aead_new(key, salt);
    memcpy(buf, msg, sizeof buf);
    CHECK(kvl_aead_seal(s, aad, 4, buf, sizeof buf, tag) == 0); /* record 0: lost */
    memcpy(buf, msg, sizeof buf);
    CHECK(kvl_aead_seal(s, aad, 4, buf, sizeof buf, tag) == 0); /* record 1 */
    CHECK(kvl_aead_open(r, aad, 4, buf, sizeof buf, tag) != 0);
    kvl_aead_free(s);
    kvl_aead_free(r);
    kvl_aead_free(tx);
    kvl_aead_free(rx);
    kvl_aead_free(wrong);
}

typedef struct agent_side {
    kvl_agent *a;
    uint8_t *mem;
    uint64_t region;
} agent_side;

static agent_side A, B, R;
static kvl_peer *peer_b;

static kvl_agent *make(const char *name, const char *addr, int relay)
{
    const char *addrs[] = {addr};
    kvl_config c = {.name = name, .addrs = addrs, .n_addrs = 1, .chunk_bytes = MiB,
                    .min_chunk_bytes = 256u << 10, .connect_timeout_ms = 5000,
                    .max_connections = 1024, .monitor_interval_ms = 100, .max_attempts = 4,
                    .stall_factor = 4, .probe_backoff_max_ms = 2000, .hedge = 1,
                    .window_chunks = 2, .window_bytes = 4u << 20, .close_linger_ms = 2000,
                    .sealed_listen = !relay, .relay = relay, .relay_max_conns = 64,
                    .relay_yield_mbps = 0,
                    /* every UP path takes chunks in turn: the measured-rate
                     * scheduler may leave a slow (sanitized) relayed path
                     * idle, and this test is about what crosses it */
                    .round_robin = 1};
    kvl_agent *a = NULL;
    CHECKF(kvl_agent_create(&c, &a) == KVL_OK, "%s: %s", name, kvl_last_error());
    return a;
}

typedef struct job {
    int slot;
    unsigned long bad;
} job;

static void *run(void *arg)
{
    job *j = arg;
    test_rng r = {0x52454c4159000000ull + (uint64_t)j->slot};
    for (int round = 0; round < ROUNDS; round++) {
        uint8_t *src = A.mem + (size_t)j->slot * SLOT;
        rng_fill(&r, src, SLOT);
        int pull = round % 3 == 2;
        kvl_segment seg;
        kvl_xfer *x = NULL;
        kvl_err e;
        if (!pull) {
            seg = (kvl_segment){A.region, (uint64_t)j->slot * SLOT, B.region,
                                (uint64_t)j->slot * SLOT, SLOT, 0, 0};
            e = kvl_xfer_submit(A.a, peer_b, KVL_OP_PUSH, &seg, 1, NULL, 0, 30000, &x);
        } else {
            seg = (kvl_segment){B.region, (uint64_t)j->slot * SLOT, A.region,
                                (uint64_t)(THREADS + j->slot) * SLOT, SLOT, 0, 0};
            e = kvl_xfer_submit(A.a, peer_b, KVL_OP_PULL, &seg, 1, NULL, 0, 30000, &x);
        }
        if (e != KVL_OK) {
            j->bad++;
            continue;
        }
        if (kvl_xfer_wait(x, 30000) != KVL_OK)
            j->bad++;
        kvl_xfer_release(x);
        const uint8_t *want = pull ? B.mem + (size_t)j->slot * SLOT : src;
        const uint8_t *got = pull ? A.mem + (size_t)(THREADS + j->slot) * SLOT
                                  : B.mem + (size_t)j->slot * SLOT;
        if (memcmp(want, got, SLOT) != 0)
            j->bad++;
    }
    return NULL;
}

static int relayed_up(void *unused, uint32_t n)
{
    (void)unused;
    (void)n;
    kvl_path_info p[4];
    size_t np = 0;
    if (kvl_paths(A.a, p, 4, &np) != KVL_OK)
        return 0;
    for (size_t i = 0; i < np; i++)
        if (p[i].relay[0] && p[i].state == KVL_PATH_UP)
            return 1;
    return 0;
}

static void test_three_agents(int wrong_key)
{
    if (kvl_aead_load() != KVL_OK)
        return;
    R.a = make("r", "127.0.0.3", 1);
    B.a = make("b", "127.0.0.2", 0);
    A.a = make("a", "127.0.0.1", 0);
    if (!A.a || !B.a || !R.a)
        return;
    size_t len = (size_t)2 * THREADS * SLOT;
    A.mem = calloc(1, len);
    B.mem = calloc(1, len);
    CHECK(kvl_region_register(A.a, A.mem, len, 0, KVL_MEM_HOST, "a", &A.region) == KVL_OK);
    CHECK(kvl_region_register(B.a, B.mem, len, KVL_REMOTE_READ | KVL_REMOTE_WRITE, KVL_MEM_HOST,
                              "kv", &B.region) == KVL_OK);
    kvl_relay_info bi, ri;
    CHECK(kvl_agent_relay_info(B.a, &bi) == KVL_OK && bi.n_sealed == 1);
    CHECK(kvl_agent_relay_info(R.a, &ri) == KVL_OK && ri.n_relay == 1 && ri.n_sealed == 0);
    if (wrong_key)
        bi.e2e_key[5] ^= 1; /* stale metadata: another instance's key */
    char host[48];
    uint16_t port;
    kvl_agent_addr(B.a, 0, host, &port);
    const char *hosts[] = {host, host};
    uint16_t ports[] = {port, bi.sealed_ports[0]};
    kvl_route routes[2] = {{.local = 0, .remote = 0},
                           {.local = 0, .remote = 1, .via = "127.0.0.3",
                            .via_port = ri.relay_ports[0], .via_name = "r"}};
    CHECKF(kvl_peer_connect_routes(A.a, "b", 0, hosts, ports, 2, 0, routes, 2, bi.e2e_key, 32,
                                   &peer_b) == KVL_OK,
           "%s", kvl_last_error());
    uint8_t key[16];
    CHECK(kvl_region_key(B.a, B.region, key) == KVL_OK);
    CHECK(kvl_peer_set_key(peer_b, B.region, key) == KVL_OK);
    if (wrong_key) {
        kvl_path_info p[4];
        size_t np = 0;
        CHECK(kvl_paths(A.a, p, 4, &np) == KVL_OK && np == 2);
        CHECKF(np == 2 && p[1].state != KVL_PATH_UP &&
                   strstr(p[1].last_error, "end-to-end key") != NULL,
               "relayed path with a wrong key: state %u, '%s'", p[1].state, p[1].last_error);
    } else {
        pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
        pthread_cond_t cv;
        kvl_cond_init(&cv);
        pthread_mutex_lock(&mu); /* polls every 100 ms: nothing signals cv */
        CHECKF(kvl_cond_wait_until(&cv, &mu, relayed_up, NULL, 0, 10000) == 0,
               "the relayed path is not UP");
        pthread_mutex_unlock(&mu);
    }
    pthread_t th[THREADS];
    job jobs[THREADS];
    for (int i = 0; i < THREADS; i++) {
        jobs[i] = (job){.slot = i};
        pthread_create(&th[i], NULL, run, &jobs[i]);
    }
    unsigned long bad = 0;
    for (int i = 0; i < THREADS; i++) {
        pthread_join(th[i], NULL);
        bad += jobs[i].bad;
    }
    CHECKF(bad == 0, "%lu transfers failed or differ (wrong key: %d)", bad, wrong_key);
    kvl_path_info p[4];
    size_t np = 0;
    CHECK(kvl_paths(A.a, p, 4, &np) == KVL_OK && np == 2);
    CHECK(np == 2 && strcmp(p[1].relay, "r") == 0 && p[0].relay[0] == 0);
    CHECK(kvl_agent_relay_info(R.a, &ri) == KVL_OK);
    if (!wrong_key) {
        CHECKF(np == 2 && p[1].bytes_sent + p[1].bytes_recv > 0,
               "nothing went over the relayed path");
        CHECKF(ri.relayed_bytes > 0 && ri.relayed_total >= 1, "relay forwarded %llu bytes",
               (unsigned long long)ri.relayed_bytes);
    } else {
        CHECK(ri.relayed_bytes > 0 || ri.relayed_total >= 1); /* forwarded, then refused */
    }
    kvl_agent_close(A.a);
    kvl_agent_close(B.a);
    kvl_agent_close(R.a);
    free(A.mem);
    free(B.mem);
    memset(&A, 0, sizeof A);
    memset(&B, 0, sizeof B);
    memset(&R, 0, sizeof R);
}

int main(void)
{
    double t0 = test_now_s();
    test_records();
    test_three_agents(0);
    test_three_agents(1);
    return test_report("relay", t0);
}
