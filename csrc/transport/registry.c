/* registry.c: the transports kvlink knows, by name and kind, and the rule
 * that picks a data path's mover from both ends' facts and Config.transport.
 *
 * A new mover is one folder under transport/ and one entry in movers[]; the
 * core reads only its kvl_mover_ops (name, kind, capability bits).
 */
#include <stdio.h>
#include <string.h>

#include "../internal.h"
#include "transport.h"

extern const kvl_stream_ops kvl_tcp_stream;
extern const kvl_mover_ops kvl_shm_mover;
extern const kvl_mover_ops kvl_ucx_mover;
extern const kvl_mover_ops kvl_fault_mover;
extern const kvl_relay_ops kvl_relay_transport;

/* In preference order (the asked-for ones first: under "fault" a same-host
 * peer gets the fault mover, not same-host copies). */
static const kvl_mover_ops *const movers[] = {&kvl_ucx_mover, &kvl_fault_mover, &kvl_shm_mover};

const kvl_stream_ops *kvl_stream_default(void) { return &kvl_tcp_stream; }

const kvl_relay_ops *kvl_relay(void) { return &kvl_relay_transport; }

const kvl_mover_ops *kvl_mover_by_kind(uint32_t kind)
{
    for (size_t i = 0; i < sizeof movers / sizeof *movers; i++)
        if (movers[i]->kind == kind)
            return movers[i];
    return NULL;
}

/* The mover a Config.transport value names (0: none). */
static uint32_t mode_kind(uint32_t mode)
{
    return mode == KVL_TRANSPORT_UCX     ? KVL_MOVER_UCX
           : mode == KVL_TRANSPORT_FAULT ? KVL_MOVER_FAULT
                                         : 0;
}

/* Which movers Config.transport lets a path use at all: none with "tcp";
 * movers that run unasked (same-host copies) otherwise; a KVL_MV_ASKED one
 * (UCX) only where the setting names it. */
static int mode_allows(uint32_t mode, const kvl_mover_ops *m)
{
    if (mode == KVL_TRANSPORT_TCP)
        return 0;
    return (m->caps & KVL_MV_ASKED) ? m->kind == mode_kind(mode) : 1;
}

const kvl_mover_ops *kvl_mover_choose(const kvl_config *cfg, uint32_t secret_len, int same_host,
                                      int fallen_back)
{
    for (size_t i = 0; i < sizeof movers / sizeof *movers; i++) {
        const kvl_mover_ops *m = movers[i];
        if (!mode_allows(cfg->transport, m))
            continue;
        if ((m->caps & KVL_MV_SAME_HOST) && !same_host)
            continue;
        if ((m->caps & KVL_MV_SECRET) && !secret_len)
            continue;
        if ((m->caps & KVL_MV_FALLS_BACK) && fallen_back)
            continue;
        return m;
    }
    return NULL;
}

kvl_err kvl_mover_allowed(const kvl_config *cfg, const kvl_mover_ops *ops, const char *agent,
                          const char *peer)
{
    if (!mode_allows(cfg->transport, ops) && !(ops->caps & KVL_MV_ASKED))
        return kvl_fail(KVL_ERR_INVALID_ARG,
                        "agent '%s' runs transport='tcp' and takes no %s: '%s' read "
                        "stale metadata of it (add the peer again)",
                        agent, ops->what, peer);
    return KVL_OK;
}

uint32_t kvl_movers_caps(const kvl_config *cfg)
{
    uint32_t caps = 0;
    for (size_t i = 0; i < sizeof movers / sizeof *movers; i++)
        if (mode_allows(cfg->transport, movers[i]))
            caps |= movers[i]->caps;
    return caps;
}

kvl_err kvl_movers_usable(const kvl_config *cfg, uint32_t secret_len)
{
    for (size_t i = 0; i < sizeof movers / sizeof *movers; i++) {
        const kvl_mover_ops *m = movers[i];
        if (!(m->caps & KVL_MV_ASKED) || !mode_allows(cfg->transport, m))
            continue; /* checked only where Config.transport asks for it */
        kvl_err e = m->usable ? m->usable(cfg, secret_len) : KVL_OK;
        if (e)
            return e;
    }
    return KVL_OK;
}
