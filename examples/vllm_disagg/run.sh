#!/bin/sh
# Prefill and decode vLLM OpenAI servers with KvlinkConnector, the proxy and a client, on this
# host (kvlink over 4 loopback paths). Needs the vLLM virtualenv: `make vllm-venv`.
#
#   examples/vllm_disagg/run.sh [pull|push]
#
# Every process started here is stopped on exit. Logs: $LOGS (default /tmp/kvlink-vllm-disagg).
set -eu
MODE=${1:-pull}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
PY=${PY:-$ROOT/.venv-vllm/bin/python}
LOGS=${LOGS:-/tmp/kvlink-vllm-disagg}
MODEL=${MODEL:-$LOGS/model}
SECRET=${KVLINK_SECRET:-$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')}
mkdir -p "$LOGS"
"$PY" "$HERE/make_model.py" "$MODEL" --layers 8 --hidden 256 --heads 4 --kv-heads 2 --head-dim 64 > /dev/null

PIDS=""
cleanup() { for p in $PIDS; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM

serve() {  # name port role cpu
    KVLINK_SECRET=$SECRET VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=$4 HF_HUB_OFFLINE=1 \
    "$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" --port "$2" \
        --dtype float32 --max-model-len 2048 --block-size 32 --enforce-eager \
        --no-enable-prefix-caching --max-num-batched-tokens 2048 \
        --kv-transfer-config "{\"kv_connector\":\"KvlinkConnector\",\"kv_connector_module_path\":\"kvlink.integrations.vllm\",\"kv_role\":\"$3\",\"kv_load_failure_policy\":\"recompute\",\"kv_connector_extra_config\":{\"nics\":\"loopback:4\"}}" \
        > "$LOGS/$1.log" 2>&1 &
    PIDS="$PIDS $!"
}
serve prefill 8100 kv_producer 0
serve decode 8200 kv_consumer 1
for port in 8100 8200; do
    i=0
    until "$PY" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/v1/models', timeout=2)" 2>/dev/null; do
        i=$((i + 1)); [ $i -lt 240 ] || { echo "server on $port did not start: see $LOGS"; exit 1; }
        sleep 1
    done
done
"$PY" "$HERE/proxy.py" --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \
    --mode "$MODE" --port 8000 > "$LOGS/proxy.log" 2>&1 &
PIDS="$PIDS $!"
sleep 3
echo "mode $MODE: TTFT through the proxy (prefill + transfer + first decode step)"
"$PY" "$HERE/client.py" --url http://127.0.0.1:8000 --models-url http://127.0.0.1:8200 \
    --lengths "${LENGTHS:-256,1024,1900}" --repeat "${REPEAT:-2}"
echo "the same prompts on decode alone (it computes the prompt itself)"
"$PY" "$HERE/client.py" --url http://127.0.0.1:8200 --lengths "${LENGTHS:-256,1024,1900}" --repeat 1
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
