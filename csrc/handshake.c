/* handshake.c: both halves of the handshake (docs/wire-protocol.md,
 * "Connections and the handshake"; docs/security.md): the listener's
 * HELLO -> [CHALLENGE -> AUTH] -> admission -> HELLO_ACK on the engine
 * thread, and the initiator's (kvl_handshake_initiate) on the thread that
 * dials; plus the listener's side of a mover's set-up (MOVER_OFFER).
 * Nothing behind a HELLO is read before the handshake has ended.
 */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "conn.h"


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
    kvl_proto_send_region_table(c, KVL_F_HELLO_ACK, status, why);
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
    kvl_inbound *ib;
    for (ib = a->inbound; ib; ib = ib->next)
        if (strcmp(ib->name, m.name) == 0)
            break;
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
        snprintf(msg, sizeof msg, "agent '%s' holds %d connections from '%s' already", a->name,
                 ib->conns, m.name);
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
    kvl_proto_send_region_table(c, KVL_F_HELLO_ACK, status, msg);
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
