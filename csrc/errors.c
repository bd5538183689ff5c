/* errors.c: error names and the thread-local last-error text. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

static __thread char last_error[1024];

const char *kvl_last_error(void) { return last_error; }

kvl_err kvl_fail(kvl_err err, const char *fmt, ...)
{
    /* format aside first: callers often pass kvl_last_error() as an argument */
    char tmp[sizeof last_error];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    memcpy(last_error, tmp, sizeof tmp);
    return err;
}

kvl_err kvl_fail_errno(const char *what)
{
    int e = errno;
    return kvl_fail(e == ENOMEM ? KVL_ERR_NOMEM : KVL_ERR_SYSTEM, "%s: %s (errno %d)",
                    what, strerror(e), e);
}

void kvl_clear_error(void) { last_error[0] = '\0'; }

const char *kvl_err_name(int err)
{
    static const char *const names[] = {
        [KVL_OK] = "KVL_OK",
        [KVL_ERR_INVALID_ARG] = "KVL_ERR_INVALID_ARG",
        [KVL_ERR_NOMEM] = "KVL_ERR_NOMEM",
        [KVL_ERR_SYSTEM] = "KVL_ERR_SYSTEM",
        [KVL_ERR_CLOSED] = "KVL_ERR_CLOSED",
        [KVL_ERR_TIMEOUT] = "KVL_ERR_TIMEOUT",
        [KVL_ERR_UNKNOWN_PEER] = "KVL_ERR_UNKNOWN_PEER",
        [KVL_ERR_PEER_EXISTS] = "KVL_ERR_PEER_EXISTS",
        [KVL_ERR_UNREACHABLE] = "KVL_ERR_UNREACHABLE",
        [KVL_ERR_HANDSHAKE] = "KVL_ERR_HANDSHAKE",
        [KVL_ERR_DUPLICATE_NAME] = "KVL_ERR_DUPLICATE_NAME",
        [KVL_ERR_UNKNOWN_REGION] = "KVL_ERR_UNKNOWN_REGION",
        [KVL_ERR_OUT_OF_BOUNDS] = "KVL_ERR_OUT_OF_BOUNDS",
        [KVL_ERR_ACCESS_DENIED] = "KVL_ERR_ACCESS_DENIED",
        [KVL_ERR_BUSY] = "KVL_ERR_BUSY",
        [KVL_ERR_CONN_LOST] = "KVL_ERR_CONN_LOST",
        [KVL_ERR_CHECKSUM] = "KVL_ERR_CHECKSUM",
        [KVL_ERR_PROTOCOL] = "KVL_ERR_PROTOCOL",
        [KVL_ERR_END] = "KVL_ERR_END",
        [KVL_ERR_DEADLINE] = "KVL_ERR_DEADLINE",
        [KVL_ERR_AUTH] = "KVL_ERR_AUTH",
        [KVL_ERR_CANCELLED] = "KVL_ERR_CANCELLED",
    };
    if (err < 0 || (size_t)err >= sizeof names / sizeof names[0] || !names[err])
        return "KVL_ERR_UNKNOWN";
    return names[err];
}
