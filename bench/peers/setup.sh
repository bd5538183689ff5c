#!/usr/bin/env bash
# Install each peer library into its own virtual environment: bench/peers/.venvs/<peer>.
#
#     bash bench/peers/setup.sh [mooncake] [nixl] [ucxx]      (default: all three)
#
# Recipes are the ones measured in ../shared/peers.md (why each looks the way it does is there):
#   mooncake  mooncake-transfer-engine-non-cuda==0.3.13.post1 numpy, plus apt libibverbs1 and
#             ibverbs-providers (the wheel links libibverbs even for TCP; the CUDA wheel needs
#             libcuda and fails to import without a GPU)
#   nixl      nixl-cu12 with --no-deps, then numpy (the `nixl` meta package pulls 6 GB of CUDA)
#   ucxx      ucxx-cu12 numpy
#
# Idempotent: a venv whose import check already passes is left alone. Each peer's outcome is
# written to .venvs/<peer>.status ("ok" or "failed: <reason>"); compare.py reports a failed peer
# with that reason instead of dropping it. Exit status: the number of peers that failed.
set -u

HERE=$(cd "$(dirname "$0")" && pwd)
VENVS="$HERE/.venvs"
PY=${PYTHON:-python3}
mkdir -p "$VENVS"

# The import each worker needs; a venv passes when this runs.
declare -A CHECK=(
    [mooncake]="from mooncake.engine import TransferEngine; import numpy"
    # nixl-cu12 installs the module as nixl_cu12; the `nixl` meta package (not installed, see
    # above) is what provides the name `nixl`.
    [nixl]="from nixl_cu12 import nixl_agent, nixl_agent_config; import numpy"
    [ucxx]="import ucxx, numpy"
)
declare -A PIP=(
    [mooncake]="mooncake-transfer-engine-non-cuda==0.3.13.post1 numpy"
    [nixl]="numpy"  # nixl-cu12 itself goes in with --no-deps first, below
    [ucxx]="ucxx-cu12 numpy"
)
# Set for nixl so its import check does not probe InfiniBand modules (peers.md: without
# UCX_MODULES the process segfaults at exit).
export UCX_TLS=tcp UCX_NET_DEVICES=lo UCX_MODULES='^ib,ib_mlx5,ib_mlx5_ext'

status() {  # peer, text
    printf '%s\n' "$2" >"$VENVS/$1.status"
}

apt_for_mooncake() {
    local missing=()
    for p in libibverbs1 ibverbs-providers; do
        dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    echo "mooncake: apt-get install ${missing[*]}"
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >"$VENVS/mooncake.apt.log" 2>&1; then
        apt-get update -q >>"$VENVS/mooncake.apt.log" 2>&1
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >>"$VENVS/mooncake.apt.log" 2>&1 \
            || { echo "apt-get install ${missing[*]} failed (log: $VENVS/mooncake.apt.log)"; return 1; }
    fi
}

install_peer() {  # peer
    local peer=$1 venv="$VENVS/$1" log="$VENVS/$1.pip.log"
    # Run the checks from / so no file in the current directory shadows a module.
    if [ -x "$venv/bin/python" ] && (cd / && "$venv/bin/python" -c "${CHECK[$peer]}" >/dev/null 2>&1); then
        echo "$peer: already installed ($venv)"
        status "$peer" ok
        return 0
    fi
    if [ "$peer" = mooncake ]; then
        local why
        if ! why=$(apt_for_mooncake); then
            echo "$peer: FAILED: $why"; status "$peer" "failed: $why"; return 1
        fi
    fi
    [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv" || {
        echo "$peer: FAILED: $PY -m venv $venv"; status "$peer" "failed: could not create venv"; return 1
    }
    echo "$peer: pip install (log: $log)"
    : >"$log"
    "$venv/bin/python" -m pip install -q --upgrade pip >>"$log" 2>&1
    if [ "$peer" = nixl ]; then
        "$venv/bin/python" -m pip install --no-deps nixl-cu12 >>"$log" 2>&1 || {
            local why; why=$(grep -E '^ERROR' "$log" | tail -1)
            echo "$peer: FAILED: pip install --no-deps nixl-cu12: $why"
            status "$peer" "failed: pip install --no-deps nixl-cu12: $why"; return 1
        }
    fi
    # shellcheck disable=SC2086  # the package list is meant to split
    "$venv/bin/python" -m pip install ${PIP[$peer]} >>"$log" 2>&1 || {
        local why; why=$(grep -E '^ERROR' "$log" | tail -1)
        echo "$peer: FAILED: pip install ${PIP[$peer]}: $why"
        status "$peer" "failed: pip install ${PIP[$peer]}: $why"; return 1
    }
    local err
    if ! err=$(cd / && "$venv/bin/python" -c "${CHECK[$peer]}" 2>&1 >/dev/null); then
        err=$(printf '%s\n' "$err" | grep -v '^\s*$' | tail -1)
        echo "$peer: FAILED: import check: $err"
        status "$peer" "failed: import: $err"; return 1
    fi
    local ver
    ver=$("$venv/bin/python" -m pip list 2>/dev/null | grep -iE '^(mooncake|nixl|ucxx|libucx)' | tr -s ' ' | paste -sd, -)
    echo "$peer: ok ($ver)"
    status "$peer" ok
}

peers=("$@")
[ ${#peers[@]} -eq 0 ] && peers=(mooncake nixl ucxx)
failed=0
for p in "${peers[@]}"; do
    if [ -z "${CHECK[$p]+x}" ]; then
        echo "unknown peer $p (known: ${!CHECK[*]})"; failed=$((failed + 1)); continue
    fi
    install_peer "$p" || failed=$((failed + 1))
done
if ! command -v iperf3 >/dev/null; then
    echo "iperf3: not installed (apt-get install iperf3); compare.py reports it as unavailable"
fi
echo "setup: $failed of ${#peers[@]} peers failed"
exit "$failed"
