#!/usr/bin/env bash
# sparsecar on one host, end to end: two sparsecard daemons (two "nodes" on loopback), a PyTorch
# DDP job started by torch's launcher (one launcher per node), `sparsecarctl status` against each
# daemon, and Prometheus scraping both. README.md ("Quick start on one host") walks through it.
#
#   examples/quickstart/run.sh             # from the repository root, after building (README)
#
# Every flag is passed explicitly, so nothing depends on defaults. Override with the environment:
#   BUILD_DIR                  the build tree (default: the first of build, build-release, build-test)
#   SPARSECARD, SPARSECARCTL   the binaries (default: the build tree's, else on PATH)
#   PYTHON                     an interpreter with torch (default: the first of python3,
#                              /usr/bin/python3 that imports torch); sparsecar comes from the
#                              build tree (or is installed)
#   QUICKSTART_DIR             where sockets and logs go (default: a new temporary directory)
#   COORDINATOR_PORT MASTER_PORT METRICS_PORT_0 METRICS_PORT_1 PROMETHEUS_PORT   (defaults:
#                              29600 29500 9464 9465 9090)
#   STEPS                      training steps (default 40)
#   JOB_TIMEOUT                seconds the DDP job may take before it is stopped (default 300)
#   PROMETHEUS                 the prometheus binary, or "off" (default: on PATH if present)
# Exit status 0 when the job finished and both daemons report its steps. Everything it started
# is stopped on exit.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
# The build tree: $BUILD_DIR, else the first of build/, build-release/ (scripts/demo), build-test/
# (scripts/test) that has the daemon; its binaries and Python package win over installed ones.
if [ -z "${BUILD_DIR:-}" ]; then
  for d in build build-release build-test; do
    if [ -x "$root/$d/daemon/sparsecard" ]; then BUILD_DIR=$root/$d; break; fi
  done
fi
find_bin() {  # NAME: the build tree, else PATH
  local name=$1
  if [ -n "${BUILD_DIR:-}" ] && [ -x "$BUILD_DIR/daemon/$name" ]; then echo "$BUILD_DIR/daemon/$name"
  elif command -v "$name" >/dev/null 2>&1; then command -v "$name"
  else echo "run.sh: $name not found: build the repository (README.md) or set ${name^^}" >&2; exit 1; fi
}
SPARSECARD=${SPARSECARD:-$(find_bin sparsecard)}
SPARSECARCTL=${SPARSECARCTL:-$(find_bin sparsecarctl)}
if [ -z "${PYTHON:-}" ]; then
  for p in python3 /usr/bin/python3; do
    if "$p" -c "import torch" >/dev/null 2>&1; then PYTHON=$p; break; fi
  done
  [ -n "${PYTHON:-}" ] || { echo "run.sh: no python3 with torch (Debian: apt-get install python3-torch)" >&2; exit 1; }
fi
# The sparsecar package: the build tree's, else an installed one (pip install ./python).
if [ -n "${BUILD_DIR:-}" ] && [ -d "$BUILD_DIR/python/sparsecar" ]; then
  export PYTHONPATH="$BUILD_DIR/python${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PYTHON" -c "import sparsecar.torch" || { echo "run.sh: $PYTHON cannot import sparsecar.torch" >&2; exit 1; }
COORDINATOR_PORT=${COORDINATOR_PORT:-29600}
MASTER_PORT=${MASTER_PORT:-29500}
METRICS_PORT_0=${METRICS_PORT_0:-9464}
METRICS_PORT_1=${METRICS_PORT_1:-9465}
PROMETHEUS_PORT=${PROMETHEUS_PORT:-9090}
STEPS=${STEPS:-40}
JOB_TIMEOUT=${JOB_TIMEOUT:-300}
PROMETHEUS=${PROMETHEUS:-$(command -v prometheus || echo off)}
dir=${QUICKSTART_DIR:-$(mktemp -d /tmp/sparsecar-quickstart.XXXXXX)}
mkdir -p "$dir"
echo "quickstart: sockets and logs in $dir"

pids=()
cleanup() {
  local status=$?
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  exit $status
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# 1. One daemon per node. On one host they need their own trainer socket, control socket and
#    metrics port; UCX goes over loopback TCP.
metrics_ports=("$METRICS_PORT_0" "$METRICS_PORT_1")
for r in 0 1; do
  "$SPARSECARD" --rank "$r" --world-size 2 --coordinator "127.0.0.1:$COORDINATOR_PORT" \
    --local-clients 1 --socket "$dir/node$r.sock" --control "ipc://$dir/node$r-control.sock" \
    --metrics-listen "127.0.0.1:${metrics_ports[$r]}" --ucx-tls tcp --ucx-net-devices lo \
    --density 0.05 --tensor-overrides '*.bias: compression=off' \
    >"$dir/sparsecard-$r.log" 2>&1 &
  pids+=($!)
done
for r in 0 1; do
  for _ in $(seq 300); do [ -S "$dir/node$r.sock" ] && break; sleep 0.1; done
  [ -S "$dir/node$r.sock" ] || { echo "quickstart: daemon $r did not start:"; tail "$dir/sparsecard-$r.log"; exit 1; }
done
echo "quickstart: daemons up (metrics on :$METRICS_PORT_0 and :$METRICS_PORT_1)"

# 2. Prometheus scraping both daemons every second.
if [ "$PROMETHEUS" != off ]; then
  cat >"$dir/prometheus.yml" <<YAML
global: {scrape_interval: 1s}
scrape_configs:
  - job_name: sparsecar
    static_configs:
      - targets: ["127.0.0.1:$METRICS_PORT_0", "127.0.0.1:$METRICS_PORT_1"]
YAML
  "$PROMETHEUS" --config.file="$dir/prometheus.yml" --storage.tsdb.path="$dir/prometheus-data" \
    --web.listen-address="127.0.0.1:$PROMETHEUS_PORT" --log.level=warn >"$dir/prometheus.log" 2>&1 &
  pids+=($!)
fi

# 3. The DDP job: one launcher per node, as on two machines. The node's daemon is found through
#    SPARSECAR_SOCKET; SPARSECAR_NODE_RANK / SPARSECAR_NNODES are the node-level values (torch's
#    RANK / WORLD_SIZE are per process). --redirects 1 --tee 1: torch 1.13's launcher fails on
#    Python 3.11 without them ("'NoneType' object has no attribute 'get'"), a torch bug.
launchers=()
for r in 0 1; do
  SPARSECAR_SOCKET="$dir/node$r.sock" SPARSECAR_NODE_RANK=$r SPARSECAR_NNODES=2 \
    timeout --kill-after=10 "$JOB_TIMEOUT" "$PYTHON" -m torch.distributed.run --nnodes 2 --node_rank "$r" --nproc_per_node 1 \
      --master_addr 127.0.0.1 --master_port "$MASTER_PORT" --redirects 1 --tee 1 \
      --log_dir "$dir/torchrun-$r" \
      "$here/train_ddp.py" --steps "$STEPS" >"$dir/launcher-$r.log" 2>&1 &
  launchers+=($!)
  pids+=($!)  # `timeout` leads the launcher's process group and passes a TERM on to it
done
status=0
for r in 0 1; do
  wait "${launchers[$r]}" || { status=$?; echo "quickstart: launcher $r failed ($status):"; tail -20 "$dir/launcher-$r.log"; }
done
[ $status -eq 0 ] || exit $status
grep -h "sparsecar\|train_ddp" "$dir/launcher-0.log" | sed 's/^/  /'

# 4. What each daemon says.
for r in 0 1; do
  echo "quickstart: sparsecarctl status of node $r"
  "$SPARSECARCTL" --endpoint "ipc://$dir/node$r-control.sock" --json status >"$dir/status-$r.json"
  "$SPARSECARCTL" --endpoint "ipc://$dir/node$r-control.sock" status | sed 's/^/  /'
done
"$PYTHON" - "$dir" <<'PY'
import json, sys
for r in (0, 1):
    s = json.load(open(f"{sys.argv[1]}/status-{r}.json"))
    s = s.get("result", s)
    done = s["clients"]["steps_completed"]
    if not done:
        sys.exit(f"quickstart: node {r} reports no completed steps")
    print(f"quickstart: node {r}: {done} tensor steps completed (every parameter tensor, every sparse step)")
PY

# 5. What Prometheus scraped from both.
if [ "$PROMETHEUS" != off ]; then
  "$PYTHON" - "$PROMETHEUS_PORT" <<'PY'
import json, sys, time, urllib.parse, urllib.request
url = f"http://127.0.0.1:{sys.argv[1]}/api/v1/query?" + urllib.parse.urlencode(
    {"query": 'sum by (instance) (sparsecar_steps_total{result="ok"})'})
deadline = time.time() + 30
while True:
    try:
        rows = json.load(urllib.request.urlopen(url, timeout=5))["data"]["result"]
    except OSError:
        rows = []
    if len(rows) == 2 and all(float(r["value"][1]) > 0 for r in rows) or time.time() > deadline:
        break
    time.sleep(0.5)
for r in rows:
    print(f"quickstart: prometheus: {r['metric']['instance']} sparsecar_steps_total{{result=\"ok\"}} = {r['value'][1]}")
if len(rows) != 2:
    sys.exit(f"quickstart: prometheus has steps from {len(rows)} of 2 daemons")
PY
fi
echo "quickstart: done"
