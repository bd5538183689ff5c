/* notify.c: a transfer's notification, delivered exactly once.
 *
 * Sender side.  When a transfer finishes, its NOTIFY stays pending on the
 * peer until the receiver answers NOTIFY_ACK.  A copy whose connection dies
 * (the control connection over a cut link, say) is sent again on any live
 * connection to that peer, and a copy not acknowledged within RESEND_NS is
 * sent again on another one.  close() lingers until nothing is pending.
 *
 * Receiver side.  Every copy is acknowledged once queued; the first is
 * delivered and remembered in its sender's share (share.c, the last
 * KVL_SHARE_SEEN of that sender), so a re-sent copy is not delivered twice
 * and a flood from another sender cannot make us forget it.  A re-sent copy
 * arrives within seconds of the first, far inside what is remembered.
 *
 * The queue callers read is bounded per sender (KVL_SHARE_NOTIFS
 * notifications, KVL_SHARE_NOTIF_BYTES with their tags) and in all
 * (KVL_ROOM_*): a notification over either is not acknowledged, so its
 * sender sends it again a second later and nothing is lost; a sender within
 * its share is never refused because another one floods.
 *
 * Pending lists and the ring are engine-thread only; the caller queue is
 * under notif_mu.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define RESEND_NS (1000ull * 1000000ull) /* unacknowledged this long: one more copy elsewhere */
#define PENDING_MAX 4096                 /* per peer: beyond this the oldest is dropped */
#define QUEUE_MAX 65536                  /* notifications waiting for the application */

struct kvl_pnotify {
    uint64_t xfer;
    uint32_t op, len;
    kvl_conn *conn;    /* where the last copy went; NULL: send one now */
    uint64_t t_sent_ns;
    struct kvl_pnotify *next;
    uint8_t tag[];
};

struct kvl_notif_node {
    kvl_notif_node *next;
    kvl_share *share;  /* whose count it is in (notif_mu) */
    uint32_t cost;     /* bytes charged: the node and its tag */
    char peer[KVL_NAME_MAX];
    uint64_t xfer;
    uint32_t op, tag_len;
    uint8_t tag[];
};

/* ---- sender ---- */

static int conn_live(const kvl_conn *c) { return c && !kvl_conn_is_dead(c); }

/* A live connection to p other than `not`, preferring the control one. */
static kvl_conn *pick_conn(kvl_peer *p, const kvl_conn *not)
{
    if (conn_live(p->ctrl) && p->ctrl != not)
        return p->ctrl;
    for (uint32_t i = 0; i < p->n_paths; i++) {
        kvl_conn *c = p->paths[i].conn;
        if (conn_live(c) && c != not)
            return c;
    }
    return conn_live((kvl_conn *)not) ? (kvl_conn *)not : NULL;
}

static void send_copy(kvl_peer *p, struct kvl_pnotify *n, uint64_t now)
{
    kvl_conn *c = pick_conn(p, n->conn);
    if (!c)
        return; /* nobody to tell right now; retried when a path comes back */
    kvl_buf b = {0};
    kvl_frame_start(&b);
    kvl_enc_notify(&b, n->xfer, n->op, n->tag, n->len);
    kvl_frame_finish(&b, KVL_F_NOTIFY, 0);
    if (kvl_conn_send_frame(c, &b) == 0) {
        n->conn = c;
        n->t_sent_ns = now;
    }
}

void kvl_notify_queue(kvl_peer *p, uint64_t xfer, uint32_t op, const void *tag, uint32_t len)
{
    struct kvl_pnotify *n = calloc(1, sizeof *n + len);
    if (!n)
        return;
    n->xfer = xfer;
    n->op = op;
    n->len = len;
    memcpy(n->tag, tag, len);
    struct kvl_pnotify **tail = &p->notifs;
    uint32_t count = 0;
    while (*tail) {
        tail = &(*tail)->next;
        count++;
    }
    *tail = n;
    if (count >= PENDING_MAX) { /* a peer that never acknowledges: forget the oldest */
        struct kvl_pnotify *old = p->notifs;
        p->notifs = old->next;
        free(old);
    }
    send_copy(p, n, kvl_now_ns());
}

void kvl_notify_acked(kvl_peer *p, uint64_t xfer)
{
    for (struct kvl_pnotify **pp = &p->notifs; *pp; pp = &(*pp)->next) {
        if ((*pp)->xfer == xfer) {
            struct kvl_pnotify *n = *pp;
            *pp = n->next;
            free(n);
            return;
        }
    }
}

void kvl_notify_conn_lost(kvl_peer *p, const kvl_conn *c)
{
    for (struct kvl_pnotify *n = p->notifs; n; n = n->next)
        if (n->conn == c)
            n->conn = NULL;
}

void kvl_notify_resend(kvl_peer *p, uint64_t now)
{
    for (struct kvl_pnotify *n = p->notifs; n; n = n->next)
        if (!n->conn || now - n->t_sent_ns > RESEND_NS)
            send_copy(p, n, now);
}

int kvl_notify_pending(const kvl_peer *p)
{
    if (!p->notifs)
        return 0;
    /* pending only counts while someone can still hear it */
    if (conn_live(p->ctrl))
        return 1;
    for (uint32_t i = 0; i < p->n_paths; i++)
        if (conn_live(p->paths[i].conn))
            return 1;
    return 0;
}

void kvl_notify_free_all(kvl_peer *p)
{
    while (p->notifs) {
        struct kvl_pnotify *n = p->notifs;
        p->notifs = n->next;
        free(n);
    }
}

/* ---- receiver ---- */

/* Room for one more notification of `cost` bytes from s (notif_mu held). */
static int notif_fits(const kvl_agent *a, const kvl_share *s, uint32_t cost)
{
    return s->notifs < KVL_SHARE_NOTIFS && s->notif_bytes + cost <= KVL_SHARE_NOTIF_BYTES &&
           a->shares.notifs < KVL_ROOM_NOTIFS &&
           a->shares.notif_bytes + cost <= KVL_ROOM_NOTIF_BYTES;
}

int kvl_notify_inbound(kvl_agent *a, const char *peer, uint64_t instance, const kvl_msg_notify *m)
{
    /* transfer notifications (xfer != 0) are deduplicated; a pre-warm
     * request (PREPARE, xfer 0) is delivered as it comes */
    uint64_t now = kvl_now_ns();
    kvl_share *s = kvl_share_get(a, instance);
    if (s && m->xfer && kvl_share_seen(s, m->xfer, now, 0))
        return 1;
    uint32_t cost = (uint32_t)sizeof(kvl_notif_node) + m->tag_len;
    pthread_mutex_lock(&a->notif_mu);
    int fits = s && notif_fits(a, s, cost);
    pthread_mutex_unlock(&a->notif_mu);
    kvl_notif_node *nd = fits ? calloc(1, sizeof *nd + m->tag_len) : NULL;
    if (!nd) {
        /* not acknowledged: the sender sends it again in a second, when the
         * application may have read some */
        a->notif_dropped++;
        kvl_log_limited(a, KVL_LOG_WARNING, peer,
                        "notification from '%s' not queued: the application reads notifications "
                        "slower than they come (it is sent again; docs/security.md, each sender's "
                        "share)",
                        peer);
        return 0;
    }
    if (m->xfer)
        kvl_share_seen(s, m->xfer, now, 1);
    snprintf(nd->peer, sizeof nd->peer, "%s", peer);
    nd->share = s;
    nd->cost = cost;
    nd->xfer = m->xfer;
    nd->op = m->op;
    nd->tag_len = m->tag_len;
    memcpy(nd->tag, m->tag, m->tag_len);
    pthread_mutex_lock(&a->notif_mu);
    if (a->notif_tail)
        a->notif_tail->next = nd;
    else
        a->notif_head = nd;
    a->notif_tail = nd;
    s->notifs++;
    s->notif_bytes += cost;
    a->shares.notifs++;
    a->shares.notif_bytes += cost;
    pthread_cond_broadcast(&a->notif_cv);
    pthread_mutex_unlock(&a->notif_mu);
    return 1;
}

kvl_err kvl_next_notification(kvl_agent *a, uint32_t timeout_ms, kvl_notification *out)
{
    kvl_clear_error();
    struct timespec ts = kvl_deadline_ts(timeout_ms);
    pthread_mutex_lock(&a->notif_mu);
    int rc = 0;
    while (!a->notif_head && rc == 0 && !atomic_load(&a->stopping))
        rc = pthread_cond_timedwait(&a->notif_cv, &a->notif_mu, &ts);
    kvl_notif_node *nd = a->notif_head;
    if (nd) {
        a->notif_head = nd->next;
        if (!a->notif_head)
            a->notif_tail = NULL;
        nd->share->notifs--;
        nd->share->notif_bytes -= nd->cost;
        a->shares.notifs--;
        a->shares.notif_bytes -= nd->cost;
    }
    pthread_mutex_unlock(&a->notif_mu);
    if (!nd)
        return atomic_load(&a->stopping)
                   ? kvl_fail(KVL_ERR_CLOSED, "the agent is closed")
                   : kvl_fail(KVL_ERR_TIMEOUT, "no notification within %u ms", timeout_ms);
    memset(out, 0, sizeof *out);
    snprintf(out->peer, sizeof out->peer, "%s", nd->peer);
    out->xfer_id = nd->xfer;
    out->op = nd->op;
    out->tag_len = nd->tag_len;
    memcpy(out->tag, nd->tag, nd->tag_len);
    free(nd);
    return KVL_OK;
}

void kvl_notify_queue_free(kvl_agent *a)
{
    for (kvl_notif_node *nd = a->notif_head, *next; nd; nd = next) {
        next = nd->next;
        free(nd);
    }
    a->notif_head = a->notif_tail = NULL;
    a->shares.notifs = a->shares.notif_bytes = 0;
}
