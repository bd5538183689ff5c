/* probe.c: re-connecting paths that went down.
 *
 * Connect + handshake block (up to connect_timeout_ms), so they run on a
 * prober thread, never on the engine thread.  The engine asks for a probe
 * when a down path's backoff has passed (monitor.c); the prober answers with
 * a KVL_CMD_PROBED command carrying the new socket or the error, and the
 * engine adopts the socket and puts the path back in service.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

static void *prober_main(void *arg)
{
    kvl_agent *a = arg;
    for (;;) {
        pthread_mutex_lock(&a->probe_mu);
        while (!a->jobs && !atomic_load(&a->stopping))
            pthread_cond_wait(&a->probe_cv, &a->probe_mu);
        kvl_probe_job *job = a->jobs;
        if (job)
            a->jobs = job->next;
        pthread_mutex_unlock(&a->probe_mu);
        if (atomic_load(&a->stopping)) {
            free(job);
            return NULL;
        }
        /* the answer must reach the engine (it counts probes in flight per
         * peer), so its command is allocated first, waiting out a shortage */
        kvl_cmd *cmd;
        while (!(cmd = calloc(1, sizeof *cmd)) && !atomic_load(&a->stopping))
            nanosleep(&(struct timespec){.tv_nsec = 10000000}, NULL);
        if (!cmd) {
            free(job);
            return NULL;
        }
        kvl_ep *ep = NULL;
        int kind = job->path < 0 ? KVL_CONN_CONTROL : KVL_CONN_DATA;
        uint16_t idx = job->path < 0 ? 0 : (uint16_t)job->path;
        kvl_err e = kvl_peer_open_conn(a, job->peer, job->local, job->host, job->port, kind,
                                       idx, &ep, &cmd->met);
        cmd->type = KVL_CMD_PROBED;
        cmd->peer = job->peer;
        cmd->path = job->path;
        cmd->ep = e ? NULL : ep;
        if (e)
            snprintf(cmd->error, sizeof cmd->error, "%s", kvl_last_error());
        free(job);
        kvl_engine_post(a, cmd);
    }
}

kvl_err kvl_prober_start(kvl_agent *a)
{
    pthread_mutex_init(&a->probe_mu, NULL);
    pthread_cond_init(&a->probe_cv, NULL);
    if (pthread_create(&a->prober, NULL, prober_main, a) != 0)
        return kvl_fail(KVL_ERR_SYSTEM, "cannot start the prober thread");
    a->prober_started = 1;
    return KVL_OK;
}

void kvl_prober_stop(kvl_agent *a)
{
    if (!a->prober_started)
        return;
    pthread_mutex_lock(&a->probe_mu);
    pthread_cond_broadcast(&a->probe_cv);
    pthread_mutex_unlock(&a->probe_mu);
    pthread_join(a->prober, NULL);
    a->prober_started = 0;
    /* both threads are gone: nothing else touches the queue now */
    while (a->jobs) {
        kvl_probe_job *j = a->jobs;
        a->jobs = j->next;
        free(j);
    }
    pthread_mutex_destroy(&a->probe_mu);
    pthread_cond_destroy(&a->probe_cv);
}

void kvl_prober_request(kvl_agent *a, kvl_peer *p, int path)
{
    kvl_path *pa = path < 0 ? &p->ctrl_path : &p->paths[path];
    kvl_probe_job *job = calloc(1, sizeof *job);
    if (!job) {
        kvl_path_failed(p, pa, kvl_now_ns(), "out of memory for a probe");
        return;
    }
    job->peer = p;
    job->path = path;
    p->probes++; /* p stays allocated while the prober uses it */
    snprintf(job->local, sizeof job->local, "%s", pa->local);
    snprintf(job->host, sizeof job->host, "%s", pa->rhost);
    job->port = pa->rport;
    pthread_mutex_lock(&a->probe_mu);
    kvl_probe_job **tail = &a->jobs;
    while (*tail)
        tail = &(*tail)->next;
    *tail = job;
    pthread_cond_signal(&a->probe_cv);
    pthread_mutex_unlock(&a->probe_mu);
}

/* The control connection failed to reconnect where it was: the next try
 * goes over the next data path that is up (its NIC pair works). */
static void ctrl_next_route(kvl_peer *p)
{
    kvl_path *c = &p->ctrl_path;
    uint32_t cur = p->n_paths;
    for (uint32_t i = 0; i < p->n_paths; i++)
        if (!strcmp(p->paths[i].local, c->local) && !strcmp(p->paths[i].rhost, c->rhost))
            cur = i;
    for (uint32_t k = 1; k <= p->n_paths; k++) {
        const kvl_path *pa = &p->paths[(cur + k) % p->n_paths];
        /* a relayed path's remote is the peer's sealed port, reached only through its
         * relay: the control connection goes direct */
        if (pa->conn && !kvl_conn_is_dead(pa->conn) && !pa->via[0]) {
            kvl_path_route(c, pa->local, pa->rhost, pa->rport);
            return;
        }
    }
}

void kvl_prober_done(kvl_agent *a, kvl_cmd *cmd)
{
    kvl_peer *p = cmd->peer;
    kvl_path *pa = cmd->path < 0 ? &p->ctrl_path : &p->paths[cmd->path];
    uint64_t now = kvl_now_ns();
    p->probes--;
    kvl_conn *c = NULL;
    if (cmd->ep && !p->replaced)
        c = kvl_conn_adopt(a, cmd->ep); /* discards the endpoint when it fails */
    else if (cmd->ep)
        a->stream->discard(cmd->ep);
    cmd->ep = NULL;
    if (!c) {
        char why[sizeof pa->last_error];
        const char *err = cmd->error[0] ? cmd->error : "reconnect failed";
        size_t plen = strlen(p->name);
        if (!strncmp(err, "peer '", 6) && !strncmp(err + 6, p->name, plen) &&
            !strncmp(err + 6 + plen, "': ", 3))
            err += 9 + plen; /* the peer is named where this is shown */
        snprintf(why, sizeof why, "%s; down since: %s", err,
                 pa->down_cause[0] ? pa->down_cause : "?");
        kvl_path_failed(p, pa, now, why);
        if (cmd->path >= 0)
            kvl_path_reconnect_failed(p, pa); /* known dead: add_peer may replace p */
        else
            ctrl_next_route(p);
        if (cmd->met) /* another instance answers: p restarted, none of it comes back */
            kvl_sched_peer_gone(p, pa, cmd->met);
        kvl_sched_check_reachable(p); /* still down: what runs waits for a path */
        return;
    }
    kvl_conn_bind_outbound(c, p, cmd->path);
    if (cmd->path < 0)
        p->ctrl = c;
    kvl_path_reconnected(p, pa, c, now);
    kvl_sched_check_reachable(p); /* transfers that waited for a path go on */
    kvl_engine_snapshot_paths(a);
}
