#!/bin/sh
# Installs vllm-router (tests/vllm/requirements-router.txt: a Rust router in an abi3 wheel,
# entry point `vllm-router`) into the vLLM virtualenv, for tests/vllm/test_router.py and
# bench/vllm_router.py. A step of its own (not make_venv.sh), so that adding the router does
# not rebuild the vLLM virtualenv. On failure the reason is written to
# $VENV/vllm-router.unavailable and the script exits 0: the router tests then skip saying why
# (and fail in CI, KVLINK_REQUIRE_ALL=1).
set -u
VENV=${1:-.venv-vllm}
HERE=$(dirname "$0")
WHY="$VENV/vllm-router.unavailable"
LOG=$(mktemp)
rm -f "$WHY" "$VENV/.kvlink-router"
if [ -e "$VENV/.unavailable" ]; then
    echo "the vLLM virtualenv itself could not be built (see $VENV/.unavailable)" > "$WHY"
elif ! "$VENV/bin/pip" install -q --no-deps -r "$HERE/requirements-router.txt" > "$LOG" 2>&1; then
    { echo "pip cannot install $HERE/requirements-router.txt into $VENV"; tail -n 5 "$LOG"; } > "$WHY"
elif ! "$VENV/bin/vllm-router" --help > "$LOG" 2>&1; then
    { echo "$VENV/bin/vllm-router --help fails"; tail -n 5 "$LOG"; } > "$WHY"
else
    touch "$VENV/.kvlink-router"
fi
[ -e "$WHY" ] && echo "vllm-router: see $WHY (the router tests will skip)" >&2
rm -f "$LOG"
exit 0
