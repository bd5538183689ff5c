/* handshake.c: both halves of the handshake (docs/wire-protocol.md,
 * "Connections and the handshake"; docs/security.md): the listener's
 * HELLO -> [CHALLENGE -> AUTH] -> admission -> HELLO_ACK on the engine
 * thread, and the initiator's (kvl_handshake_initiate) on the thread that
 * dials; plus the listener's side of a mover's set-up (MOVER_OFFER).
 * Nothing behind a HELLO is read before the handshake has ended.
 */
#include <arpa/inet.h>
#include <ctype.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "conn_impl.h"

/* An accepted connection answered its HELLO (admitted or refused): it no
 * longer counts among those still in their handshake. */
void kvl_handshake_over(kvl_conn *c)
{
    if (c->accepted && !c->handshaken)
        c->a->n_preauth--;
    c->handshaken = 1;
}

/* ---- frame handlers ---- */

/* Answers a HELLO with HELLO_ACK(status, why) and reads nothing more. */
static void refuse_hello(kvl_conn *c, const kvl_msg_hello *m, uint32_t status, const char *why)
{
    c->kind = m->kind;
    kvl_handshake_over(c); /* answered: the handshake timeout no longer applies */
    kvl_conn_send_region_table(c, KVL_F_HELLO_ACK, status, why);
    tp(c)->refuse(c->ep);
}

/* The proofs of this connection cover who m says it is and who we are. */
static kvl_auth_ctx auth_ctx(const kvl_conn *c, const kvl_msg_hello *m)
{
    return (kvl_auth_ctx){.server_name = c->a->name, .server_instance = c->a->instance,
                          .client_name = m->name, .client_instance = m->instance,
                          .kind = m->kind, .path = m->path, .nonce_c = m->nonce,
                          .nonce_s = c->nonce_s};
}

static void admit(kvl_conn *c, const kvl_msg_hello *hello);

void kvl_handshake_on_hello(kvl_conn *c)
{
    kvl_msg_hello m;
    if (kvl_dec_hello(c->body, c->h->body_len, &m)) {
        kvl_conn_fail(c, KVL_ERR_PROTOCOL, kvl_last_error());
        return;
    }
    kvl_agent *a = c->a;
    int has_auth = (m.flags & KVL_HELLO_AUTH) != 0;
    if (!a->secret_len != !has_auth) {
        char why[256];
        snprintf(why, sizeof why,
                 a->secret_len ? "agent '%s' requires authentication and '%s' has no secret: "
                                 "give every agent the same cluster secret (KVLINK_SECRET)"
                               : "agent '%s' has no secret to check the one '%s' holds: give "
                                 "every agent the same cluster secret (KVLINK_SECRET)",
                 a->name, m.name);
        kvl_log_limited(a, KVL_LOG_WARNING, NULL, "refused a connection claiming to be '%s': %s",
                m.name, why);
        refuse_hello(c, &m, KVL_ERR_AUTH, why);
        return;
    }
    if (!has_auth) {
        admit(c, &m);
        return;
    }
    /* prove we hold the secret over the initiator's nonce and ours; it
     * proves itself in AUTH before anything it sends is trusted */
    kvl_msg_challenge ch = {.instance = a->instance};
    strcpy(ch.name, a->name);
    c->hello = m;
    if (kvl_auth_nonce(c->nonce_s)) {
        kvl_conn_fail(c, KVL_ERR_SYSTEM, kvl_last_error());
        return;
    }
    kvl_auth_ctx x = auth_ctx(c, &c->hello);
    memcpy(ch.nonce, c->nonce_s, sizeof ch.nonce);
    kvl_auth_mac(a, 1, &x, ch.mac);
    kvl_buf b = {0};
    kvl_frame_start(&b);
    kvl_enc_challenge(&b, &ch);
    kvl_frame_finish(&b, KVL_F_CHALLENGE, 0);
    c->auth_wait = 1;
    kvl_conn_send_frame(c, &b);
}

void kvl_handshake_on_auth(kvl_conn *c)
{
    c->auth_wait = 0;
    kvl_msg_auth m;
    if (kvl_dec_auth(c->body, c->h->body_len, &m)) {
        kvl_conn_fail(c, KVL_ERR_PROTOCOL, kvl_last_error());
        return;
    }
    kvl_agent *a = c->a;
    kvl_auth_ctx x = auth_ctx(c, &c->hello);
    uint8_t want[KVL_MAC_BYTES];
    kvl_auth_mac(a, 0, &x, want);
    char why[256] = "";
    if (m.status != KVL_OK)
        snprintf(why, sizeof why,
                 "'%s' could not verify agent '%s': the two hold different cluster secrets",
                 c->hello.name, a->name);
    else if (!kvl_ct_equal(m.mac, want, sizeof want))
        snprintf(why, sizeof why,
                 "agent '%s' could not verify '%s': the two hold different cluster secrets",
                 a->name, c->hello.name);
    explicit_bzero(want, sizeof want);
    if (why[0]) {
        kvl_log_limited(a, KVL_LOG_WARNING, NULL, "refused a connection claiming to be '%s': %s",
                c->hello.name, why);
        refuse_hello(c, &c->hello, KVL_ERR_AUTH, why);
        return;
    }
    admit(c, &c->hello);
}

/* The key of one sender session in the inbound tables (pushes, chunk
 * ownership, END, notification de-duplication): a client that claims a
 * sender's public name and instance without its session token, or its
 * instance under another name, gets another key and touches nothing of it. */
static uint64_t sender_key(const char *name, uint64_t instance, const uint8_t *token)
{
    kvl_sha256 h;
    uint8_t d[KVL_SHA256_BYTES];
    kvl_sha256_init(&h);
    kvl_sha256_update(&h, name, strlen(name) + 1);
    kvl_sha256_update(&h, &instance, sizeof instance);
    kvl_sha256_update(&h, token, KVL_TOKEN_BYTES);
    kvl_sha256_final(&h, d);
    uint64_t k;
    memcpy(&k, d, sizeof k);
    return k ? k : 1; /* 0: no session */
}

/* The IPv4 source address of accepted connection c (network order), 0 if
 * unknown. */
static uint32_t source_of(kvl_conn *c)
{
    struct sockaddr_storage local, peer;
    if (tp(c)->addrs(c->ep, &local, &peer) != 0 || peer.ss_family != AF_INET)
        return 0;
    return ((struct sockaddr_in *)(void *)&peer)->sin_addr.s_addr;
}

/* Accepted connections one source address may hold, from all its names
 * together: a quarter of max_connections (4096 of the default 16384: 16
 * agents with 64 paths each need 1040), and never less than one session's
 * share, so one admitted host cannot fill max_connections. */
static uint32_t conns_per_source(const kvl_agent *a)
{
    uint32_t q = a->cfg.max_connections / 4;
    return q > KVL_MAX_CONNS_PER_PEER ? q : KVL_MAX_CONNS_PER_PEER;
}

/* A record for inbound peer `name`; at KVL_MAX_PEER_NAMES one whose
 * connections are all gone makes room.  NULL when none can. */
static kvl_inbound *inbound_new(kvl_agent *a, const char *name)
{
    if (a->n_inbound >= KVL_MAX_PEER_NAMES) {
        kvl_inbound **pp = &a->inbound;
        while (*pp && (*pp)->conns > 0)
            pp = &(*pp)->next;
        if (!*pp)
            return NULL;
        kvl_inbound *old = *pp;
        *pp = old->next;
        free(old);
        a->n_inbound--;
    }
    kvl_inbound *ib = calloc(1, sizeof *ib);
    if (!ib)
        return NULL;
    strcpy(ib->name, name);
    ib->next = a->inbound;
    a->inbound = ib;
    a->n_inbound++;
    return ib;
}

/* Who the HELLO says it is is settled (proven, with a secret): take it in
 * or refuse it, and answer with HELLO_ACK. */
static void admit(kvl_conn *c, const kvl_msg_hello *hello)
{
    kvl_msg_hello m = *hello;
    c->kind = m.kind;
    c->rx_path = m.path;
    kvl_handshake_over(c);
    strcpy(c->peer_name, m.name);
    kvl_agent *a = c->a;
    char msg[256] = "";
    uint32_t status = KVL_OK;
    kvl_inbound *ib = NULL;
    /* one walk: the name's record, and what the sessions opened from this
     * connection's source address hold (names live, their connections) */
    uint32_t src = source_of(c), src_names = 0, src_conns = 0;
    for (kvl_inbound *it = a->inbound; it; it = it->next) {
        if (!ib && strcmp(it->name, m.name) == 0)
            ib = it;
        if (it->conns > 0 && src && it->src == src) {
            src_names++;
            src_conns += (uint32_t)it->conns;
        }
    }
    int new_session = !ib || ib->conns == 0;
    char where[INET_ADDRSTRLEN] = "?";
    inet_ntop(AF_INET, &src, where, sizeof where);
    if (strcmp(m.name, a->name) == 0) {
        status = KVL_ERR_DUPLICATE_NAME;
        snprintf(msg, sizeof msg,
                 "agent '%s' refused a connection from an agent with its own name; every "
                 "agent needs a unique name",
                 a->name);
    } else if (ib && ib->conns > 0 && ib->instance != m.instance) {
        status = KVL_ERR_DUPLICATE_NAME;
        snprintf(msg, sizeof msg,
                 "agent '%s' already has a live peer named '%s' (instance %016llx); agent "
                 "names must be unique: rename one of them",
                 a->name, m.name, (unsigned long long)ib->instance);
    } else if (ib && ib->conns > 0 && !kvl_ct_equal(ib->token, m.token, KVL_TOKEN_BYTES)) {
        /* the instance id is public (metadata); the session token is not: a
         * connection may join the live ones only from the same session */
        status = KVL_ERR_DUPLICATE_NAME;
        snprintf(msg, sizeof msg,
                 "agent '%s' has live connections from '%s' in another session: a second "
                 "process is using that agent's name and instance",
                 a->name, m.name);
        kvl_log_limited(a, KVL_LOG_WARNING, NULL, "refused a connection claiming to be '%s': %s",
                m.name, msg);
    } else if (ib && ib->conns >= KVL_MAX_CONNS_PER_PEER) {
        status = KVL_ERR_BUSY;
        snprintf(msg, sizeof msg,
                 "agent '%s' holds %d connections from '%s' already, the most one session "
                 "may hold (4 per path): is it reconnecting in a loop?",
                 a->name, ib->conns, m.name);
    } else if (new_session && src_names >= KVL_MAX_NAMES_PER_SOURCE) {
        status = KVL_ERR_BUSY;
        snprintf(msg, sizeof msg,
                 "agent '%s' has live connections from %u peer names at %s, the most one "
                 "source address may hold: no room for '%s'",
                 a->name, src_names, where, m.name);
    } else if ((new_session || ib->src == src) && src_conns >= conns_per_source(a)) {
        status = KVL_ERR_BUSY;
        snprintf(msg, sizeof msg,
                 "agent '%s' holds %u connections from %s, the most one source address may "
                 "hold (max_connections / 4): no room for '%s'",
                 a->name, src_conns, where, m.name);
    } else if (!ib && !(ib = inbound_new(a, m.name))) {
        status = KVL_ERR_BUSY;
        snprintf(msg, sizeof msg,
                 "agent '%s' has live connections from %d peer names: no room for '%s'",
                 a->name, KVL_MAX_PEER_NAMES, m.name);
    } else {
        if (ib->conns == 0 && (!ib->sender || ib->instance != m.instance ||
                               !kvl_ct_equal(ib->token, m.token, KVL_TOKEN_BYTES))) {
            /* a new session of this name: its own earlier one is over */
            if (ib->sender)
                kvl_rx_forget_sender(a, ib->sender);
            memcpy(ib->token, m.token, KVL_TOKEN_BYTES);
            ib->sender = sender_key(m.name, m.instance, m.token);
        }
        if (ib->conns == 0)
            ib->src = src;
        ib->instance = m.instance;
        ib->conns++;
        c->ib = ib;
    }
    const kvl_mover_ops *mv = m.movers ? kvl_mover_by_kind(m.movers) : NULL;
    if (status == KVL_OK && m.movers && !mv) {
        status = KVL_ERR_PROTOCOL;
        snprintf(msg, sizeof msg, "agent '%s' has no mover of kind %#x ('%s' asked for it)",
                 a->name, m.movers, m.name);
    }
    if (status == KVL_OK && mv && kvl_mover_allowed(&a->cfg, mv, a->name, m.name)) {
        status = KVL_ERR_INVALID_ARG;
        snprintf(msg, sizeof msg, "%s", kvl_last_error());
    }
    if (status == KVL_OK && mv && !(mv->caps & KVL_MV_OFFER)) {
        kvl_mover *mover = NULL;
        if (mv->agree(a, c->ep, &mover)) {
            /* e.g. a peer elsewhere asking for descriptors of our memory: no */
            status = KVL_ERR_PROTOCOL;
            snprintf(msg, sizeof msg, "agent '%s' refused %s to '%s': %s", a->name, mv->what,
                     m.name, kvl_last_error());
        } else {
            tp(c)->set_mover(c->ep, mv, mover, NULL);
        }
    }
    c->mover_due = status == KVL_OK && mv && (mv->caps & KVL_MV_OFFER) ? mv : NULL;
    kvl_conn_send_region_table(c, KVL_F_HELLO_ACK, status, msg);
    if (status != KVL_OK)
        tp(c)->refuse(c->ep); /* nothing behind a refused HELLO is read */
}

/* MOVER_OFFER: once per data connection whose HELLO named a mover set up by
 * an offer.  The mover answers (MOVER_ACCEPT or MOVER_REFUSE); only a peer
 * that proved the cluster secret gets an answer other than a refusal
 * (docs/ucx.md: libucp parses worker addresses unchecked). */
void kvl_handshake_on_mover_offer(kvl_conn *c)
{
    const kvl_mover_ops *mv = c->mover_due;
    if (!mv || c->h->body_len < 1 || c->body[0] != mv->kind) {
        kvl_conn_fail(c, KVL_ERR_PROTOCOL,
                      "MOVER_OFFER for a mover the HELLO did not name, or a second one");
        return;
    }
    c->mover_due = NULL;
    mv->answer(c->a, c->ep, c->body + 1, c->h->body_len - 1, c->a->secret_len != 0);
}

void kvl_proto_on_version(kvl_conn *c, const char *why)
{
    if (c->handshaken) { /* a version change mid-connection is garbage */
        kvl_conn_fail(c, KVL_ERR_PROTOCOL, why);
        return;
    }
    /* tell the initiator why before hanging up: HandshakeError there, not a
     * bare connection reset */
    kvl_handshake_over(c);
    c->kind = KVL_CONN_DATA;
    kvl_conn_send_region_table(c, KVL_F_HELLO_ACK, KVL_ERR_HANDSHAKE, why);
    tp(c)->refuse(c->ep);
}

/* ---- the initiator's half (on a detached endpoint, blocking) ---- */

/* Reads one whole frame from a detached endpoint: *body is malloc'ed (the
 * caller frees it) and its crc32c checked. */
static kvl_err recv_frame(kvl_agent *a, kvl_ep *ep, uint64_t deadline, kvl_frame_hdr *h,
                          uint8_t **body)
{
    uint8_t hdr[KVL_HDR_BYTES];
    *body = NULL;
    kvl_err e = a->stream->recv_all(ep, hdr, sizeof hdr, deadline);
    if (e)
        return e;
    if ((e = kvl_hdr_decode(hdr, h)))
        return e;
    if (h->body_len > KVL_HANDSHAKE_BODY_MAX)
        return kvl_fail(KVL_ERR_PROTOCOL, "a %u-byte handshake frame body", h->body_len);
    *body = malloc(h->body_len ? h->body_len : 1);
    if (!*body)
        return kvl_fail(KVL_ERR_NOMEM, "handshake: out of memory");
    if ((e = a->stream->recv_all(ep, *body, h->body_len, deadline)))
        return e;
    if (kvl_crc32c(0, *body, h->body_len) != h->body_crc)
        return kvl_fail(KVL_ERR_PROTOCOL, "a handshake frame body failed its crc32c check");
    return KVL_OK;
}

static kvl_err send_frame(kvl_agent *a, kvl_ep *ep, kvl_buf *b, uint8_t type, uint64_t deadline)
{
    kvl_frame_finish(b, type, 0);
    kvl_err e = b->oom ? kvl_fail(KVL_ERR_NOMEM, "handshake: out of memory")
                       : a->stream->send_all(ep, b->p, b->len, deadline);
    kvl_buf_free(b);
    return e;
}

/* With a secret: the listener's CHALLENGE (in body) must prove it holds
 * it; then our AUTH proves we do.  A listener that fails is told so. */
static kvl_err answer_challenge(kvl_agent *a, kvl_peer *p, kvl_ep *ep, const kvl_msg_hello *m,
                                const uint8_t *body, uint32_t len, const char *where,
                                uint64_t deadline, uint64_t *proven_instance)
{
    kvl_msg_challenge ch;
    *proven_instance = 0;
    if (kvl_dec_challenge(body, len, &ch))
        return kvl_fail(KVL_ERR_HANDSHAKE, "handshake with '%s' at %s: %s", p->name, where,
                        kvl_last_error());
    kvl_auth_ctx x = {.server_name = ch.name, .server_instance = ch.instance,
                      .client_name = a->name, .client_instance = a->instance,
                      .kind = m->kind, .path = m->path, .nonce_c = m->nonce,
                      .nonce_s = ch.nonce};
    uint8_t want[KVL_MAC_BYTES];
    kvl_auth_mac(a, 1, &x, want);
    int proven = kvl_ct_equal(want, ch.mac, sizeof want) && strcmp(ch.name, p->name) == 0;
    kvl_msg_auth au = {.status = proven ? KVL_OK : KVL_ERR_AUTH};
    if (proven)
        kvl_auth_mac(a, 0, &x, au.mac);
    explicit_bzero(want, sizeof want);
    kvl_buf b = {0};
    kvl_frame_start(&b);
    kvl_enc_auth(&b, &au);
    kvl_err e = send_frame(a, ep, &b, KVL_F_AUTH, deadline);
    explicit_bzero(&au, sizeof au);
    if (!proven)
        return kvl_fail(KVL_ERR_AUTH,
                        "the agent at %s (answering as '%s') could not prove it holds this "
                        "agent's ('%s') cluster secret: the two were given different secrets, "
                        "or something else answers there",
                        where, ch.name, a->name);
    if (e)
        return kvl_fail(KVL_ERR_UNREACHABLE, "handshake with peer '%s' at %s: %s", p->name,
                        where, kvl_last_error());
    *proven_instance = ch.instance;
    return KVL_OK;
}

/* The mover a connection of this kind to p wants (its HELLO names it), or
 * NULL: data paths only, chosen from Config.transport, whether p runs on
 * this host (its metadata and the permission probe: KVL_PEER_SAME_HOST)
 * and whether the path's last connection that a KVL_MV_FALLS_BACK mover
 * carried died less than KVL_MOVER_FALLBACK_MS ago (then it runs in-stream
 * on the same NIC: docs/ucx.md). */
static const kvl_mover_ops *wanted_mover(const kvl_agent *a, const kvl_peer *p, int kind,
                                         uint16_t path)
{
    if (kind != KVL_CONN_DATA || (path < KVL_MAX_PATHS && p->paths[path].via[0]))
        return NULL; /* a relayed path's payloads go in-stream, inside its seal */
    uint64_t off = path < KVL_MAX_PATHS
                       ? __atomic_load_n(&p->paths[path].mover_off_until_ns, __ATOMIC_RELAXED)
                       : 0;
    int fallen_back = off && kvl_now_ns() < off;
    return kvl_mover_choose(&a->cfg, a->secret_len, (p->flags & KVL_PEER_SAME_HOST) != 0,
                            fallen_back);
}

/* HELLO on ep, with a secret the challenge-response (auth.c), then the
 * HELLO_ACK.  Fills *instance; on a control connection the region table
 * is copied into p. */
static kvl_err handshake(kvl_agent *a, kvl_peer *p, kvl_ep *ep, int kind, uint16_t path,
                         const kvl_mover_ops *mv, const char *where, uint64_t deadline,
                         uint64_t *instance)
{
    kvl_msg_hello m = {.instance = a->instance, .kind = (uint8_t)kind, .path = path,
                       .flags = a->secret_len ? KVL_HELLO_AUTH : 0,
                       .movers = mv ? mv->kind : 0};
    strcpy(m.name, a->name);
    memcpy(m.token, p->token, sizeof m.token);
    if (a->secret_len && kvl_auth_nonce(m.nonce))
        return KVL_ERR_SYSTEM;
    kvl_buf b = {0};
    kvl_frame_start(&b);
    kvl_enc_hello(&b, &m);
    kvl_err e = send_frame(a, ep, &b, KVL_F_HELLO, deadline);
    kvl_frame_hdr h;
    uint8_t *body = NULL;
    if (!e)
        e = recv_frame(a, ep, deadline, &h, &body);
    int proven = 0; /* the listener proved it holds our secret */
    uint64_t proven_instance = 0;
    if (!e && h.type == KVL_F_CHALLENGE && a->secret_len) {
        e = answer_challenge(a, p, ep, &m, body, h.body_len, where, deadline, &proven_instance);
        proven = e == KVL_OK;
        free(body);
        body = NULL;
        if (e == KVL_ERR_AUTH || e == KVL_ERR_HANDSHAKE || e == KVL_ERR_UNREACHABLE)
            return e;
        if (!e)
            e = recv_frame(a, ep, deadline, &h, &body);
    }
    if (e) {
        free(body);
        if (e == KVL_ERR_HANDSHAKE || e == KVL_ERR_PROTOCOL)
            return kvl_fail(KVL_ERR_HANDSHAKE,
                            "handshake with '%s' at %s: %s (is a kvlink agent listening there?)",
                            p->name, where, kvl_last_error());
        return kvl_fail(e == KVL_ERR_TIMEOUT ? KVL_ERR_UNREACHABLE : e,
                        "handshake with peer '%s' at %s: %s", p->name, where, kvl_last_error());
    }
    if (h.type != KVL_F_HELLO_ACK) {
        free(body);
        return kvl_fail(KVL_ERR_HANDSHAKE, "handshake with '%s' at %s: answer is frame type %u",
                        p->name, where, h.type);
    }
    kvl_msg_hello_ack ack;
    e = kvl_dec_hello_ack(body, h.body_len, &ack);
    if (e) {
        free(body);
        return kvl_fail(KVL_ERR_HANDSHAKE, "handshake with '%s' at %s: %s", p->name, where,
                        kvl_last_error());
    }
    if (ack.status != KVL_OK) {
        free(body);
        /* BUSY: the listener has no room for us (its per-session or
         * per-source limits): a refused handshake, not a busy region */
        kvl_err st = ack.status <= KVL_ERR_MAX && ack.status != KVL_ERR_BUSY ? ack.status
                                                                             : KVL_ERR_HANDSHAKE;
        return kvl_fail(st, "peer at %s refused the connection: %s", where, ack.msg);
    }
    if (proven && ack.instance != proven_instance) { /* HELLO_ACK itself is not proven */
        free(body);
        return kvl_fail(KVL_ERR_HANDSHAKE,
                        "the agent at %s proved instance %016llx and then answered as %016llx",
                        where, (unsigned long long)proven_instance,
                        (unsigned long long)ack.instance);
    }
    if (a->secret_len && !proven) { /* accepted without proving anything: not one of ours */
        free(body);
        return kvl_fail(KVL_ERR_AUTH,
                        "the agent at %s accepted us without authentication: it holds no "
                        "cluster secret. Give every agent the same secret (KVLINK_SECRET)",
                        where);
    }
    if (strcmp(ack.name, p->name) != 0) {
        free(body);
        return kvl_fail(KVL_ERR_HANDSHAKE,
                        "the agent at %s is named '%s', not '%s': the peer metadata is stale or "
                        "wrong",
                        where, ack.name, p->name);
    }
    if (*instance && ack.instance != *instance) {
        free(body);
        kvl_err e2 = kvl_fail(KVL_ERR_HANDSHAKE,
                              "the agent '%s' at %s is instance %016llx, the metadata names "
                              "%016llx: the peer restarted; fetch its metadata again",
                              p->name, where, (unsigned long long)ack.instance,
                              (unsigned long long)*instance);
        *instance = ack.instance; /* the one met: the prober gives the peer up */
        return e2;
    }
    *instance = ack.instance;
    if (kind == KVL_CONN_CONTROL) {
        kvl_region_info *tab;
        if ((e = kvl_dec_region_table(&ack, &tab))) {
            free(body);
            return e;
        }
        pthread_mutex_lock(&p->mu);
        free(p->regions);
        p->regions = tab;
        p->n_regions = ack.n_regions;
        p->regions_gen++;
        pthread_mutex_unlock(&p->mu);
    }
    free(body);
    return KVL_OK;
}

kvl_err kvl_handshake_initiate(kvl_agent *a, kvl_peer *p, kvl_ep *ep, int kind, uint16_t path,
                               const char *local, const char *where, uint64_t deadline,
                               uint64_t *instance)
{
    /* decided once: the HELLO names it, and a mover with KVL_MV_OFFER sends its offer */
    const kvl_mover_ops *mv = wanted_mover(a, p, kind, path);
    kvl_err e = handshake(a, p, ep, kind, path, mv, where, deadline, instance);
    if (!e && mv) {
        kvl_mover *m = NULL;
        char note[128] = "";
        if ((e = mv->start(a, ep, local, deadline, &m, note, sizeof note)))
            e = kvl_fail(e, "peer '%s' at %s: %s set-up: %s", p->name, where, mv->label,
                         kvl_last_error());
        else
            a->stream->set_mover(ep, mv, m, note);
    }
    return e;
}
