/* test_stress.c: two agents in one process pushing and pulling at each other
 * over two loopback paths from several threads at once, every byte checked,
 * every notification and inbound handle accounted for; once with all I/O on
 * the engine threads and once with I/O threads (io_threads = 2), then both again with
 * every payload staged through host slots (stage_host_memory: the path GPU memory
 * takes, memcpy for cudaMemcpy) from a pool smaller than what is in flight, so slots
 * are taken, freed and reused all the time; and last over the fault-injecting
 * mover (transport FAULT: one-sided memcpy puts that are dropped, corrupted,
 * duplicated and delayed), both I/O modes.  Built with ASan/UBSan
 * and with ThreadSanitizer (make -C tests/c tsan): the engine, prober, log
 * and caller threads all run for real over real sockets. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "test_main.h"

#define THREADS 4
#define ROUNDS 12
#define SLOT (4u << 20) /* bytes per thread and direction */

typedef struct side {
    kvl_agent *a;
    uint8_t *mem;      /* THREADS source slots, then THREADS destination slots */
    uint64_t region;
} side;

static side sides[2];
static uint32_t io_threads; /* of both agents, this round */
static int staged;          /* ... and stage_host_memory */
static const char *faults;  /* ... and the fault mover's spec (NULL: transport AUTO) */
static kvl_peer *peer_of[2]; /* sides[i]'s peer object for the other side */

static kvl_agent *make_agent(const char *name)
{
    const char *addrs[] = {"127.0.0.1", "127.0.0.2"};
    kvl_config c = {.name = name, .addrs = addrs, .n_addrs = 2, .chunk_bytes = 1u << 20,
                    .min_chunk_bytes = 256u << 10, .connect_timeout_ms = 5000,
                    .max_connections = 1024,
                    .monitor_interval_ms = 100, .max_attempts = 4, .stall_factor = 4,
                    .probe_backoff_max_ms = 2000, .hedge = 1, .window_chunks = 2,
                    .window_bytes = 4u << 20, .close_linger_ms = 2000,
                    .io_threads = io_threads, .stage_host_memory = staged,
                    .stage_chunk_bytes = 512u << 10, .stage_pool_bytes = 1u << 20};
    if (faults) { /* a dropped or corrupted write is retried: room for bad luck */
        c.transport = KVL_TRANSPORT_FAULT;
        c.max_attempts = 16;
        snprintf(c.fault_spec, sizeof c.fault_spec, "%s", faults);
    }
    kvl_agent *a = NULL;
    CHECKF(kvl_agent_create(&c, &a) == KVL_OK, "%s: %s", name, kvl_last_error());
    return a;
}

static void connect_to(int from, int to, const char *name)
{
    size_t n = 0;
    kvl_agent_n_addrs(sides[to].a, &n);
    char hosts[2][48];
    const char *hp[2];
    uint16_t ports[2];
    for (size_t i = 0; i < n; i++) {
        kvl_agent_addr(sides[to].a, i, hosts[i], &ports[i]);
        hp[i] = hosts[i];
    }
    CHECKF(kvl_peer_connect(sides[from].a, name, 0, hp, ports, n, 0, &peer_of[from]) == KVL_OK,
           "%s", kvl_last_error());
    uint8_t key[16]; /* what the metadata would carry */
    CHECK(kvl_region_key(sides[to].a, sides[to].region, key) == KVL_OK);
    CHECK(kvl_peer_set_key(peer_of[from], sides[to].region, key) == KVL_OK);
}

typedef struct job {
    int from, slot;
    unsigned long bad;
} job;

static void *run(void *arg)
{
    job *j = arg;
    side *s = &sides[j->from], *d = &sides[1 - j->from];
    test_rng r = {0x5354524553530000ull + (uint64_t)(j->from * THREADS + j->slot)};
    for (int round = 0; round < ROUNDS; round++) {
        uint8_t *src = s->mem + (size_t)j->slot * SLOT;
        rng_fill(&r, src, SLOT);
        int pull = round % 3 == 2;
        kvl_segment seg = {.len = SLOT, .layer = 0};
        char tag[32];
        int tag_len = snprintf(tag, sizeof tag, "%d/%d/%d", j->from, j->slot, round);
        kvl_xfer *x = NULL;
        kvl_err e;
        if (!pull) { /* our source slot -> their destination slot */
            seg = (kvl_segment){s->region, (uint64_t)j->slot * SLOT, d->region,
                                (uint64_t)(THREADS + j->slot) * SLOT, SLOT, 0, 0};
            e = kvl_xfer_submit(s->a, peer_of[j->from], KVL_OP_PUSH, &seg, 1, tag,
                                (size_t)tag_len, 30000, &x);
        } else { /* their source... is ours mirrored: pull our slot back from them */
            seg = (kvl_segment){d->region, (uint64_t)(THREADS + j->slot) * SLOT, s->region,
                                (uint64_t)(2 * THREADS + j->slot) * SLOT, SLOT, 0, 0};
            e = kvl_xfer_submit(s->a, peer_of[j->from], KVL_OP_PULL, &seg, 1, NULL, 0, 30000,
                                &x);
        }
        if (e != KVL_OK) {
            j->bad++;
            continue;
        }
        if ((e = kvl_xfer_wait(x, 30000)) != KVL_OK) {
            kvl_xfer_info info;
            kvl_xfer_info_get(x, &info);
            fprintf(stderr, "side %d slot %d round %d (%s): %s: %s\n", j->from, j->slot, round,
                    pull ? "pull" : "push", kvl_err_name(e), info.message);
            j->bad++;
        }
        kvl_xfer_release(x);
        const uint8_t *want = pull ? d->mem + (size_t)(THREADS + j->slot) * SLOT : src;
        const uint8_t *got = pull ? s->mem + (size_t)(2 * THREADS + j->slot) * SLOT
                                  : d->mem + (size_t)(THREADS + j->slot) * SLOT;
        if (memcmp(want, got, SLOT) != 0) {
            fprintf(stderr, "side %d slot %d round %d (%s): the bytes differ\n", j->from, j->slot,
                    round, pull ? "pull" : "push");
            j->bad++;
        }
    }
    return NULL;
}

/* Takes every inbound handle and notification the other side's pushes made. */
static void *drain(void *arg)
{
    int me = (int)(intptr_t)arg;
    int handles = 0, notes = 0, want = THREADS * (ROUNDS - ROUNDS / 3);
    double deadline = test_now_s() + 60;
    while ((handles < want || notes < want) && test_now_s() < deadline) {
        kvl_inxfer *h = NULL;
        if (handles < want && kvl_inbound_next(sides[me].a, NULL, 0, 1, 50, &h) == KVL_OK) {
            CHECK(kvl_inxfer_wait(h, 30000) == KVL_OK);
            kvl_inxfer_release(h);
            handles++;
        }
        kvl_notification n;
        while (notes < want && kvl_next_notification(sides[me].a, 10, &n) == KVL_OK)
            notes++;
    }
    CHECKF(handles == want && notes == want, "side %d: %d handles, %d notifications of %d", me,
           handles, notes, want);
    return NULL;
}

static void *logs(void *arg)
{
    kvl_agent *a = arg;
    kvl_log_record rec;
    while (kvl_next_log(a, 1000, &rec) != KVL_ERR_CLOSED)
        ;
    return NULL;
}

static void stress(uint32_t threads, int stage, const char *fault_spec)
{
    io_threads = threads;
    staged = stage;
    faults = fault_spec;
    pthread_t lt[2];
    for (int i = 0; i < 2; i++) {
        sides[i].a = make_agent(i ? "stress-b" : "stress-a");
        sides[i].mem = calloc(3 * THREADS, SLOT);
        CHECK(kvl_region_register(sides[i].a, sides[i].mem, (uint64_t)3 * THREADS * SLOT,
                                  KVL_REMOTE_READ | KVL_REMOTE_WRITE, KVL_MEM_HOST, "kv",
                                  &sides[i].region) == KVL_OK);
        pthread_create(&lt[i], NULL, logs, sides[i].a);
    }
    connect_to(0, 1, "stress-b");
    connect_to(1, 0, "stress-a");
    pthread_t th[2 * THREADS], dr[2];
    job jobs[2 * THREADS];
    for (int i = 0; i < 2; i++)
        pthread_create(&dr[i], NULL, drain, (void *)(intptr_t)i);
    for (int i = 0; i < 2 * THREADS; i++) {
        jobs[i] = (job){.from = i / THREADS, .slot = i % THREADS};
        pthread_create(&th[i], NULL, run, &jobs[i]);
    }
    for (int i = 0; i < 2 * THREADS; i++) {
        pthread_join(th[i], NULL);
        CHECKF(jobs[i].bad == 0, "thread %d: %lu transfers failed or differ", i, jobs[i].bad);
    }
    for (int i = 0; i < 2; i++)
        pthread_join(dr[i], NULL);
    for (int i = 0; faults && i < 2; i++) { /* the payloads went by the fault mover's puts */
        kvl_path_info pi[4];
        size_t np = 0;
        uint64_t put = 0;
        CHECK(kvl_paths(sides[i].a, pi, 4, &np) == KVL_OK && np == 2);
        for (size_t k = 0; k < np; k++) {
            CHECKF(strcmp(pi[k].transport, "fault") == 0, "path %zu runs %s: %s", k,
                   pi[k].transport, pi[k].transport_note);
            put += pi[k].bytes_put;
        }
        CHECKF(put >= (uint64_t)THREADS * ROUNDS * SLOT, "side %d: %llu bytes put", i,
               (unsigned long long)put);
    }
    for (int i = 0; i < 2; i++) {
        kvl_log_wake(sides[i].a);
        pthread_join(lt[i], NULL);
        CHECK(kvl_agent_close(sides[i].a) == KVL_OK);
        free(sides[i].mem);
    }
}

int main(void)
{
    double t0 = test_now_s();
    stress(0, 0, NULL);
    stress(2, 0, NULL);
    stress(0, 1, NULL);
    stress(2, 1, NULL);
    const char *spec = "drop=0.05,corrupt=0.05,dup=0.2,delay=0.3,delay_ms=3,seed=11";
    stress(0, 0, spec);
    stress(2, 0, spec);
    return test_report("test_stress", t0);
}
