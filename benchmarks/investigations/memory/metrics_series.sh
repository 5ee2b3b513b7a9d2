#!/usr/bin/env bash
# Does the node's metrics agent (Ray's DashboardAgent) get new Prometheus series per request?
# Starts `dsbd serve`, runs the soak's load (`dsbd bench soak`, 32 clients) for SECONDS, and
# saves the metrics page and the agent's RSS at minute 1 and near the end; prints the series
# counted per metric name, most grown first, and the agent's RSS (docs/history/RELIABILITY-chronicle.md section
# 10, the ninth soak). A series set that grows with requests is a cardinality leak; one set per
# worker appears with each replica Serve adds.
#
#   bash benchmarks/investigations/memory/metrics_series.sh [SECONDS] [OUTDIR]
#   (default 300 s, /tmp/metrics_series)
set -euo pipefail
cd "$(dirname "$0")/../../.."  # the repository
seconds=${1:-300}
w=${2:-/tmp/metrics_series}
rm -rf "$w"; mkdir -p "$w"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
port=$(python3 -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
.venv/bin/dsbd serve --port "$port" --ready-file "$w/ready" > "$w/server.log" 2>&1 &
server=$!
trap 'kill -TERM "$server" 2>/dev/null; wait "$server" || true' EXIT
until [ -s "$w/ready" ]; do
  kill -0 "$server" 2>/dev/null || { tail -20 "$w/server.log"; exit 1; }
  sleep 1
done
read -r url murl < <(python3 -c "import json,sys; d = json.load(open(sys.argv[1])); print(d['url'], d['metrics_url'])" "$w/ready")
.venv/bin/python -m dsbd bench soak --url "$url" --pid "$server" --duration "$seconds" \
  --window "$(( seconds / 2 ))" --out "$w/soak.json" > "$w/soak.log" 2>&1 &
load=$!
agent() { ps -o rss= -p "$(pgrep -f DashboardAgent | head -1)"; }
sleep 60; curl -s "$murl" > "$w/m1.txt"; agent > "$w/agent1.txt"
sleep $(( seconds - 80 )); curl -s "$murl" > "$w/m2.txt"; agent > "$w/agent2.txt"
wait "$load"
python3 - "$w" <<'EOF2'
import re, sys
from collections import Counter
w = sys.argv[1]
def series(name):
    return Counter(re.split(r"[{ ]", line, maxsplit=1)[0] for line in open(f"{w}/{name}")
                   if line.strip() and not line.startswith("#"))
a, b = series("m1.txt"), series("m2.txt")
print(f"series: {sum(a.values())} at minute 1 -> {sum(b.values())} at the end")
for name in sorted(set(a) | set(b), key=lambda n: a[n] - b[n])[:12]:
    print(f"  {name} {a[name]} -> {b[name]}")
rss = [int(open(f"{w}/agent{i}.txt").read()) / 1024 for i in (1, 2)]
print(f"DashboardAgent RSS {rss[0]:.1f} -> {rss[1]:.1f} MiB")
EOF2
