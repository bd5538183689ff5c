#!/bin/sh
# Builds the virtualenv the SGLang backend tests run in: sglang 0.5.23 from PyPI on CPU (the
# wheel without its CUDA dependencies), torch 2.13.0 from PIP_FIND_LINKS, SGLang's mooncake_tcp
# backend for the side-by-side figures, and, afterwards, kvlink from its wheel (its SGLang plugin's entry
# point with it). SGLang never enters the main .venv: kvlink does not depend on it. On failure the
# reason is written to $VENV/.unavailable and the script exits 0, so `make test` goes on and
# tests/sglang skip with that reason (fail under KVLINK_REQUIRE_ALL=1, i.e. in CI).
set -u
PYTHON=${PYTHON:-python3}
VENV=${1:-.venv-sglang}
HERE=$(cd "$(dirname "$0")" && pwd)
LOG=$(mktemp)
fail() {
    mkdir -p "$VENV"
    { echo "$1"; tail -n 5 "$LOG"; } > "$VENV/.unavailable"
    echo "sglang venv: $1 (the SGLang tests will skip; details in $VENV/.unavailable)" >&2
    rm -f "$LOG"
    exit 0
}
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV" > "$LOG" 2>&1 || fail "cannot create a virtualenv with $PYTHON"
P="$VENV/bin/pip"
"$P" install -q --upgrade pip setuptools wheel cffi >> "$LOG" 2>&1 || fail "pip cannot install setuptools/cffi"
"$P" install -q torch==2.13.0 >> "$LOG" 2>&1 \
    || fail "torch==2.13.0 is not installable (PIP_FIND_LINKS should name a folder holding its CPU wheel)"
# The wheel's own metadata asks for the CUDA stack (flashinfer, sgl-kernel, torch 2.14.1): install
# it alone, then the pure-Python and CPU dependencies it needs to serve on CPU.
"$P" install -q --no-deps sglang==0.5.23 >> "$LOG" 2>&1 || fail "sglang==0.5.23 is not installable"
"$P" install -q -r "$HERE/requirements-sglang-cpu.txt" >> "$LOG" 2>&1 \
    || fail "SGLang's CPU dependencies (tests/sglang/requirements-sglang-cpu.txt) are not installable"
# PyPI's torchvision is a CUDA build whose operator registrations fail beside CPU torch; SGLang
# imports only its transforms, so the registrations are emptied.
"$P" install -q --no-deps torchvision==0.28.0 dill soundfile >> "$LOG" 2>&1 || fail "torchvision==0.28.0 is not installable"
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "# emptied by kvlink's tests/sglang/make_venv.sh: the CUDA build's ops cannot load on CPU torch" \
    > "$SITE/torchvision/_meta_registrations.py" || fail "cannot patch torchvision in $SITE"
# SGLang's own mooncake_tcp backend: the baseline of the figures and of the output comparison.
"$P" install -q mooncake-transfer-engine-non-cuda==0.3.13.post1 >> "$LOG" 2>&1 \
    || fail "mooncake-transfer-engine-non-cuda==0.3.13.post1 is not installable"
# pytest for the in-process tests (tests/sglang/inproc); kvlink itself enters as users install
# it, from the wheel `make wheel` built from the sdist (the Makefile's sglang-venv target), never
# from this checkout.
"$P" install -q pytest pytest-timeout >> "$LOG" 2>&1 || fail "pytest is not installable"
# CPU stand-ins for two sgl_kernel helper ops SGLang imports when SGLANG_USE_CPU_ENGINE=1.
echo "$HERE/shim" > "$SITE/kvlink-sglang-shim.pth"
"$VENV/bin/python" -c "import sglang.srt.disaggregation.base.conn" >> "$LOG" 2>&1 \
    || fail "sglang does not import in $VENV"
rm -f "$VENV/.unavailable" "$LOG"
touch "$VENV/.kvlink-sglang"
