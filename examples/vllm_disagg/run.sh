#!/bin/sh
# Prefill and decode vLLM OpenAI servers with KvlinkConnector, the proxy and a client.
# As root: prefill in one network namespace of a kvlink testbed, decode in the other, kvlink
# over the testbed's 4 links (198.18.0.0/15; NETNS=0 turns this off). Otherwise: one host,
# kvlink over 4 loopback paths. Needs the vLLM virtualenv: `make vllm-venv`.
#
#   examples/vllm_disagg/run.sh [pull|push]
#
# Every process started here is stopped, and the testbed removed, on exit.
# Logs: $LOGS (default /tmp/kvlink-vllm-disagg).
set -eu
MODE=${1:-pull}
case $MODE in pull|push) ;; *) echo "usage: $0 [pull|push]" >&2; exit 2 ;; esac
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
PY=${PY:-$ROOT/.venv-vllm/bin/python}
LOGS=${LOGS:-/tmp/kvlink-vllm-disagg}
MODEL=${MODEL:-$LOGS/model}
SECRET=${KVLINK_SECRET:-$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')}
mkdir -p "$LOGS"
"$PY" "$HERE/make_model.py" "$MODEL" --layers 8 --hidden 256 --heads 4 --kv-heads 2 --head-dim 64 > /dev/null

# Namespaces when root and `ip netns` works, unless NETNS=0.
TAG=${TAG:-v2ex}
NETNS=${NETNS:-auto}
if [ "$NETNS" = auto ]; then
    NETNS=0
    if [ "$(id -u)" = 0 ] && ip netns list >/dev/null 2>&1; then NETNS=1; fi
fi
PIDS=""
cleanup() {
    for p in $PIDS; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    if [ "$NETNS" = 1 ]; then "$PY" -m kvlink.cli.main testbed down --tag "$TAG" >/dev/null || true; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if [ "$NETNS" = 1 ]; then
    # 4 links; RATE (e.g. 2gbit) shapes each one, unshaped by default
    "$PY" -m kvlink.cli.main testbed up --tag "$TAG" --links 4 --rate "${RATE:-none}"
    IN_A="ip netns exec kvl${TAG}a"
    IN_B="ip netns exec kvl${TAG}b"
    # each agent on its side's 4 testbed addresses: one kvlink path per link
    NICS_A='["198.18.0.1","198.18.1.1","198.18.2.1","198.18.3.1"]'
    NICS_B='["198.18.0.2","198.18.1.2","198.18.2.2","198.18.3.2"]'
    PREFILL_HOST=127.0.0.1  # the proxy and client run in side a, beside prefill
    DECODE_HOST=198.18.0.2  # decode's HTTP port, reached over link 0
else
    IN_A=""
    IN_B=""
    NICS_A='"loopback:4"'
    NICS_B='"loopback:4"'
    PREFILL_HOST=127.0.0.1
    DECODE_HOST=127.0.0.1
fi

serve() {  # name port role cpu nics prefix...
    name=$1 port=$2 role=$3 cpu=$4 nics=$5
    shift 5
    KVLINK_SECRET=$SECRET VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=$cpu HF_HUB_OFFLINE=1 \
    "$@" "$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" --port "$port" \
        --dtype float32 --max-model-len 2048 --block-size 32 --enforce-eager \
        --no-enable-prefix-caching --max-num-batched-tokens 2048 \
        --kv-transfer-config "{\"kv_connector\":\"KvlinkConnector\",\"kv_connector_module_path\":\"kvlink.integrations.vllm\",\"kv_role\":\"$role\",\"kv_load_failure_policy\":\"recompute\",\"kv_connector_extra_config\":{\"nics\":$nics}}" \
        > "$LOGS/$name.log" 2>&1 &
    PIDS="$PIDS $!"  # `ip netns exec` execs the server: this is its pid
}
# shellcheck disable=SC2086  # $IN_A / $IN_B: a command prefix, or nothing
serve prefill 8100 kv_producer 0 "$NICS_A" $IN_A
# shellcheck disable=SC2086
serve decode 8200 kv_consumer 1 "$NICS_B" $IN_B
for url in "http://$PREFILL_HOST:8100" "http://$DECODE_HOST:8200"; do
    i=0
    # shellcheck disable=SC2086
    until $IN_A "$PY" -c "import urllib.request as u; u.urlopen('$url/v1/models', timeout=2)" 2>/dev/null; do
        i=$((i + 1)); [ $i -lt 240 ] || { echo "server $url did not start: see $LOGS"; exit 1; }
        sleep 1
    done
done
# shellcheck disable=SC2086
$IN_A "$PY" "$HERE/proxy.py" --prefill "http://$PREFILL_HOST:8100" \
    --decode "http://$DECODE_HOST:8200" --mode "$MODE" --port 8000 > "$LOGS/proxy.log" 2>&1 &
PIDS="$PIDS $!"
sleep 3
if [ "$NETNS" = 1 ]; then
    echo "prefill in kvl${TAG}a, decode in kvl${TAG}b, kvlink over the testbed's 4 links"
else
    echo "prefill and decode on this host, kvlink over 4 loopback paths"
fi
echo "mode $MODE: TTFT through the proxy (prefill + transfer + first decode step)"
# shellcheck disable=SC2086
$IN_A "$PY" "$HERE/client.py" --url http://127.0.0.1:8000 --models-url "http://$DECODE_HOST:8200" \
    --lengths "${LENGTHS:-256,1024,1900}" --repeat "${REPEAT:-2}"
echo "the same prompts on decode alone (it computes the prompt itself)"
# shellcheck disable=SC2086
$IN_A "$PY" "$HERE/client.py" --url "http://$DECODE_HOST:8200" \
    --lengths "${LENGTHS:-256,1024,1900}" --repeat 1
echo "idle CPU of each server (API server, engine core and worker processes together), 10 s"
"$PY" - $PIDS <<'PYEOF'
import sys, time, psutil
trees = {}
for pid in map(int, sys.argv[1:3]):  # prefill and decode servers
    p = psutil.Process(pid)
    trees[pid] = [p, *p.children(recursive=True)]
def cpu(procs):
    t = 0.0
    for p in procs:
        try:
            c = p.cpu_times(); t += c.user + c.system
        except psutil.Error:
            pass
    return t
time.sleep(3)
a = {pid: cpu(ps) for pid, ps in trees.items()}; t0 = time.monotonic()
time.sleep(10)
dt = time.monotonic() - t0
for name, pid in zip(("prefill", "decode"), trees):
    print(f"{name}: {(cpu(trees[pid]) - a[pid]) / dt:.3f} cores idle")
PYEOF
