/* monitor.c: the path monitor, run on every engine tick (monitor_interval_ms).
 *
 * For every path it samples the kernel's view of the connection (TCP_INFO:
 * RTT, delivery rate, bytes acknowledged and received), probes idle paths
 * with PING frames, reads the local NIC's counters to see traffic that is
 * not ours, and hands down paths to the prober (probe.c).  Every quarter
 * tick it also checks busy paths for stalls (kvl_monitor_stall_check); a
 * stalled path is cut (abortive close) so its chunks go elsewhere at once
 * instead of waiting for TCP to give up.
 */
#include <ifaddrs.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>

#include "internal.h"

#define PING_EVERY_TICKS 5     /* an idle path is probed every 5 ticks (500 ms) */
#define PING_LOST_MS 1500      /* an unanswered probe this old marks the path down */
#define NIC_EWMA 0.3
#define OVERHEAD 1.06          /* wire bytes per payload byte (headers at MTU 1500) */
#define DEGRADED_SHARE 0.5     /* below half the best path's rate: degraded */
#define BYTE_STALL_TICKS 2     /* no TCP progress for 2 ticks: the path stalled */
#define STALL_LIMIT_MAX_MS 2000 /* however jittery a path was, 2 s of silence is a stall */
#define STALL_CUT_MS 2000      /* a stalled path silent this long is cut and re-probed */

static int read_counter(const char *ifname, const char *which, uint64_t *out)
{
    char path[128];
    snprintf(path, sizeof path, "/sys/class/net/%s/statistics/%s", ifname, which);
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    unsigned long long v = 0;
    int ok = fscanf(f, "%llu", &v) == 1;
    fclose(f);
    *out = v;
    return ok ? 0 : -1;
}

void kvl_monitor_init(kvl_agent *a)
{
    a->nics = calloc(a->n_addrs, sizeof *a->nics);
    if (!a->nics)
        return;
    struct ifaddrs *ifs = NULL;
    if (getifaddrs(&ifs) != 0)
        ifs = NULL;
    for (size_t i = 0; i < a->n_addrs; i++) {
        const char *name = "";
        for (struct ifaddrs *it = ifs; it; it = it->ifa_next) {
            if (!it->ifa_addr || it->ifa_addr->sa_family != AF_INET)
                continue;
            char buf[48];
            inet_ntop(AF_INET, &((struct sockaddr_in *)(void *)it->ifa_addr)->sin_addr, buf,
                      sizeof buf);
            if (strcmp(buf, a->addrs[i]) == 0) {
                name = it->ifa_name;
                break;
            }
        }
        size_t k;
        for (k = 0; k < a->n_nics; k++)
            if (strcmp(a->nics[k].ifname, name) == 0)
                break;
        if (k == a->n_nics) {
            snprintf(a->nics[k].ifname, sizeof a->nics[k].ifname, "%s", name);
            a->n_nics++;
        }
        a->nic_of_addr[i] = (int)k;
    }
    if (ifs)
        freeifaddrs(ifs);
}

/* Our payload bytes sent through each NIC, across all peers. */
static void our_tx_per_nic(kvl_agent *a, uint64_t *ours)
{
    for (size_t k = 0; k < a->n_nics; k++)
        ours[k] = 0;
    for (kvl_peer *p = a->eng_peers; p; p = p->eng_next)
        for (uint32_t i = 0; i < p->n_paths; i++) {
            kvl_path *pa = &p->paths[i];
            uint64_t sent = pa->bytes_sent_prev + (pa->conn ? kvl_conn_bytes_sent(pa->conn) : 0);
            ours[a->nic_of_addr[pa->laddr]] += sent;
        }
}

static void sample_nics(kvl_agent *a, uint64_t now)
{
    if (!a->nics || !a->n_nics)
        return;
    uint64_t ours[KVL_MAX_PATHS];
    our_tx_per_nic(a, ours);
    double dt = a->t_nic_ns ? (double)(now - a->t_nic_ns) / 1e9 : 0;
    for (size_t k = 0; k < a->n_nics; k++) {
        struct kvl_nic *n = &a->nics[k];
        uint64_t tx;
        if (!n->ifname[0] || read_counter(n->ifname, "tx_bytes", &tx))
            continue;
        if (dt > 0 && tx >= n->tx) {
            double mine = (double)(ours[k] - n->ours_tx) * OVERHEAD;
            double other = ((double)(tx - n->tx) - mine) / dt;
            if (other < 0)
                other = 0;
            n->other_Bps = (1 - NIC_EWMA) * n->other_Bps + NIC_EWMA * other;
        }
        n->tx = tx;
        n->ours_tx = ours[k];
    }
    a->t_nic_ns = now;
}

static void send_ping(kvl_path *pa, uint64_t now)
{
    kvl_buf b = {0};
    kvl_frame_start(&b);
    kvl_enc_token(&b, now);
    kvl_frame_finish(&b, KVL_F_PING, 0);
    if (kvl_conn_send_frame(pa->conn, &b) == 0)
        kvl_path_ping_sent(pa, now);
}

/* The control connection carries a PING as often as an idle data path
 * does, so the peer's idle rule (idle_conn_timeout_s) never closes it: its
 * PONG only keeps it alive (kvl_monitor_on_pong ignores it). */
static void ping_ctrl(kvl_agent *a, kvl_peer *p, uint64_t now)
{
    uint64_t every = (uint64_t)a->cfg.monitor_interval_ms * 1000000ull * PING_EVERY_TICKS;
    if (now - p->ctrl_path.t_last_ping_ns < every)
        return;
    kvl_buf b = {0};
    kvl_frame_start(&b);
    kvl_enc_token(&b, now);
    kvl_frame_finish(&b, KVL_F_PING, 0);
    if (kvl_conn_send_frame(p->ctrl, &b) == 0)
        kvl_path_keepalive_sent(&p->ctrl_path, now);
}

void kvl_monitor_probe_all(kvl_peer *p, uint64_t now)
{
    for (uint32_t i = 0; i < p->n_paths; i++) {
        kvl_path *pa = &p->paths[i];
        if (pa->conn && !kvl_conn_is_dead(pa->conn) && !pa->ping_sent_ns)
            send_ping(pa, now);
    }
}

void kvl_monitor_on_pong(kvl_peer *p, int path, uint64_t sent_ns, uint64_t now)
{
    if (path < 0 || (uint32_t)path >= p->n_paths)
        return;
    kvl_path_pong(&p->paths[path], sent_ns, now);
}

/* Chunk-level limit: max(3 ticks, stall_factor x the expected time of the
 * chunks in flight at the path's measured rate). */
static uint64_t chunk_limit_ns(kvl_agent *a, const kvl_path *pa)
{
    uint64_t tick = (uint64_t)a->cfg.monitor_interval_ms * 1000000ull;
    uint64_t limit = 3 * tick;
    /* the kernel's delivery rate stands in until a chunk has been timed;
     * with neither, only the byte-level rule applies (a slow path that has
     * yet to finish its first chunk must not be cut for being slow) */
    double rate = pa->bw_Bps > 0 ? pa->bw_Bps : pa->delivery_Bps;
    if (rate <= 0 || !pa->inflight_chunks)
        return UINT64_MAX;
    double chunk = (double)pa->inflight_bytes / pa->inflight_chunks;
    uint64_t expect = (uint64_t)(chunk / rate * 1e9 * a->cfg.stall_factor);
    return expect > limit ? expect : limit;
}

/* Silence that counts as a stall on this path: two ticks, or more on a path
 * that was seen to recover from longer silences (a receiver that pauses, a
 * host whose cores are busy), never above STALL_LIMIT_MAX_MS. */
static uint64_t stall_limit_ms(const kvl_agent *a, const kvl_path *pa)
{
    uint64_t base = BYTE_STALL_TICKS * (uint64_t)a->cfg.monitor_interval_ms;
    uint64_t adapt = (uint64_t)(1.5 * pa->jitter_ms);
    uint64_t limit = adapt > base ? adapt : base;
    return limit < STALL_LIMIT_MAX_MS ? limit : STALL_LIMIT_MAX_MS;
}

static void stall(kvl_peer *p, kvl_path *pa, const kvl_tp_sample *s, const char *what,
                  uint64_t ms, uint64_t limit_ms, uint64_t now)
{
    char why[160];
    snprintf(why, sizeof why, "%s for %llu ms with %llu bytes in flight: path stalled", what,
             (unsigned long long)ms, (unsigned long long)pa->inflight_bytes);
    kvl_path_stall_detected(pa, s->bytes_acked, s->bytes_received, (uint32_t)limit_ms);
    kvl_sched_path_stalled(p, pa->index, why);
    send_ping(pa, now); /* its PONG shows the path alive even with nothing else to move */
}

/* A stalled path: back in service as soon as anything moves on it; cut and
 * re-probed if it stays silent for STALL_CUT_MS. */
static void watch_stalled(kvl_peer *p, kvl_path *pa, const kvl_tp_sample *s, uint64_t now)
{
    int moved = s->bytes_acked != pa->stall_acked || s->bytes_received != pa->stall_received ||
                !pa->ping_sent_ns;
    uint64_t ms = (now - pa->t_stall_ns) / 1000000ull;
    if (moved) {
        kvl_path_recovered(p, pa, ms, now);
        kvl_engine_snapshot_paths(p->agent);
    } else if (ms >= STALL_CUT_MS) {
        char why[160];
        snprintf(why, sizeof why, "stalled and silent for %llu more ms: path cut",
                 (unsigned long long)ms);
        kvl_conn_abort(pa->conn, why);
    }
}

/* Two rules.  Byte level: a busy path on which no TCP acknowledgement and no
 * data arrived for stall_limit_ms() (two ticks unless the path has shown it
 * recovers from longer silences) stalled; with the kernel's own millisecond
 * timestamps and a check every quarter tick that is ~200-225 ms after the
 * last byte moved.  Chunk level: a path that moves bytes but verifies no
 * chunk for chunk_limit_ns() stalls too.  Either way its chunks go elsewhere
 * at once and the connection stays (kvl_sched_path_stalled). */
int kvl_monitor_any_busy(const kvl_agent *a)
{
    for (const kvl_peer *p = a->eng_peers; p; p = p->eng_next)
        for (uint32_t i = 0; i < p->n_paths; i++)
            if (p->paths[i].inflight_chunks || p->paths[i].state == KVL_PATH_STALLED)
                return 1;
    return 0;
}

void kvl_monitor_stall_check(kvl_agent *a, uint64_t now)
{
    for (kvl_peer *p = a->eng_peers; p; p = p->eng_next) {
        for (uint32_t i = 0; i < p->n_paths; i++) {
            kvl_path *pa = &p->paths[i];
            kvl_tp_sample s;
            if (!pa->conn || kvl_conn_sample(pa->conn, &s) != 0)
                continue;
            if (pa->state == KVL_PATH_STALLED) {
                watch_stalled(p, pa, &s, now);
                continue;
            }
            if (!pa->inflight_chunks)
                continue;
            uint64_t busy_ms = (now - pa->busy_start_ns) / 1000000ull;
            uint64_t quiet = s.last_ack_recv_ms < s.last_data_recv_ms ? s.last_ack_recv_ms
                                                                       : s.last_data_recv_ms;
            if (quiet > busy_ms)
                quiet = busy_ms; /* silence before the path got busy does not count */
            uint64_t limit = stall_limit_ms(a, pa);
            if (quiet >= limit) {
                stall(p, pa, &s, "no byte acknowledged or received", quiet, limit, now);
                continue;
            }
            uint64_t since = pa->t_chunk_ns > pa->busy_start_ns ? pa->t_chunk_ns : pa->busy_start_ns;
            if (now - since > chunk_limit_ns(a, pa))
                stall(p, pa, &s, "no chunk verified", (now - since) / 1000000ull, limit, now);
        }
    }
}

static void watch_path(kvl_agent *a, kvl_path *pa, uint64_t now)
{
    kvl_tp_sample s;
    kvl_path_tick(pa);
    if (!pa->conn || kvl_conn_sample(pa->conn, &s) != 0)
        return;
    kvl_path_sampled(pa, &s, now, 2 * (uint64_t)a->cfg.monitor_interval_ms * 1000000ull);
    if (!pa->inflight_chunks && pa->state != KVL_PATH_STALLED) { /* stalled: watch_stalled */
        if (pa->ping_sent_ns && now - pa->ping_sent_ns > PING_LOST_MS * 1000000ull) {
            char why[160];
            snprintf(why, sizeof why, "probe unanswered for %llu ms",
                     (unsigned long long)((now - pa->ping_sent_ns) / 1000000ull));
            kvl_conn_abort(pa->conn, why);
            return;
        }
        uint64_t every = (uint64_t)a->cfg.monitor_interval_ms * 1000000ull * PING_EVERY_TICKS;
        if (!pa->ping_sent_ns && now - pa->t_last_ping_ns >= every)
            send_ping(pa, now);
    }
}

/* A down path (or control connection) is handed to the prober after its
 * backoff; success brings it back UP (probe.c), failure doubles the wait. */
static void schedule_probe(kvl_agent *a, kvl_peer *p, kvl_path *pa, int index, uint64_t now)
{
    if (pa->state != KVL_PATH_DOWN || now < pa->next_probe_ns || !pa->rhost[0] ||
        atomic_load(&p->gone)) /* the peer restarted: its instance never answers again */
        return;
    kvl_path_set_state(p, pa, KVL_PATH_PROBING, "reconnecting");
    kvl_prober_request(a, p, index);
}

void kvl_monitor_tick(kvl_agent *a, uint64_t now)
{
    sample_nics(a, now);
    for (kvl_peer *p = a->eng_peers; p; p = p->eng_next) {
        if (p->replaced)
            continue;
        double best = 0;
        for (uint32_t i = 0; i < p->n_paths; i++) {
            kvl_path *pa = &p->paths[i];
            if (pa->conn)
                watch_path(a, pa, now);
            if (a->nics)
                kvl_path_nic_sampled(pa, a->nics[a->nic_of_addr[pa->laddr]].other_Bps);
            if (pa->conn && pa->bw_Bps > best)
                best = pa->bw_Bps;
        }
        for (uint32_t i = 0; i < p->n_paths; i++) {
            kvl_path *pa = &p->paths[i];
            if (pa->state == KVL_PATH_UP || pa->state == KVL_PATH_DEGRADED) {
                int slow = pa->bw_Bps > 0 && pa->bw_Bps < DEGRADED_SHARE * best;
                char why[96];
                snprintf(why, sizeof why, "%.2f GB/s against the best path's %.2f", pa->bw_Bps / 1e9,
                         best / 1e9);
                kvl_path_set_state(p, pa, slow ? KVL_PATH_DEGRADED : KVL_PATH_UP, why);
            }
            schedule_probe(a, p, pa, (int)i, now);
        }
        if (!p->ctrl || kvl_conn_is_dead(p->ctrl)) {
            p->ctrl = NULL;
            if (p->ctrl_path.state == KVL_PATH_UP)
                kvl_path_set_state(p, &p->ctrl_path, KVL_PATH_DOWN, "connection lost");
            schedule_probe(a, p, &p->ctrl_path, -1, now);
        } else {
            ping_ctrl(a, p, now);
        }
    }
}
