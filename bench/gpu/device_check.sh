#!/usr/bin/env bash
# bench/gpu/device_check.sh: kvlink's GPU checks on a machine with a CUDA GPU (one H200
# was the target), in under 5 minutes:
#   1. a venv in /tmp with kvlink from this checkout (pip install -e .[test]); CuPy and
#      the CUDA runtime wheel are installed if pip can reach an index, else whatever the
#      machine has is used (the venv sees the system's site-packages);
#   2. pytest tests/integration/test_gpu.py (the GPU tests must run, not skip);
#   3. bench/gpu/device_bench.py: cudaMemcpy D2D/D2H/H2D baselines, then a 1 GiB kvlink
#      push GPU->GPU and host->host over loopback TCP in the same run, as JSON rows.
# Usage: bench/gpu/device_check.sh [SIZE]   (SIZE: default 1GiB)
# Output: the JSON rows on stdout (also in $OUT/gpu_bench.jsonl when OUT is set).
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${KVLINK_GPU_VENV:-/tmp/kvlink-gpu-venv}"
SIZE="${1:-1GiB}"
OUTDIR="${OUT:-/tmp}"
PIP_TIMEOUT=60

say() { printf '== %s\n' "$*" >&2; }

cd "$REPO" || exit 1
nvidia-smi --query-gpu=name,pci.bus_id,driver_version,memory.total --format=csv >&2 ||
    say "nvidia-smi failed (no driver?): the GPU tests will skip"

if [ ! -x "$VENV/bin/python" ]; then
    say "venv $VENV (with the system's site-packages)"
    python3 -m venv --system-site-packages "$VENV" || rm -rf "$VENV"
fi
if [ -x "$VENV/bin/python" ]; then
    PY="$VENV/bin/python"
else
    say "no venv (python3-venv missing?): using python3 itself"
    PY="$(command -v python3)"
fi
PIP=("$PY" -m pip --disable-pip-version-check --timeout "$PIP_TIMEOUT")

say "GPU packages (optional: carrying on without them if the index is unreachable)"
timeout 180 "${PIP[@]}" install -q cupy-cuda12x nvidia-cuda-runtime-cu12 ||
    say "pip could not install cupy-cuda12x / nvidia-cuda-runtime-cu12: using what is installed"

say "kvlink from $REPO"
if ! timeout 240 "${PIP[@]}" install -q -e ".[test]"; then
    say "pip install -e .[test] failed (no index?): with the installed build tools instead"
    if ! timeout 240 "${PIP[@]}" install -q --no-build-isolation --no-deps -e .; then
        say "no pip install at all: building the C core in place"
        timeout 240 "$PY" setup.py -q build_ext --inplace || exit 1
    fi
    export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" - <<'PYEOF' >&2
import kvlink
from kvlink import _cuda
try:
    _cuda.ensure_runtime()
    print("CUDA runtime loaded; GPU 0 at", _cuda.gpu_numa_node(0))
except kvlink.RegistrationError as exc:
    print("CUDA runtime:", exc)
try:
    import cupy
    print("cupy", cupy.__version__, "devices:", cupy.cuda.runtime.getDeviceCount())
except Exception as exc:  # noqa: BLE001 - report whatever stops CuPy
    print("cupy unavailable:", type(exc).__name__, exc)
PYEOF

status=0
say "pytest tests/integration/test_gpu.py"
timeout 180 "$PY" -m pytest tests/integration/test_gpu.py -q -p no:cacheprovider -rs || status=1

say "kvlink-bench loopback --quick --mem cuda"
timeout 90 "$PY" -m kvlink.cli.bench loopback --quick --mem cuda --json --compare none || status=1

say "GPU benchmark ($SIZE)"
if timeout 150 "$PY" bench/gpu/device_bench.py --size "$SIZE" | tee "$OUTDIR/gpu_bench.jsonl"; then
    :
else
    status=1
fi
exit "$status"
