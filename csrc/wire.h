/* wire.h: kvlink frames on the wire and their codec (wire.c; docs/wire-protocol.md).
 * Self-contained: the core, every transport and the C tests include it. */
#ifndef KVLINK_WIRE_H
#define KVLINK_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include "kvlink.h"

#define KVL_NAME_MAX 64          /* agent and region names, with the NUL */
#define KVL_MAX_PIECES 8192      /* pieces per chunk: bounds a frame body to 192 KiB */

/* ---- wire.c: frames on the wire (docs/wire-protocol.md) ----
 * Every frame: a 24-byte header, body_len bytes of body, then payload_len
 * bytes of payload followed by a 4-byte crc32c trailer when payload_len > 0.
 * All integers little-endian. */
#define KVL_MAGIC 0x4b4c564bu /* "KVLK" */
#define KVL_PROTO_VERSION 5 /* 2: ANNOUNCE, NOTIFY_ACK, END with status; 3: CHALLENGE, AUTH;
                              4: UCX set-up frames, HELLO flag UCX, header flag REMOTE
                              (then HELLO flag and header flag CMA, without a bump);
                              5: movers: MOVER_* frames with a kind, HELLO movers mask,
                              header flag OOB with a cover (docs/wire-protocol.md) */
#define KVL_HDR_BYTES 24
#define KVL_MAX_BODY (1u << 20)

enum kvl_frame_type {
    KVL_F_HELLO = 1,       /* initiator -> listener: who I am, which connection this is */
    KVL_F_HELLO_ACK = 2,   /* listener -> initiator: accepted or why not, region table */
    KVL_F_DATA = 3,        /* push: chunk header (destination pieces) + payload */
    KVL_F_ACK = 4,         /* push: chunk verified and placed, or why not */
    KVL_F_READ_REQ = 5,    /* pull: send me these source pieces */
    KVL_F_READ_RESP = 6,   /* pull: status + payload */
    KVL_F_NOTIFY = 7,      /* transfer finished: the caller's tag */
    KVL_F_REGIONS_REQ = 8, /* send me your region table */
    KVL_F_REGIONS = 9,     /* region table */
    KVL_F_PING = 10,       /* idle-path probe: echo my token */
    KVL_F_PONG = 11,       /* the echo */
    KVL_F_END = 12,        /* push finished (either way): drain any late copy */
    KVL_F_NOTIFY_ACK = 13, /* the NOTIFY of this transfer arrived (token: its id) */
    KVL_F_ANNOUNCE = 14,   /* push: tag, size and chunk-to-layer map, before its first DATA */
    KVL_F_CHALLENGE = 15,  /* listener -> initiator: its nonce and proof of the secret */
    KVL_F_AUTH = 16,       /* initiator -> listener: its proof of the secret */
    /* data connections only, after the handshake: a mover's set-up.  Body: u8
     * mover kind (KVL_MOVER_*), then bytes only that mover reads (transport.h) */
    KVL_F_MOVER_OFFER = 17,  /* initiator -> listener: set up this mover on this path */
    KVL_F_MOVER_ACCEPT = 18, /* listener -> initiator: set up */
    KVL_F_MOVER_KEYS = 19,   /* either way: the sender's keys changed (regions registered) */
    KVL_F_MOVER_REFUSE = 20, /* listener -> initiator: not on this path, and why */
    KVL_F_TYPE_MAX = 20
};

enum kvl_conn_kind { KVL_CONN_CONTROL = 0, KVL_CONN_DATA = 1 };

/* Header flags.  OOB: the payload's bytes are not in the stream: the path's
 * mover places them (a same-host copy by the receiver, a put by the sender).
 * After the body come a u32 cover length (at most KVL_MAX_COVER), the cover
 * (bytes only the mover reads: where to copy from, or nothing for a put),
 * then the usual crc32c trailer, which vouches for the bytes as placed.
 * Legal on DATA / READ_RESP with a payload, on a data connection whose
 * mover is set up (proto.c checks that).
 * DST: a READ_REQ whose body ends with where each piece goes in the
 * initiator's regions (pull over a one-sided mover: the responder may place
 * the bytes there and answer with an OOB READ_RESP).  Legal on READ_REQ
 * only, on a path whose mover is one-sided. */
enum { KVL_HF_OOB = 1, KVL_HF_DST = 2 };
#define KVL_MAX_COVER (16u + 16u * KVL_MAX_PIECES) /* a cover: 8192 source ranges */

typedef struct kvl_frame_hdr {
    uint8_t type;
    uint16_t flags;
    uint32_t body_len;
    uint32_t body_crc;
    uint64_t payload_len;
} kvl_frame_hdr;

/* Growable byte buffer for building frames.  oom latches allocation failure. */
typedef struct kvl_buf {
    uint8_t *p;
    size_t len, cap;
    int oom;
} kvl_buf;

typedef struct kvl_wire_piece {
    uint64_t region, offset, len;
} kvl_wire_piece;
#define KVL_WIRE_PIECE_BYTES 24
#define KVL_KEY_BYTES 16          /* a region's access key (docs/security.md) */
#define KVL_WIRE_KEY_BYTES (8 + KVL_KEY_BYTES) /* region id + its key */
#define KVL_WIRE_REGION_BYTES 90 /* a region record without its remote key */
#define KVL_MAX_RKEY 256          /* bytes of a transport's remote key */

#define KVL_NONCE_BYTES 16
#define KVL_MAC_BYTES 32        /* HMAC-SHA256 */
#define KVL_TOKEN_BYTES 16
/* hello flags: AUTH: the initiator holds a secret */
enum { KVL_HELLO_AUTH = 1 };
/* Mover kinds: bits of HELLO's movers mask and the first byte of MOVER_*
 * bodies.  A data connection's HELLO names at most one (the mover the
 * initiator wants on this path); a control connection's none. */
enum { KVL_MOVER_SHM = 1, KVL_MOVER_UCX = 2, KVL_MOVER_FAULT = 4 };
#define KVL_MOVERS_KNOWN (KVL_MOVER_SHM | KVL_MOVER_UCX | KVL_MOVER_FAULT)

typedef struct kvl_msg_hello {
    uint64_t instance;
    uint8_t kind;   /* kvl_conn_kind */
    uint16_t path;  /* path index for data connections */
    char name[KVL_NAME_MAX];
    uint8_t flags;  /* KVL_HELLO_AUTH */
    uint8_t nonce[KVL_NONCE_BYTES]; /* the initiator's challenge (with KVL_HELLO_AUTH) */
    uint8_t token[KVL_TOKEN_BYTES]; /* the initiator's session with this listener: random,
                                       the same on every connection of one kvl_peer */
    uint32_t movers; /* KVL_MOVER_*: the mover wanted on this data connection, or 0 */
} kvl_msg_hello;

/* CHALLENGE: the listener's nonce and its proof (kvl_auth_mac, server side). */
typedef struct kvl_msg_challenge {
    uint64_t instance;
    char name[KVL_NAME_MAX];
    uint8_t nonce[KVL_NONCE_BYTES];
    uint8_t mac[KVL_MAC_BYTES];
} kvl_msg_challenge;

/* AUTH: the initiator's proof, or status != OK: the listener's proof failed. */
typedef struct kvl_msg_auth {
    uint32_t status;
    uint8_t mac[KVL_MAC_BYTES];
} kvl_msg_auth;

/* HELLO_ACK and REGIONS share the region table encoding. */
typedef struct kvl_msg_hello_ack {
    uint32_t status; /* kvl_err */
    uint64_t instance;
    char name[KVL_NAME_MAX];
    char msg[256];
    uint32_t n_regions;
    const uint8_t *regions; /* n_regions records (checked), inside the body */
} kvl_msg_hello_ack;

/* DATA and READ_REQ */
typedef struct kvl_msg_chunk {
    uint64_t xfer;
    uint32_t chunk, attempt, n_pieces;
    const uint8_t *pieces; /* n_pieces * KVL_WIRE_PIECE_BYTES, inside the body */
    uint32_t n_keys;       /* access keys of the regions the pieces name: 1..n_pieces, */
    const uint8_t *keys;   /* ids strictly ascending; n_keys * KVL_WIRE_KEY_BYTES */
    const uint8_t *dst;    /* READ_REQ with KVL_HF_DST: n_pieces * KVL_WIRE_DST_BYTES
                              (the initiator's region id u64, offset u64 per piece, the
                              piece's len); else NULL */
} kvl_msg_chunk;
#define KVL_WIRE_DST_BYTES 16

/* ACK and READ_RESP */
/* The one ACK / READ_RESP message (status ACCESS_DENIED) for every piece a
 * receiver refuses to touch: unknown region, not exposed for the operation,
 * wrong or missing access key, bytes outside it.  The same bytes whatever
 * the reason, so a peer without the key learns nothing of the region; the
 * reason goes to the receiver's log (place.c). */
#define KVL_REFUSED_REGION_ACCESS                                                              \
    "region access refused: wrong or missing region key, region not exposed for this "        \
    "operation, or bytes outside it (stale metadata? add_peer again); see that agent's log"

typedef struct kvl_msg_status {
    uint64_t xfer;
    uint32_t chunk, attempt, status;
    char msg[256];
} kvl_msg_status;

typedef struct kvl_msg_notify {
    uint64_t xfer;
    uint32_t op, tag_len;
    const uint8_t *tag; /* inside the body */
} kvl_msg_notify;

/* ANNOUNCE: a push's shape, sent on each connection before its first DATA
 * there, so the receiver can report it (kvl_inbound_next) from the first
 * frame on.  map: n_chunks x (u32 layer_first, u32 layer_last). */
typedef struct kvl_msg_announce {
    uint64_t xfer;
    uint64_t bytes;
    uint32_t n_chunks, n_layers;
    uint32_t timeout_ms;      /* what is left of the sender's deadline (0: none) */
    uint32_t tag_len;
    const uint8_t *tag;       /* inside the body */
    const uint8_t *map;       /* inside the body */
} kvl_msg_announce;

/* Header: decode checks magic, version, type and the body/payload bounds. */
void kvl_hdr_encode(uint8_t out[KVL_HDR_BYTES], const kvl_frame_hdr *h);
kvl_err kvl_hdr_decode(const uint8_t in[KVL_HDR_BYTES], kvl_frame_hdr *h);

/* Frame builders: start reserves the header, finish fills it in (body crc
 * included).  Check b->oom after finishing. */
void kvl_frame_start(kvl_buf *b);
void kvl_frame_finish(kvl_buf *b, uint8_t type, uint64_t payload_len);
void kvl_buf_free(kvl_buf *b);
/* Appends n bytes of src to b, growing it; on allocation failure b->oom
 * latches and nothing more is appended. */
void kvl_buf_put(kvl_buf *b, const void *src, size_t n);

void kvl_enc_hello(kvl_buf *b, const kvl_msg_hello *m);
void kvl_enc_hello_ack(kvl_buf *b, uint32_t status, uint64_t instance, const char *name,
                       const char *msg, const kvl_region_info *regions, size_t n_regions);
void kvl_enc_chunk(kvl_buf *b, uint64_t xfer, uint32_t chunk, uint32_t attempt,
                   uint32_t n_pieces); /* pieces follow with kvl_enc_piece */
void kvl_enc_piece(kvl_buf *b, const kvl_wire_piece *p);
/* After the pieces: n keys follow with kvl_enc_key, ids strictly ascending. */
void kvl_enc_keys(kvl_buf *b, uint32_t n);
void kvl_enc_key(kvl_buf *b, uint64_t region, const uint8_t key[KVL_KEY_BYTES]);
void kvl_enc_status(kvl_buf *b, const kvl_msg_status *m);
void kvl_enc_notify(kvl_buf *b, uint64_t xfer, uint32_t op, const void *tag, uint32_t len);
void kvl_enc_token(kvl_buf *b, uint64_t token); /* PING and PONG */
void kvl_enc_challenge(kvl_buf *b, const kvl_msg_challenge *m);
void kvl_enc_auth(kvl_buf *b, const kvl_msg_auth *m);

/* Body decoders: every length is checked against the body; any mismatch
 * is KVL_ERR_PROTOCOL with a message.  Outputs may point into body. */
kvl_err kvl_dec_hello(const uint8_t *body, size_t len, kvl_msg_hello *m);
kvl_err kvl_dec_hello_ack(const uint8_t *body, size_t len, kvl_msg_hello_ack *m);
kvl_err kvl_dec_chunk(const uint8_t *body, size_t len, kvl_msg_chunk *m);
/* kvl_dec_chunk for a frame whose header flags are flags: with KVL_HF_DST the
 * body ends with the destination pieces (m->dst).  Trusts nothing: lengths
 * checked against the body, trailing bytes refused. */
kvl_err kvl_dec_chunk_flags(const uint8_t *body, size_t len, uint16_t flags, kvl_msg_chunk *m);
/* Destination i of a DST READ_REQ (m->dst set, i < m->n_pieces): region and
 * offset from the DST section, len from source piece i. */
void kvl_dec_dst_piece(const kvl_msg_chunk *m, uint32_t i, kvl_wire_piece *p);
/* Appends one destination entry of a DST READ_REQ (after the keys). */
void kvl_enc_dst(kvl_buf *b, uint64_t region, uint64_t offset);
kvl_err kvl_dec_status(const uint8_t *body, size_t len, kvl_msg_status *m);
kvl_err kvl_dec_notify(const uint8_t *body, size_t len, kvl_msg_notify *m);
kvl_err kvl_dec_token(const uint8_t *body, size_t len, uint64_t *token);
kvl_err kvl_dec_challenge(const uint8_t *body, size_t len, kvl_msg_challenge *m);
kvl_err kvl_dec_auth(const uint8_t *body, size_t len, kvl_msg_auth *m);
void kvl_enc_announce(kvl_buf *b, const kvl_msg_announce *m, const uint32_t *layer_first,
                      const uint32_t *layer_last);
/* Also checks the map: layers inside [0, n_layers), chunks in layer order. */
kvl_err kvl_dec_announce(const uint8_t *body, size_t len, kvl_msg_announce *m);
void kvl_dec_announce_chunk(const kvl_msg_announce *m, uint32_t i, uint32_t *layer_first,
                            uint32_t *layer_last);
void kvl_dec_piece(const kvl_msg_chunk *m, uint32_t i, kvl_wire_piece *p);
/* The key the frame carries for region id, or NULL (binary search). */
const uint8_t *kvl_dec_key_for(const kvl_msg_chunk *m, uint64_t region);
/* Decodes the region record at p (from a table kvl_dec_hello_ack accepted)
 * and returns where the next one starts. */
const uint8_t *kvl_dec_region_next(const uint8_t *p, kvl_region_info *r);
/* The whole table of an accepted HELLO_ACK/REGIONS, in a new array (caller frees). */
kvl_err kvl_dec_region_table(const kvl_msg_hello_ack *m, kvl_region_info **out);
/* The entry for id in a region table of n entries sorted by id (as the wire
 * carries it and kvl_dec_region_table returns it), or NULL. */
const kvl_region_info *kvl_region_table_find(const kvl_region_info *tab, size_t n, uint64_t id);
/* What a one-sided mover learnt of a peer's region (id, size: its key), checked
 * against the peer's region table tab[0..n): 1 when the table does not list it
 * (registered since) or agrees (open for remote writes, the same size); else 0
 * with the reason in why, naming who (the mover's label). */
int kvl_region_learnt_ok(const kvl_region_info *tab, size_t n, uint64_t id, uint64_t size,
                         const char *who, char *why, size_t why_len);

#endif
