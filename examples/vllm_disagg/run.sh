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
if [ -f "$ROOT/.venv-vllm/.unavailable" ] && [ "$PY" = "$ROOT/.venv-vllm/bin/python" ]; then
    echo "the vLLM virtualenv could not be built: $(cat "$ROOT/.venv-vllm/.unavailable")" >&2
    exit 1
fi
if ! "$PY" -c "import vllm, kvlink.integrations.vllm" 2>/dev/null; then
    echo "$PY cannot import vllm and kvlink: run \`make vllm-venv\` first" >&2
    "$PY" -c "import vllm, kvlink.integrations.vllm" 2>&1 | tail -n 1 >&2
    exit 1
fi
mkdir -p "$LOGS"
if ! "$PY" "$HERE/make_model.py" "$MODEL" --layers 8 --hidden 256 --heads 4 --kv-heads 2 \
        --head-dim 64 > "$LOGS/make_model.log" 2>&1; then
    echo "the model could not be built; the end of $LOGS/make_model.log:" >&2
    tail -n 5 "$LOGS/make_model.log" >&2
    exit 1
fi

# Namespaces when root and `ip netns` works, unless NETNS=0.
TAG=${TAG:-v2ex}
NETNS=${NETNS:-auto}
if [ "$NETNS" = auto ]; then
    NETNS=0
    if [ "$(id -u)" = 0 ] && ip netns list >/dev/null 2>&1; then NETNS=1; fi
fi
PIDS=""
# Each server in a session of its own (API server, engine core and worker: one process group),
# so that cleanup stops all three. A vLLM server that is still starting may take minutes to
# honour SIGTERM: after 30 s the groups get SIGKILL.
SETSID=$(command -v setsid || true)
kill_groups() {  # signal: each server's process group
    for p in $PIDS; do kill "-$1" "-$p" 2>/dev/null || true; done
}
cleanup() {
    for p in $PIDS; do kill -TERM "-$p" 2>/dev/null || kill -TERM "$p" 2>/dev/null || true; done
    (sleep 30; kill_groups KILL) &
    dog=$!
    for p in $PIDS; do wait "$p" 2>/dev/null || true; done
    kill "$dog" 2>/dev/null || true
    kill_groups KILL  # what is left of a group whose leader has gone
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

# Each server's kvlink agent (in its worker) serves its own metrics on 127.0.0.1:<port + 1000>
# (KVLINK_METRICS_PORT): `kvlink top 127.0.0.1:9200` shows decode's paths; vLLM's own /metrics
# (`kvlink top 127.0.0.1:8200`) has the connector's counters only.
serve() {  # name port role cpu nics prefix...
    name=$1 port=$2 role=$3 cpu=$4 nics=$5
    shift 5
    # shellcheck disable=SC2086  # $SETSID: the command, or nothing
    KVLINK_SECRET=$SECRET KVLINK_METRICS_PORT=$((port + 1000)) \
    VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=$cpu HF_HUB_OFFLINE=1 \
    $SETSID "$@" "$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" --port "$port" \
        --dtype float32 --max-model-len 2048 --block-size 32 --enforce-eager \
        --no-enable-prefix-caching --max-num-batched-tokens 2048 \
        --kv-transfer-config "{\"kv_connector\":\"KvlinkConnector\",\"kv_connector_module_path\":\"kvlink.integrations.vllm\",\"kv_role\":\"$role\",\"kv_load_failure_policy\":\"recompute\",\"kv_connector_extra_config\":{\"nics\":$nics}}" \
        > "$LOGS/$name.log" 2>&1 &
    LAST=$!  # setsid and `ip netns exec` exec the server: this is its pid (and group)
    PIDS="$PIDS $LAST"
}
# shellcheck disable=SC2086  # $IN_A / $IN_B: a command prefix, or nothing
serve prefill 8100 kv_producer 0 "$NICS_A" $IN_A
PREFILL_PID=$LAST
# shellcheck disable=SC2086
serve decode 8200 kv_consumer 1 "$NICS_B" $IN_B
DECODE_PID=$LAST
# Both servers start at once; on 2 idle cores both answer after ~24 s (~23 CPU-seconds each),
# after 52-71 s with other jobs on the cores, much longer on busy ones (START_S bounds the
# wait). A server that exits (a refused setting stops it within seconds) ends the wait at once.
START_S=${START_S:-900}
T0=$(date +%s)
wait_up() {  # name url pid
    # shellcheck disable=SC2086
    until $IN_A "$PY" -c "import urllib.request as u; u.urlopen('$2/v1/models', timeout=2)" 2>/dev/null; do
        if ! kill -0 "$3" 2>/dev/null; then
            echo "the $1 server exited; the end of $LOGS/$1.log:" >&2
            tail -n 5 "$LOGS/$1.log" >&2
            exit 1
        fi
        if [ $(($(date +%s) - T0)) -ge "$START_S" ]; then
            echo "$1 ($2) not up within START_S=$START_S s: see $LOGS/$1.log" >&2
            exit 1
        fi
        sleep 1
    done
    echo "$1 up after $(($(date +%s) - T0)) s"
}
echo "starting prefill and decode (~25 s on 2 idle cores, longer on busy ones; logs in $LOGS)"
wait_up prefill "http://$PREFILL_HOST:8100" "$PREFILL_PID"
wait_up decode "http://$DECODE_HOST:8200" "$DECODE_PID"
# shellcheck disable=SC2086
$IN_A "$PY" "$HERE/proxy.py" --prefill "http://$PREFILL_HOST:8100" \
    --decode "http://$DECODE_HOST:8200" --mode "$MODE" --port 8000 > "$LOGS/proxy.log" 2>&1 &
PROXY_PID=$!
PIDS="$PIDS $PROXY_PID"
sleep 3
if ! kill -0 "$PROXY_PID" 2>/dev/null; then
    echo "the proxy exited; the end of $LOGS/proxy.log:" >&2
    tail -n 5 "$LOGS/proxy.log" >&2
    exit 1
fi
if [ "$NETNS" = 1 ]; then
    echo "prefill in kvl${TAG}a, decode in kvl${TAG}b, kvlink over the testbed's 4 links"
    echo "(paths meanwhile: ip netns exec kvl${TAG}b $ROOT/.venv-vllm/bin/kvlink top 127.0.0.1:9200)"
else
    echo "prefill and decode on this host, kvlink over 4 loopback paths"
    echo "(paths meanwhile: $ROOT/.venv-vllm/bin/kvlink top 127.0.0.1:9200; vLLM's counters:"
    echo " kvlink top 127.0.0.1:8200)"
fi
echo "mode $MODE: TTFT through the proxy (prefill + transfer + first decode step)"
# shellcheck disable=SC2086
$IN_A "$PY" "$HERE/client.py" --url http://127.0.0.1:8000 --models-url "http://$DECODE_HOST:8200" \
    --lengths "${LENGTHS:-256,1024,1900}" --repeat "${REPEAT:-2}" --save "$LOGS/through-proxy.jsonl"
echo "the same prompts on decode alone (it computes each prompt itself): the texts must match"
# shellcheck disable=SC2086
$IN_A "$PY" "$HERE/client.py" --url "http://$DECODE_HOST:8200" \
    --lengths "${LENGTHS:-256,1024,1900}" --repeat "${REPEAT:-2}" --against "$LOGS/through-proxy.jsonl"
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
