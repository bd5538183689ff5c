/* path.c: the one place a path (or a peer's control connection) changes
 * state, so every change has a reason and reaches the log.
 *
 *   UP <-> DEGRADED      by its rate against the best path's (monitor.c)
 *   UP/DEGRADED -> STALLED  busy and silent (monitor.c); back to UP as soon
 *                        as anything moves, or cut (-> DOWN) when it stays silent
 *   any -> DOWN          the connection failed or was cut; re-probed after a backoff
 *   DOWN -> PROBING      a reconnect is in progress (probe.c)
 *   PROBING -> UP        reconnected; PROBING -> DOWN: it failed (backoff doubles)
 *
 * Engine thread only (and add_peer before the engine adopts the peer).
 */
#include <stdio.h>
#include <string.h>

#include "internal.h"

static const char *const names[] = {"UP", "DEGRADED", "DOWN", "PROBING", "STALLED"};

void kvl_peer_update_hint(kvl_peer *p)
{
    int any = 0;
    for (uint32_t i = 0; i < p->n_paths && !any; i++)
        any = kvl_path_may_work(&p->paths[i]);
    atomic_store(&p->may_work, any);
}

const char *kvl_path_state_name(uint32_t state)
{
    return state < sizeof names / sizeof *names ? names[state] : "?";
}

void kvl_path_set_state(kvl_peer *p, kvl_path *pa, uint32_t state, const char *why)
{
    if (pa->state == state)
        return;
    uint32_t old = pa->state;
    pa->state = state;
    kvl_peer_update_hint(p);
    int ctrl = pa == &p->ctrl_path;
    if (state == KVL_PATH_DOWN || state == KVL_PATH_STALLED) {
        if (why)
            snprintf(pa->last_error, sizeof pa->last_error, "%s", why);
        if (old == KVL_PATH_UP || old == KVL_PATH_DEGRADED) {
            pa->t_down_ns = kvl_now_ns(); /* when it left service (stalled or down) */
            snprintf(pa->down_cause, sizeof pa->down_cause, "%s", why ? why : "");
        }
    }
    /* DEGRADED <-> UP follows the rate every tick and PROBING is routine:
     * those are debug; losing and regaining a path is what operators want */
    int level = state == KVL_PATH_DOWN || state == KVL_PATH_STALLED ? KVL_LOG_WARNING
                : old == KVL_PATH_PROBING || old == KVL_PATH_STALLED ? KVL_LOG_INFO
                                                                      : KVL_LOG_DEBUG;
    if (old == KVL_PATH_PROBING && state == KVL_PATH_DOWN)
        level = KVL_LOG_DEBUG; /* a failed reconnect: the path was down already */
    if (ctrl) /* a data path's change wakes waiters with the snapshot that shows it */
        kvl_engine_paths_changed(p->agent);
    kvl_log(p->agent, level, p->name, ctrl ? -1 : (int)pa->index, "%s %s -> %s: %s -> %s%s%s",
            ctrl ? "control connection" : "path", pa->local, pa->rhost[0] ? pa->rhost : "?",
            kvl_path_state_name(old), kvl_path_state_name(state), why ? ": " : "", why ? why : "");
}
