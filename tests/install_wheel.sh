#!/bin/sh
# Installs kvlink into an engine's virtualenv (.venv-vllm, .venv-sglang) as a user would: `pip
# install` of the wheel `make wheel` built from the sdist (dist/kvlink-*.whl), its dependencies
# resolved against what the engine pinned. Removes the path hook older checkouts wrote (a .pth
# naming the checkout), then checks that kvlink imports from the venv's own site-packages, run
# from a folder outside the checkout. On failure the reason goes to $VENV/.wheel-unavailable (the
# tests of that engine then skip saying why, and fail in CI; the next run tries again) and the
# script exits 0.
set -u
VENV=$(cd "${1:?usage: tests/install_wheel.sh VENV}" && pwd) || exit 2
ROOT=$(cd "$(dirname "$0")/.." && pwd)
rm -f "$VENV/.wheel-unavailable"
[ -e "$VENV/.unavailable" ] && exit 0   # the engine itself could not be installed: said there
WHEEL=$(ls "$ROOT"/dist/kvlink-*.whl 2>/dev/null | head -n 1)
LOG=$(mktemp)
fail() {
    { echo "$1"; tail -n 5 "$LOG"; } > "$VENV/.wheel-unavailable"
    echo "$VENV: $1 (details in $VENV/.wheel-unavailable)" >&2
    rm -f "$LOG" "$VENV/.kvlink-wheel"
    exit 0
}
[ -n "$WHEEL" ] || fail "no wheel in dist/ (make wheel builds it)"
# platlib: the wheel holds a C extension (on Fedora / RHEL that is lib64, not purelib's lib)
SITE=$("$VENV/bin/python" -c "import os, sysconfig; print(os.path.realpath(sysconfig.get_paths()['platlib']))")
PURE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
rm -rf "$PURE/kvlink-checkout.pth" "$PURE"/kvlink_checkout-*.dist-info \
    "$PURE"/kvlink_sglang_plugin-*.dist-info
"$VENV/bin/pip" uninstall -q -y kvlink > "$LOG" 2>&1 || true
"$VENV/bin/pip" install -q "$WHEEL" >> "$LOG" 2>&1 || fail "pip install $WHEEL failed in $VENV"
GOT=$(cd / && "$VENV/bin/python" -c "import os, kvlink, kvlink.store; print(os.path.realpath(kvlink.__file__))" 2>> "$LOG") \
    || fail "kvlink from $WHEEL does not import in $VENV"
case "$GOT" in
    "$SITE"/*) ;;
    *) fail "kvlink imports from $GOT, not from $SITE" ;;
esac
rm -f "$LOG"
touch "$VENV/.kvlink-wheel"
