/* snapshot.c: the path snapshots callers read (kvl_paths, kvl_paths_wait),
 * published by the engine thread whenever a path changes and every tick. */
#include <arpa/inet.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

void kvl_engine_snapshot_paths(kvl_agent *a)
{
    size_t n = 0;
    for (kvl_peer *p = a->eng_peers; p; p = p->eng_next)
        if (!p->replaced)
            n += p->n_paths;
    pthread_mutex_lock(&a->stats_mu);
    if (n > a->cap_snap) {
        kvl_path_info *ns = realloc(a->snap, n * sizeof *ns);
        if (!ns) {
            pthread_mutex_unlock(&a->stats_mu);
            return;
        }
        a->snap = ns;
        a->cap_snap = n;
    }
    size_t k = 0;
    int changed = n != a->n_snap; /* then the old entries are not compared */
    for (kvl_peer *p = a->eng_peers; p; p = p->eng_next) {
        if (p->replaced)
            continue;
        for (uint32_t i = 0; i < p->n_paths; i++) {
            kvl_path *pa = &p->paths[i];
            kvl_path_info *o = &a->snap[k++];
            changed = changed || o->state != pa->state || o->index != i ||
                      strcmp(o->peer, p->name) != 0;
            memset(o, 0, sizeof *o);
            snprintf(o->peer, sizeof o->peer, "%s", p->name);
            o->index = i;
            o->state = pa->state;
            snprintf(o->local_addr, sizeof o->local_addr, "%s", pa->local);
            snprintf(o->remote_addr, sizeof o->remote_addr, "%s", pa->remote);
            if (pa->via[0]) {
                snprintf(o->relay, sizeof o->relay, "%s", pa->via_name);
                snprintf(o->relay_addr, sizeof o->relay_addr, "%s:%u", pa->via, pa->via_port);
            }
            o->bytes_sent = pa->bytes_sent_prev + (pa->conn ? kvl_conn_bytes_sent(pa->conn) : 0);
            o->bytes_recv = pa->bytes_recv_prev + (pa->conn ? kvl_conn_bytes_recv(pa->conn) : 0);
            o->bytes_put = pa->bytes_put_prev + (pa->conn ? kvl_conn_bytes_put(pa->conn) : 0);
            o->rtt_us = pa->rtt_us;
            o->delivery_gbps = pa->delivery_Bps / 1e9;
            o->nic_other_gbps = pa->nic_other_Bps / 1e9;
            o->stall_ms = pa->stall_ms;
            o->reconnects = pa->reconnects;
            o->hedges = pa->hedges;
            o->t_down_ns = pa->t_down_ns;
            o->chunks_done = pa->chunks_done;
            o->inflight_bytes = pa->inflight_bytes;
            o->est_gbps = pa->bw_Bps / 1e9;
            snprintf(o->last_error, sizeof o->last_error, "%s", pa->last_error);
            const kvl_mover_ops *mv = kvl_mover_by_kind(pa->mover_kind);
            snprintf(o->transport, sizeof o->transport, "%s",
                     mv ? mv->name : a->stream->name);
            snprintf(o->transport_note, sizeof o->transport_note, "%s", pa->tnote);
            o->reconnect_fails = pa->probe_fails;
            o->waiting = p->n_waiting;
        }
    }
    a->n_snap = k;
    if (changed) {
        a->paths_gen++;
        pthread_cond_broadcast(&a->paths_cv);
    }
    pthread_mutex_unlock(&a->stats_mu);
}

kvl_err kvl_paths(kvl_agent *a, kvl_path_info *out, size_t cap, size_t *n)
{
    kvl_clear_error();
    if (atomic_load(&a->closed))
        return kvl_fail(KVL_ERR_CLOSED, "the agent is closed");
    pthread_mutex_lock(&a->stats_mu);
    for (size_t i = 0; i < a->n_snap && i < cap; i++)
        out[i] = a->snap[i];
    *n = a->n_snap;
    pthread_mutex_unlock(&a->stats_mu);
    return KVL_OK;
}

kvl_err kvl_paths_wait(kvl_agent *a, uint64_t seen, uint32_t timeout_ms, uint64_t *gen)
{
    kvl_clear_error();
    if (!a || !gen)
        return kvl_fail(KVL_ERR_INVALID_ARG, "paths_wait: agent and gen must not be NULL");
    struct timespec ts = kvl_deadline_ts(timeout_ms);
    pthread_mutex_lock(&a->stats_mu);
    int rc = 0;
    while (a->paths_gen == seen && rc == 0 && !atomic_load(&a->closed))
        rc = pthread_cond_timedwait(&a->paths_cv, &a->stats_mu, &ts);
    *gen = a->paths_gen;
    pthread_mutex_unlock(&a->stats_mu);
    if (atomic_load(&a->closed))
        return kvl_fail(KVL_ERR_CLOSED, "the agent is closed");
    if (*gen == seen)
        return kvl_fail(KVL_ERR_TIMEOUT, "no path changed state within %u ms", timeout_ms);
    return KVL_OK;
}


void kvl_engine_snapshot_inbound(kvl_agent *a)
{
    kvl_inbound_stats st = {0};
    uint32_t tombs = 0;
    for (kvl_share *s = a->shares.all; s; s = s->next) {
        st.senders++;
        tombs += s->tombs;
    }
    st.tombstones = tombs;
    st.pushes = a->shares.entries - tombs;
    st.chunks = a->shares.chunks;
    st.layers = a->shares.layers;
    st.tag_bytes = a->shares.tag_bytes;
    st.refused_pushes = a->shares.refused;
    st.evicted_pushes = a->shares.evicted;
    st.refused_notifications = a->notif_dropped;
    pthread_mutex_lock(&a->notif_mu);
    st.notifications = a->shares.notifs;
    st.notification_bytes = a->shares.notif_bytes;
    pthread_mutex_unlock(&a->notif_mu);
    pthread_mutex_lock(&a->inq_mu);
    st.queued_handles = a->shares.queued;
    pthread_mutex_unlock(&a->inq_mu);
    pthread_mutex_lock(&a->stats_mu);
    a->inbound_snap = st;
    pthread_mutex_unlock(&a->stats_mu);
}

kvl_err kvl_inbound_stats_get(kvl_agent *a, kvl_inbound_stats *out)
{
    kvl_clear_error();
    if (!a || !out)
        return kvl_fail(KVL_ERR_INVALID_ARG, "inbound_stats: NULL argument");
    pthread_mutex_lock(&a->stats_mu);
    *out = a->inbound_snap;
    pthread_mutex_unlock(&a->stats_mu);
    return KVL_OK;
}
