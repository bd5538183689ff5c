/* fault.c: the fault-injecting mover, for tests (transport.h; Config.transport
 * "fault", kvl_config.fault_spec).
 *
 * A one-sided mover like UCX's (ucx/mover.c), whose "put" is a memcpy into
 * the peer's memory: it runs only between two agents of one process (a
 * test's).  It shows that the stream's generic out-of-band code keeps the
 * one-sided rules (docs/ucx.md, "Cancel and duplicate copies") with no UCX:
 * writes are asynchronous like a NIC's, and the spec makes them go wrong.
 *
 * Set-up (after the handshake):
 *   initiator: MOVER_OFFER(fault: link id, pid, its host regions: pull
 *              destinations)                                 -- fault_start
 *   listener:  MOVER_ACCEPT(fault: link id, pid, its remote_write regions:
 *              push destinations) or MOVER_REFUSE(fault: status, why)
 *                                                            -- fault_answer
 * A region is (id, base address, size).  The two ends of a path share one
 * *link*, found by its random id in this process's table of links (nothing
 * from the wire is dereferenced to find it): an offer from another process
 * finds none, and one naming another pid is refused.  Regions registered
 * later go in MOVER_KEYS (sync / keys), as UCX's keys do.
 *
 * Writes: post() queues a job on the link; the link's worker thread places
 * it when it is due (memcpy from the sender's memory, read then, into the
 * peer's) and wakes the posting end's stream through an eventfd (watch_fd).
 * The worker places a job with the link's lock held, and only while both
 * ends are open and the destination region is still registered at the peer
 * (its region table, under its lock: a deregistered region is never
 * written).  So once an end's fence() or free() took the lock, no write of
 * its own lands any more (queued ones are cancelled, the running one is
 * over) and no write of the peer lands in its memory: an RC queue pair in
 * error, the receiver's end destroyed (docs/ucx.md, step 3).
 *
 * Faults (kvl_config.fault_spec, "drop=0.1,corrupt=0.05,dup=0.2,late=0.05,
 * delay_ms=20,seed=7"; rates 0..1 drawn per write, in a fixed order from a
 * generator seeded by seed and the end's local address, so one seed gives one
 * sequence of faults per path end):
 *   drop     reported complete without writing: the receiver's crc refuses it
 *   corrupt  written, then one byte of the destination flipped: refused too
 *   dup      written twice, the second dup_ms (5) later; complete after both
 *   delay    complete after delay_ms (delay: the rate, 1 when only delay_ms is given)
 *   late     due late_ms after posting (default 2 x connect_timeout + 1 s):
 *            past the stream's cancel wait, so the path is cut and the write
 *            must be cancelled by the mover's free, never land
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include "../../internal.h"

#define FAULT_MAX_REGIONS 8192 /* regions of one side named on the wire (KVL_MAX_REGIONS) */
#define FAULT_REGION_BYTES 24  /* u64 id, u64 base, u64 size */
#define FAULT_MAX_LATE_MS 600000u

extern const kvl_mover_ops kvl_fault_mover;

typedef struct fault_spec {
    double drop, corrupt, dup, late, delay;
    uint32_t delay_ms, dup_ms, late_ms; /* late_ms 0: from connect_timeout_ms */
    uint64_t seed;
} fault_spec;

typedef struct fregion {
    uint64_t id, base, size;
} fregion;

typedef struct fcopy {
    uint64_t region;     /* the destination region's id at the peer */
    uint64_t base, size; /* ... as learnt: checked against its table before each write */
    uint8_t *dst;
    const uint8_t *src;
    size_t len;
} fcopy;

typedef struct fjob {
    struct fjob *next;
    int from;            /* the end that posted it (0 initiator, 1 listener) */
    uint64_t ticket;
    uint64_t due_ns;
    int drop, dup, corrupt;
    uint64_t flip_at;    /* corrupt: the payload byte flipped */
    int n;
    fcopy *cp;
} fjob;

typedef struct fault_end fault_end;

typedef struct fault_link {
    struct fault_link *next; /* this process's table (links_mu) */
    uint64_t id;
    pthread_mutex_t mu;      /* everything below, and every write placed */
    pthread_cond_t cv;       /* the worker's and wait()'s */
    fault_end *end[2];       /* NULL once that end is freed */
    int refs;                /* ends holding the link */
    fjob *q;                 /* due jobs, earliest first */
    int stop;
    pthread_t th;
} fault_link;

struct fault_end {
    kvl_agent *a;
    kvl_ep *ep;
    fault_link *l;
    int side;
    int efd;             /* the worker wakes our stream through it */
    int watched;
    int fenced;          /* under l->mu: nothing lands here any more */
    int broken;          /* under l->mu: a write failed (why): ready/wait say -1 */
    char why[160];
    char note[128];
    fault_spec spec;
    uint64_t rng;
    uint64_t next_ticket;
    uint64_t t_event_ns;
    uint32_t need;       /* rights our regions need to be shown to the peer */
    uint64_t last_shown; /* the highest region id shown (ids only grow) */
    uint32_t n_shown;
    fregion *peer;       /* the peer's regions we may write, ids ascending */
    uint32_t n_peer;
    uint64_t n_post, n_drop, n_corrupt, n_dup, n_delay, n_late; /* under l->mu */
};

static pthread_mutex_t links_mu = PTHREAD_MUTEX_INITIALIZER;
static fault_link *links;

static fault_end *E(kvl_mover *m) { return (fault_end *)m; }
static const fault_end *CE(const kvl_mover *m) { return (const fault_end *)m; }

/* ---- the spec ---- */

static kvl_err spec_parse(const char *s, fault_spec *out)
{
    memset(out, 0, sizeof *out);
    out->dup_ms = 5;
    int delay_rate_given = 0;
    char buf[sizeof ((kvl_config *)0)->fault_spec];
    snprintf(buf, sizeof buf, "%s", s);
    char *save = NULL;
    for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        while (*tok == ' ')
            tok++;
        if (!*tok)
            continue;
        char *eq = strchr(tok, '=');
        if (!eq)
            return kvl_fail(KVL_ERR_INVALID_ARG,
                            "config.fault_spec: '%s' is not key=value (e.g. 'drop=0.1,seed=7')",
                            tok);
        *eq = 0;
        const char *k = tok, *v = eq + 1;
        char *end = NULL;
        errno = 0;
        double d = strtod(v, &end);
        if (end == v || *end || errno || d < 0)
            return kvl_fail(KVL_ERR_INVALID_ARG,
                            "config.fault_spec: %s=%s is not a non-negative number", k, v);
        double *rate = !strcmp(k, "drop")      ? &out->drop
                       : !strcmp(k, "corrupt") ? &out->corrupt
                       : !strcmp(k, "dup")     ? &out->dup
                       : !strcmp(k, "late")    ? &out->late
                       : !strcmp(k, "delay")   ? &out->delay
                                               : NULL;
        uint32_t *ms = !strcmp(k, "delay_ms") ? &out->delay_ms
                       : !strcmp(k, "dup_ms") ? &out->dup_ms
                       : !strcmp(k, "late_ms") ? &out->late_ms
                                               : NULL;
        if (rate) {
            if (d > 1)
                return kvl_fail(KVL_ERR_INVALID_ARG,
                                "config.fault_spec: %s=%s is a rate: 0..1", k, v);
            *rate = d;
            delay_rate_given |= rate == &out->delay;
        } else if (ms) {
            if (d > FAULT_MAX_LATE_MS || d != (uint32_t)d)
                return kvl_fail(KVL_ERR_INVALID_ARG,
                                "config.fault_spec: %s=%s must be whole milliseconds 0..%u", k,
                                v, FAULT_MAX_LATE_MS);
            *ms = (uint32_t)d;
        } else if (!strcmp(k, "seed")) {
            out->seed = strtoull(v, NULL, 10);
        } else {
            return kvl_fail(KVL_ERR_INVALID_ARG,
                            "config.fault_spec: unknown key '%s'; keys: drop, corrupt, dup, "
                            "late, delay (rates 0..1), delay_ms, dup_ms, late_ms, seed",
                            k);
        }
    }
    if (out->delay_ms && !delay_rate_given)
        out->delay = 1;
    return KVL_OK;
}

static uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double rnd01(fault_end *e) { return (double)(splitmix(&e->rng) >> 11) * 0x1.0p-53; }

/* ---- wire form ---- */

static void put_u64(kvl_buf *b, uint64_t v)
{
    uint8_t x[8];
    for (int i = 0; i < 8; i++)
        x[i] = (uint8_t)(v >> (8 * i));
    kvl_buf_put(b, x, 8);
}

static void put_u32(kvl_buf *b, uint32_t v)
{
    uint8_t x[4];
    for (int i = 0; i < 4; i++)
        x[i] = (uint8_t)(v >> (8 * i));
    kvl_buf_put(b, x, 4);
}

static uint64_t get_u64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static uint32_t get_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Starts a MOVER_* frame of this mover: its kind byte first. */
static void frame_begin(kvl_buf *b)
{
    uint8_t k = KVL_MOVER_FAULT;
    kvl_frame_start(b);
    kvl_buf_put(b, &k, 1);
}

/* Our host regions with the rights need, ids above after (u32 count, then
 * id, base, size each; ids ascending as the table is); *last: the highest. */
static uint32_t put_regions(kvl_agent *a, kvl_buf *b, uint32_t need, uint64_t after,
                            uint64_t *last)
{
    kvl_regions *t = &a->regions;
    pthread_mutex_lock(&t->mu);
    uint32_t n = 0;
    for (size_t i = 0; i < t->n; i++) {
        const kvl_region *r = t->v[i];
        if (r->id > after && (r->rights & need) == need && r->mem == KVL_MEM_HOST &&
            !(r->rights & KVL_LOCAL_READONLY) && n < FAULT_MAX_REGIONS)
            n++;
    }
    put_u32(b, n);
    uint32_t k = 0;
    for (size_t i = 0; i < t->n && k < n; i++) {
        const kvl_region *r = t->v[i];
        if (r->id > after && (r->rights & need) == need && r->mem == KVL_MEM_HOST &&
            !(r->rights & KVL_LOCAL_READONLY)) {
            put_u64(b, r->id);
            put_u64(b, (uint64_t)(uintptr_t)r->base);
            put_u64(b, r->size);
            *last = r->id;
            k++;
        }
    }
    pthread_mutex_unlock(&t->mu);
    return n;
}

/* Decodes u32 count + regions (ids strictly ascending) from p[0..len): a
 * malloc'd array in *out.  KVL_ERR_PROTOCOL when malformed. */
static kvl_err get_regions(const uint8_t *p, size_t len, fregion **out, uint32_t *n)
{
    *out = NULL;
    *n = 0;
    if (len < 4)
        return kvl_fail(KVL_ERR_PROTOCOL, "fault mover: region list truncated");
    uint32_t k = get_u32(p);
    if (k > FAULT_MAX_REGIONS || len - 4 != (size_t)k * FAULT_REGION_BYTES)
        return kvl_fail(KVL_ERR_PROTOCOL,
                        "fault mover: %u regions in %zu bytes (at most %u, %u bytes each)", k,
                        len - 4, FAULT_MAX_REGIONS, FAULT_REGION_BYTES);
    fregion *v = k ? calloc(k, sizeof *v) : NULL;
    if (k && !v)
        return kvl_fail(KVL_ERR_NOMEM, "fault mover: out of memory for %u regions", k);
    for (uint32_t i = 0; i < k; i++) {
        const uint8_t *q = p + 4 + (size_t)i * FAULT_REGION_BYTES;
        v[i] = (fregion){.id = get_u64(q), .base = get_u64(q + 8), .size = get_u64(q + 16)};
        if ((i && v[i].id <= v[i - 1].id) || v[i].base + v[i].size < v[i].base) {
            uint64_t id = v[i].id;
            free(v);
            return kvl_fail(KVL_ERR_PROTOCOL,
                            "fault mover: region %llu out of order or wrapping around",
                            (unsigned long long)id);
        }
    }
    *out = v;
    *n = k;
    return KVL_OK;
}

static const fregion *peer_region(const fault_end *e, uint64_t id)
{
    uint32_t lo = 0, hi = e->n_peer;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (e->peer[mid].id == id)
            return &e->peer[mid];
        if (e->peer[mid].id < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

/* ---- the link and its worker ---- */

static void job_free(fjob *j)
{
    if (j) {
        free(j->cp);
        free(j);
    }
}

static void q_insert(fault_link *l, fjob *j)
{
    fjob **pp = &l->q;
    while (*pp && (*pp)->due_ns <= j->due_ns)
        pp = &(*pp)->next;
    j->next = *pp;
    *pp = j;
}

static void end_break(fault_end *e, const char *why)
{
    if (!e->broken)
        snprintf(e->why, sizeof e->why, "fault mover: %s", why);
    e->broken = 1;
}

/* Whether region (id, base, size) is still registered at agent a, as learnt
 * (with l->mu held: the peer's region table lock is taken inside it only). */
static int region_live(kvl_agent *a, const fcopy *c)
{
    kvl_regions *t = &a->regions;
    size_t lo = 0, hi = t->n;
    int ok = 0;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        const kvl_region *r = t->v[mid];
        if (r->id == c->region) {
            ok = (uint64_t)(uintptr_t)r->base == c->base && r->size == c->size &&
                 !(r->rights & KVL_LOCAL_READONLY);
            break;
        }
        if (r->id < c->region)
            lo = mid + 1;
        else
            hi = mid;
    }
    return ok;
}

/* Places j once (l->mu held, so fence and free wait for it to be over). */
static void job_place(fault_link *l, fjob *j, int last)
{
    fault_end *from = l->end[j->from], *to = l->end[1 - j->from];
    if (j->drop)
        return; /* reported complete, nothing written: the receiver's crc refuses it */
    if (!to || to->fenced) {
        end_break(from, "the peer's end is gone or fenced: the write was not placed");
        return;
    }
    kvl_regions *t = &to->a->regions;
    pthread_mutex_lock(&t->mu); /* the region cannot go while we write it */
    for (int i = 0; i < j->n; i++) {
        if (!region_live(to->a, &j->cp[i])) {
            char why[96];
            snprintf(why, sizeof why, "region %llu is not registered at the peer any more",
                     (unsigned long long)j->cp[i].region);
            end_break(from, why);
            break;
        }
        memcpy(j->cp[i].dst, j->cp[i].src, j->cp[i].len);
    }
    if (last && j->corrupt && !from->broken) {
        uint64_t at = j->flip_at;
        for (int i = 0; i < j->n; i++) {
            if (at < j->cp[i].len) {
                j->cp[i].dst[at] ^= 0x5a;
                break;
            }
            at -= j->cp[i].len;
        }
    }
    pthread_mutex_unlock(&t->mu);
}

static uint64_t ts_ns_abs(struct timespec *ts, uint64_t at_ns)
{
    ts->tv_sec = (time_t)(at_ns / 1000000000ull);
    ts->tv_nsec = (long)(at_ns % 1000000000ull);
    return at_ns;
}

static void *worker(void *arg)
{
    fault_link *l = arg;
    pthread_mutex_lock(&l->mu);
    while (!l->stop) {
        fjob *j = l->q;
        if (!j) {
            pthread_cond_wait(&l->cv, &l->mu);
            continue;
        }
        uint64_t now = kvl_now_ns();
        if (j->due_ns > now) {
            struct timespec ts;
            ts_ns_abs(&ts, j->due_ns);
            pthread_cond_timedwait(&l->cv, &l->mu, &ts);
            continue;
        }
        l->q = j->next;
        job_place(l, j, !j->dup);
        if (j->dup) { /* once more, later: the ticket completes after the second */
            fault_end *from = l->end[j->from];
            j->dup = 0;
            j->due_ns = kvl_now_ns() + (uint64_t)from->spec.dup_ms * 1000000ull;
            q_insert(l, j);
            continue;
        }
        fault_end *from = l->end[j->from];
        uint64_t one = 1;
        if (write(from->efd, &one, sizeof one) < 0 && errno != EAGAIN)
            end_break(from, "eventfd write failed");
        job_free(j);
        pthread_cond_broadcast(&l->cv); /* wait() */
    }
    pthread_mutex_unlock(&l->mu);
    return NULL;
}

static kvl_err link_new(fault_link **out)
{
    *out = NULL;
    fault_link *l = calloc(1, sizeof *l);
    if (!l)
        return kvl_fail(KVL_ERR_NOMEM, "fault mover: out of memory");
    pthread_mutex_init(&l->mu, NULL);
    kvl_cond_init(&l->cv);
    if (getrandom(&l->id, sizeof l->id, 0) != sizeof l->id)
        l->id = kvl_now_ns() ^ (uint64_t)(uintptr_t)l;
    int r = pthread_create(&l->th, NULL, worker, l);
    if (r) {
        pthread_cond_destroy(&l->cv);
        pthread_mutex_destroy(&l->mu);
        free(l);
        return kvl_fail(KVL_ERR_SYSTEM, "fault mover: pthread_create: %s", strerror(r));
    }
    pthread_mutex_lock(&links_mu);
    l->next = links;
    links = l;
    pthread_mutex_unlock(&links_mu);
    *out = l;
    return KVL_OK;
}

/* e's end closes (l->mu held): its queued writes are cancelled, and the
 * peer's into its memory fail at once (as a queue pair in error completes
 * them with an error): the peer's ready / wait say -1 and its stream wakes. */
static void end_close(fault_end *e, const char *why)
{
    fault_link *l = e->l;
    fault_end *peer = l->end[1 - e->side];
    int failed = 0;
    while (l->q) { /* every job is ours, or the peer's into our memory */
        fjob *j = l->q;
        failed |= j->from != e->side;
        l->q = j->next;
        job_free(j);
    }
    if (failed && peer) {
        uint64_t one = 1;
        end_break(peer, why);
        if (write(peer->efd, &one, sizeof one) < 0 && errno != EAGAIN)
            end_break(peer, "eventfd write failed");
    }
    pthread_cond_broadcast(&l->cv);
}

/* Takes e off its link (l->mu and links_mu held); the last end stops the
 * worker (joined by the caller). */
static int link_leave(fault_end *e)
{
    fault_link *l = e->l;
    end_close(e, "the peer's end is gone: its writes were not placed");
    l->end[e->side] = NULL;
    if (--l->refs)
        return 0;
    for (fault_link **pp = &links; *pp; pp = &(*pp)->next)
        if (*pp == l) {
            *pp = l->next;
            break;
        }
    l->stop = 1;
    pthread_cond_broadcast(&l->cv);
    return 1;
}

/* ---- an end ---- */

static void end_free(fault_end *e)
{
    if (!e)
        return;
    if (e->watched) /* its event may be pending: the stream keeps the watch's memory */
        e->a->stream->unwatch_fd(e->ep, e->efd);
    fault_link *l = e->l;
    int last = 0;
    if (l) {
        pthread_mutex_lock(&links_mu);
        pthread_mutex_lock(&l->mu);
        if (e->n_post)
            kvl_log(e->a, KVL_LOG_INFO, NULL, -1,
                    "fault mover: %s end freed after %llu writes: %llu dropped, %llu corrupted, "
                    "%llu duplicated, %llu delayed, %llu late",
                    e->side ? "listener" : "initiator", (unsigned long long)e->n_post,
                    (unsigned long long)e->n_drop, (unsigned long long)e->n_corrupt,
                    (unsigned long long)e->n_dup, (unsigned long long)e->n_delay,
                    (unsigned long long)e->n_late);
        last = link_leave(e);
        pthread_mutex_unlock(&l->mu);
        pthread_mutex_unlock(&links_mu);
    }
    if (e->efd >= 0)
        close(e->efd);
    if (last) {
        pthread_join(l->th, NULL);
        while (l->q) {
            fjob *j = l->q;
            l->q = j->next;
            job_free(j);
        }
        pthread_cond_destroy(&l->cv);
        pthread_mutex_destroy(&l->mu);
        free(l);
    }
    free(e->peer);
    free(e);
}

/* The local address of ep, for the generator's seed. */
static uint64_t local_addr_hash(kvl_agent *a, const kvl_ep *ep)
{
    struct sockaddr_storage lo, pe;
    if (a->stream->addrs(ep, &lo, &pe) != 0 || lo.ss_family != AF_INET)
        return 0;
    const struct sockaddr_in *sa = (const struct sockaddr_in *)&lo;
    return (uint64_t)ntohl(sa->sin_addr.s_addr);
}

static kvl_err end_new(kvl_agent *a, kvl_ep *ep, int side, fault_end **out)
{
    *out = NULL;
    fault_end *e = calloc(1, sizeof *e);
    if (!e)
        return kvl_fail(KVL_ERR_NOMEM, "fault mover: out of memory");
    e->a = a;
    e->ep = ep;
    e->side = side;
    e->next_ticket = 1;
    e->need = side ? KVL_REMOTE_WRITE : 0;
    e->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    kvl_err err = e->efd < 0 ? kvl_fail_errno("fault mover: eventfd")
                             : spec_parse(a->cfg.fault_spec, &e->spec);
    if (err) {
        if (e->efd >= 0)
            close(e->efd);
        free(e);
        return err;
    }
    if (!e->spec.late_ms)
        e->spec.late_ms = 2 * a->cfg.connect_timeout_ms + 1000;
    e->rng = e->spec.seed ^ ((uint64_t)side << 63) ^ (local_addr_hash(a, ep) * 0x9e3779b97f4a7c15ull);
    *out = e;
    return KVL_OK;
}

static void note_set(fault_end *e)
{
    snprintf(e->note, sizeof e->note, "fault mover (memcpy in this process), %u peer regions%s%.60s",
             e->n_peer, e->a->cfg.fault_spec[0] ? ", faults: " : ", no faults",
             e->a->cfg.fault_spec);
}

/* ---- initiator ---- */

static kvl_err fault_start(kvl_agent *a, kvl_ep *ep, const char *local, uint64_t deadline_ns,
                           kvl_mover **out, char *note, size_t note_len)
{
    (void)local;
    const kvl_stream_ops *st = a->stream;
    *out = NULL;
    fault_end *e = NULL;
    fault_link *l = NULL;
    kvl_err err = end_new(a, ep, 0, &e);
    if (!err)
        err = link_new(&l);
    kvl_buf b = {0};
    frame_begin(&b);
    if (err) {
        /* no fault mover here: an offer naming no link, which the listener
         * refuses, and the path runs in-stream */
        snprintf(note, note_len, "fault mover not set up here: %s", kvl_last_error());
        end_free(e);
        e = NULL;
        put_u64(&b, 0);
        put_u32(&b, 0);
        put_u32(&b, 0);
    } else {
        e->l = l;
        l->end[0] = e;
        l->refs = 1;
        /* our host regions: where the peer's READ_RESP writes go (any region
         * may be a pull's destination) */
        put_u64(&b, l->id);
        put_u32(&b, (uint32_t)getpid());
        e->n_shown = put_regions(a, &b, 0, 0, &e->last_shown);
    }
    kvl_frame_finish(&b, KVL_F_MOVER_OFFER, 0);
    err = b.oom ? kvl_fail(KVL_ERR_NOMEM, "MOVER_OFFER: out of memory")
                : st->send_all(ep, b.p, b.len, deadline_ns);
    kvl_buf_free(&b);
    uint8_t hdr[KVL_HDR_BYTES];
    kvl_frame_hdr h;
    if (!err && !(err = st->recv_all(ep, hdr, sizeof hdr, deadline_ns)))
        err = kvl_hdr_decode(hdr, &h);
    if (!err && ((h.type != KVL_F_MOVER_ACCEPT && h.type != KVL_F_MOVER_REFUSE) ||
                 h.payload_len || h.flags || h.body_len < 1 ||
                 h.body_len > KVL_HANDSHAKE_BODY_MAX))
        err = kvl_fail(KVL_ERR_PROTOCOL, "the answer to MOVER_OFFER is frame type %u", h.type);
    uint8_t *body = err ? NULL : malloc(h.body_len);
    if (!err && !body)
        err = kvl_fail(KVL_ERR_NOMEM, "fault mover: out of memory for an answer");
    if (!err)
        err = st->recv_all(ep, body, h.body_len, deadline_ns);
    if (!err && (kvl_crc32c(0, body, h.body_len) != h.body_crc || body[0] != KVL_MOVER_FAULT))
        err = kvl_fail(KVL_ERR_PROTOCOL, "fault mover answer: %s",
                       body[0] != KVL_MOVER_FAULT ? "not for the fault mover"
                                                  : "body failed its crc32c check");
    if (err) {
        free(body);
        end_free(e);
        return err;
    }
    if (h.type == KVL_F_MOVER_REFUSE) {
        char why[200] = "";
        if (h.body_len >= 7) {
            size_t wl = (size_t)body[5] | (size_t)body[6] << 8;
            if (wl > h.body_len - 7u)
                wl = h.body_len - 7u;
            snprintf(why, sizeof why, "%.*s", (int)wl, (const char *)body + 7);
        }
        if (e)
            snprintf(note, note_len, "the peer refused the fault mover: %s", why);
        free(body);
        end_free(e);
        return KVL_OK; /* the path stays in-stream */
    }
    if (!e) { /* we offered nothing: an ACCEPT is a broken peer */
        free(body);
        return kvl_fail(KVL_ERR_PROTOCOL, "MOVER_ACCEPT to an offer naming no link");
    }
    if (h.body_len < 13 || get_u64(body + 1) != l->id ||
        get_u32(body + 9) != (uint32_t)getpid() ||
        (err = get_regions(body + 13, h.body_len - 13, &e->peer, &e->n_peer))) {
        if (!err)
            err = kvl_fail(KVL_ERR_PROTOCOL, "MOVER_ACCEPT: not for this link or process");
        free(body);
        end_free(e);
        return err;
    }
    free(body);
    note_set(e);
    *out = (kvl_mover *)e;
    return KVL_OK;
}

/* As ucx_check: a region learnt that the table lists must be open for
 * remote writes and of the table's size; one it does not list (registered
 * after the table was read) stays, bounded by its own size. */
static int fault_check(kvl_mover *m, const kvl_region_info *regions, size_t n, char *note,
                       size_t note_len)
{
    fault_end *e = E(m);
    for (uint32_t i = 0; i < e->n_peer; i++) {
        if (kvl_region_learnt_ok(regions, n, e->peer[i].id, e->peer[i].size, "fault mover",
                                 note, note_len))
            continue;
        kvl_log(e->a, KVL_LOG_WARNING, NULL, -1, "%s", note);
        return -1;
    }
    return 0;
}

static void fault_note(const kvl_mover *m, char *out, size_t len)
{
    snprintf(out, len, "%s", CE(m)->note);
}

/* ---- listener ---- */

static int refuse(kvl_agent *a, kvl_ep *ep, uint32_t status, const char *why)
{
    kvl_buf b = {0};
    frame_begin(&b);
    put_u32(&b, status);
    size_t wl = strlen(why);
    if (wl > 1000)
        wl = 1000;
    uint8_t l2[2] = {(uint8_t)wl, (uint8_t)(wl >> 8)};
    kvl_buf_put(&b, l2, 2);
    kvl_buf_put(&b, why, wl);
    kvl_frame_finish(&b, KVL_F_MOVER_REFUSE, 0);
    kvl_tp_frame f = {.head = b};
    return a->stream->send(ep, &f) == 0 ? 0 : -1;
}

static int fault_attach(kvl_mover *m, kvl_ep *ep);

static int fault_answer(kvl_agent *a, kvl_ep *ep, const uint8_t *body, size_t len, int proven)
{
    /* no secret needed: the link id must name a link of this very process */
    (void)proven;
    if (a->cfg.transport != KVL_TRANSPORT_FAULT) {
        char why[96];
        snprintf(why, sizeof why, "agent '%s' does not run transport='fault'", a->name);
        return refuse(a, ep, KVL_ERR_INVALID_ARG, why);
    }
    if (len < 16) /* id, pid, count */
        return refuse(a, ep, KVL_ERR_PROTOCOL, "MOVER_OFFER: truncated");
    uint64_t id = get_u64(body);
    uint32_t pid = get_u32(body + 8);
    if (pid != (uint32_t)getpid()) {
        char why[160];
        snprintf(why, sizeof why,
                 "the fault mover writes by memcpy, so only within one process: the offer "
                 "comes from pid %u, '%s' is pid %u",
                 pid, a->name, (uint32_t)getpid());
        return refuse(a, ep, KVL_ERR_INVALID_ARG, why);
    }
    fault_end *e = NULL;
    kvl_err err = end_new(a, ep, 1, &e);
    if (!err)
        err = get_regions(body + 12, len - 12, &e->peer, &e->n_peer);
    if (err) {
        char why[200];
        snprintf(why, sizeof why, "fault mover at '%s': %s", a->name, kvl_last_error());
        end_free(e);
        return refuse(a, ep, err, why);
    }
    /* the initiator's link, found in this process's table */
    fault_link *l = NULL;
    pthread_mutex_lock(&links_mu);
    for (fault_link *x = links; x; x = x->next)
        if (x->id == id)
            l = x;
    if (l) {
        pthread_mutex_lock(&l->mu);
        if (l->end[0] && !l->end[1]) { /* not joined yet, its initiator still there */
            l->end[1] = e;
            l->refs++;
            e->l = l;
        }
        pthread_mutex_unlock(&l->mu);
    }
    pthread_mutex_unlock(&links_mu);
    if (!e->l) {
        end_free(e);
        return refuse(a, ep, KVL_ERR_INVALID_ARG,
                      "no such fault link in this process (the offer comes from elsewhere)");
    }
    kvl_buf b = {0};
    frame_begin(&b);
    put_u64(&b, id);
    put_u32(&b, (uint32_t)getpid());
    e->n_shown = put_regions(a, &b, KVL_REMOTE_WRITE, 0, &e->last_shown);
    kvl_frame_finish(&b, KVL_F_MOVER_ACCEPT, 0);
    if (b.oom || fault_attach((kvl_mover *)e, ep)) {
        kvl_buf_free(&b);
        end_free(e);
        return refuse(a, ep, KVL_ERR_SYSTEM, "fault mover: out of memory or cannot watch");
    }
    note_set(e);
    a->stream->set_mover(ep, &kvl_fault_mover, (kvl_mover *)e, NULL);
    kvl_tp_frame f = {.head = b};
    return a->stream->send(ep, &f) == 0 ? 1 : -1;
}

/* ---- engine ---- */

static void on_event(void *arg)
{
    fault_end *e = arg;
    uint64_t v;
    while (read(e->efd, &v, sizeof v) == sizeof v)
        ;
    e->t_event_ns = kvl_now_ns();
}

static int fault_attach(kvl_mover *m, kvl_ep *ep)
{
    fault_end *e = E(m);
    if (e->watched)
        return 0;
    e->ep = ep;
    if (e->a->stream->watch_fd(ep, e->efd, on_event, e) != 0) {
        kvl_fail(KVL_ERR_SYSTEM, "fault mover: cannot watch its eventfd");
        return -1;
    }
    e->watched = 1;
    return 0;
}

static void fault_sample(const kvl_mover *m, kvl_tp_sample *out)
{
    /* writes complete on the worker: their events are the path's progress */
    const fault_end *e = CE(m);
    uint64_t now = kvl_now_ns();
    uint64_t ms = e->t_event_ns && now > e->t_event_ns ? (now - e->t_event_ns) / 1000000ull
                                                       : UINT32_MAX;
    if (ms < out->last_ack_recv_ms)
        out->last_ack_recv_ms = (uint32_t)ms;
    if (ms < out->last_data_recv_ms)
        out->last_data_recv_ms = (uint32_t)ms;
}

static int fault_covers(const kvl_mover *m, const kvl_tp_frame *f)
{
    const fault_end *e = CE(m);
    if (!f->dst)
        return 0;
    const fregion *r = NULL;
    for (uint32_t i = 0; i < f->n_dst; i++) {
        if (!r || r->id != f->dst[i].region)
            r = peer_region(e, f->dst[i].region);
        if (!r || f->dst[i].offset > r->size || f->dst[i].len > r->size - f->dst[i].offset)
            return 0;
    }
    return 1;
}

static kvl_err fault_post(kvl_mover *m, kvl_mv_send *ms)
{
    fault_end *e = E(m);
    const kvl_tp_frame *f = ms->f;
    fjob *j = calloc(1, sizeof *j);
    /* pieces split at source iovec boundaries: at most n_dst + n_src copies */
    size_t cap = (size_t)f->n_dst + (size_t)ms->n_src;
    if (j)
        j->cp = calloc(cap ? cap : 1, sizeof *j->cp);
    if (!j || !j->cp) {
        job_free(j);
        return kvl_fail(KVL_ERR_NOMEM, "fault mover: out of memory for a write");
    }
    int si = 0;
    size_t soff = 0;
    uint64_t total = 0;
    ms->crc = 0;
    for (uint32_t i = 0; i < f->n_dst; i++) {
        const fregion *r = peer_region(e, f->dst[i].region);
        if (!r || f->dst[i].offset > r->size || f->dst[i].len > r->size - f->dst[i].offset) {
            job_free(j);
            return kvl_fail(KVL_ERR_UNKNOWN_REGION, "fault mover: no region %llu at the peer",
                            (unsigned long long)f->dst[i].region);
        }
        uint64_t off = f->dst[i].offset, left = f->dst[i].len;
        while (left) {
            if (si >= ms->n_src || (size_t)j->n >= cap) {
                job_free(j);
                return kvl_fail(KVL_ERR_INVALID_ARG, "fault mover: payload shorter than its pieces");
            }
            size_t take = ms->src[si].iov_len - soff;
            if (take > left)
                take = (size_t)left;
            const uint8_t *p = (const uint8_t *)ms->src[si].iov_base + soff;
            j->cp[j->n++] = (fcopy){.region = r->id,
                                    .base = r->base,
                                    .size = r->size,
                                    .dst = (uint8_t *)(uintptr_t)(r->base + off),
                                    .src = p,
                                    .len = take};
            ms->crc = kvl_crc32c(ms->crc, p, take);
            off += take;
            left -= take;
            total += take;
            soff += take;
            if (soff == ms->src[si].iov_len) {
                si++;
                soff = 0;
            }
        }
    }
    if (total != f->payload_len) {
        job_free(j);
        return kvl_fail(KVL_ERR_INVALID_ARG, "fault mover: pieces hold %llu bytes, the payload %llu",
                        (unsigned long long)total, (unsigned long long)f->payload_len);
    }
    /* the faults of this write, drawn in a fixed order */
    const fault_spec *s = &e->spec;
    int late = rnd01(e) < s->late;
    j->drop = rnd01(e) < s->drop;
    j->corrupt = !j->drop && total && rnd01(e) < s->corrupt;
    j->dup = !j->drop && rnd01(e) < s->dup;
    int delay = rnd01(e) < s->delay;
    j->flip_at = total ? splitmix(&e->rng) % total : 0;
    uint64_t now = kvl_now_ns();
    j->due_ns = now + (late ? (uint64_t)s->late_ms * 1000000ull
                            : delay ? (uint64_t)s->delay_ms * 1000000ull : 0);
    fault_link *l = e->l;
    pthread_mutex_lock(&l->mu);
    j->from = e->side;
    j->ticket = e->next_ticket++;
    ms->ticket = j->ticket;
    e->n_post++;
    e->n_drop += (uint64_t)j->drop;
    e->n_corrupt += (uint64_t)j->corrupt;
    e->n_dup += (uint64_t)j->dup;
    e->n_delay += (uint64_t)(delay && !late);
    e->n_late += (uint64_t)late;
    q_insert(l, j);
    pthread_cond_broadcast(&l->cv);
    pthread_mutex_unlock(&l->mu);
    if (late)
        kvl_log(e->a, KVL_LOG_INFO, NULL, -1,
                "fault mover: a write of %llu bytes (ticket %llu) is due in %u ms: late",
                (unsigned long long)total, (unsigned long long)j->ticket, s->late_ms);
    return KVL_OK;
}

/* l->mu held: 1 while e's ticket is queued. */
static int pending(const fault_end *e, uint64_t ticket)
{
    for (const fjob *j = e->l->q; j; j = j->next)
        if (j->from == e->side && j->ticket == ticket)
            return 1;
    return 0;
}

static int fault_ready(kvl_mover *m, uint64_t ticket, char *why, size_t why_len)
{
    fault_end *e = E(m);
    pthread_mutex_lock(&e->l->mu);
    int r = e->broken ? -1 : pending(e, ticket) ? 0 : 1;
    if (r < 0 && why)
        snprintf(why, why_len, "%s", e->why);
    pthread_mutex_unlock(&e->l->mu);
    return r;
}

static int fault_wait(kvl_mover *m, uint64_t ticket, uint64_t deadline_ns)
{
    fault_end *e = E(m);
    fault_link *l = e->l;
    pthread_mutex_lock(&l->mu);
    int r;
    for (;;) {
        r = e->broken ? -1 : pending(e, ticket) ? 0 : 1;
        if (r || kvl_now_ns() >= deadline_ns)
            break;
        struct timespec ts;
        ts_ns_abs(&ts, deadline_ns);
        pthread_cond_timedwait(&l->cv, &l->mu, &ts);
    }
    pthread_mutex_unlock(&l->mu);
    return r;
}

/* Nothing lands through this end from now on, either way: our queued writes
 * are cancelled (the one being placed is over: it holds the lock) and the
 * peer's are not placed in our memory.  The stream frees the end next. */
static void fault_fence(kvl_mover *m, const char *why)
{
    fault_end *e = E(m);
    fault_link *l = e->l;
    pthread_mutex_lock(&l->mu);
    end_close(e, "the peer's end was fenced: its writes were not placed");
    e->fenced = 1;
    end_break(e, "fenced");
    pthread_mutex_unlock(&l->mu);
    snprintf(e->note, sizeof e->note, "fault mover fenced: %s", why);
}

/* Bounded by one write being placed (the lock), whatever timeout_ms says:
 * queued writes are cancelled, not waited for. */
static void fault_free(kvl_mover *m, uint32_t timeout_ms)
{
    (void)timeout_ms;
    end_free(E(m));
}

static kvl_err fault_usable(const kvl_config *cfg, uint32_t secret_len)
{
    (void)secret_len;
    fault_spec s;
    if (memchr(cfg->fault_spec, 0, sizeof cfg->fault_spec) == NULL)
        return kvl_fail(KVL_ERR_INVALID_ARG, "config.fault_spec is not NUL-terminated");
    return spec_parse(cfg->fault_spec, &s);
}

/* ---- regions registered after the set-up ---- */

static int fault_keys(kvl_mover *m, const uint8_t *body, size_t len)
{
    fault_end *e = E(m);
    fregion *add = NULL;
    uint32_t n = 0;
    if (get_regions(body, len, &add, &n))
        return -1;
    if ((uint64_t)e->n_peer + n > FAULT_MAX_REGIONS) {
        free(add);
        kvl_fail(KVL_ERR_PROTOCOL, "fault mover MOVER_KEYS: more than %u regions",
                 FAULT_MAX_REGIONS);
        return -1;
    }
    for (uint32_t i = 0; i < n; i++)
        if (peer_region(e, add[i].id)) {
            kvl_fail(KVL_ERR_PROTOCOL, "fault mover MOVER_KEYS: region %llu named twice",
                     (unsigned long long)add[i].id);
            free(add);
            return -1;
        }
    fregion *nv = realloc(e->peer, ((size_t)e->n_peer + n + 1) * sizeof *nv);
    if (!nv) { /* those regions go in-stream */
        free(add);
        return 0;
    }
    /* merge (both ascending) from the back */
    uint32_t a = e->n_peer, b = n, k = e->n_peer + n;
    while (b) {
        if (a && nv[a - 1].id > add[b - 1].id)
            nv[--k] = nv[--a];
        else
            nv[--k] = add[--b];
    }
    e->peer = nv;
    e->n_peer += n;
    free(add);
    note_set(e);
    return 0;
}

static void fault_sync(kvl_mover *m)
{
    fault_end *e = E(m);
    /* deregistered regions need nothing: a write checks the table first */
    kvl_buf b = {0};
    frame_begin(&b);
    uint64_t last = e->last_shown;
    uint32_t n = put_regions(e->a, &b, e->need, e->last_shown, &last);
    kvl_frame_finish(&b, KVL_F_MOVER_KEYS, 0);
    if (!n || b.oom) {
        kvl_buf_free(&b);
        return;
    }
    e->last_shown = last;
    e->n_shown += n;
    kvl_tp_frame f = {.head = b};
    e->a->stream->send(e->ep, &f);
}

const kvl_mover_ops kvl_fault_mover = {
    .name = "fault",
    .label = "fault mover",
    .what = "fault-injecting writes",
    .kind = KVL_MOVER_FAULT,
    .caps = KVL_MV_ONE_SIDED | KVL_MV_NO_HEDGE | KVL_MV_OFFER | KVL_MV_MAPS_REGIONS |
            KVL_MV_ASKED,
    .usable = fault_usable,
    .start = fault_start,
    .answer = fault_answer,
    .check = fault_check,
    .sync = fault_sync,
    .keys = fault_keys,
    .note = fault_note,
    .attach = fault_attach,
    .sample = fault_sample,
    .covers = fault_covers,
    .post = fault_post,
    .ready = fault_ready,
    .wait = fault_wait,
    .fence = fault_fence,
    .free = fault_free,
};
