#!/usr/bin/env bash
# Memory settings side by side: the throughput and the memory of every process (Ray's GCS and
# raylet, the ingress, ...) of `dsbd serve` under the soak's load (`dsbd bench soak`, 32
# clients) for each variant in turn, each on a fresh server (docs/history/RELIABILITY-chronicle.md section 10,
# the seventh and eighth soaks).
#
#   bash benchmarks/investigations/memory/ray_memory_ab.sh \
#       [SECONDS_PER_RUN] [ROUNDS] [VARIANT ...]
#
# Variants (default: "defaults shipped both"):
#   defaults  Ray's own: object store 30 % of RAM touched as used, jemalloc's defaults
#   store     the store `dsbd serve` now starts (512 MiB, every page touched at start)
#   shipped   store + one jemalloc arena returning freed pages at once in the GCS server
#   both      store + those jemalloc settings in the GCS server and the raylet (rejected:
#             the raylet then served about a fifth fewer requests)
#   system-http  shipped, but the ingress and router replicas on glibc's malloc (`allocator:
#             system`, configs/serve_smollm2_system_malloc.yaml beside this script; default
#             jemalloc)
#   proxy-glibc  shipped, but Serve's controller and proxy on glibc's malloc (an empty LD_PRELOAD
#             in controller_options, configs/serve_smollm2_proxy_glibc.yaml beside this script;
#             default jemalloc: deployments/allocator.serve_controller_options)
# Writes results/ray_memory/ab_VARIANT_ROUND.json beside this script (the soak's output) and
# appends "variant round requests completed p50 p99 load-before load-after" to ab_runs.txt there.
# Run it on a quiet machine: the variants are compared by the requests each served.
set -euo pipefail
cd "$(dirname "$0")/../../.."  # the repository
here=benchmarks/investigations/memory
seconds=${1:-200}
rounds=${2:-1}
shift $(( $# > 2 ? 2 : $# ))
variants=(defaults shipped both)
(( $# )) && variants=("$@")
out=$here/results/ray_memory
mkdir -p "$out"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# the GCS server's jemalloc settings, the same ones given to the raylet too
both=$(.venv/bin/python -c "from deployments.local_ray import RAY_PROCESS_MALLOC_CONF as c; print(c)")

for round in $(seq 1 "$rounds"); do
  for variant in "${variants[@]}"; do
    case $variant in
      defaults) flags=(--object-store-mib 0); env=(RAY_JEMALLOC_PROFILE=none) ;;
      store) flags=(); env=(RAY_JEMALLOC_PROFILE=none) ;;
      shipped) flags=(); env=() ;;
      both) flags=(); env=(RAY_JEMALLOC_PROFILE=gcs_server,raylet "RAY_JEMALLOC_CONF=$both") ;;
      system-http) flags=(--config $here/configs/serve_smollm2_system_malloc.yaml); env=() ;;
      proxy-glibc) flags=(--config $here/configs/serve_smollm2_proxy_glibc.yaml); env=() ;;
      *) echo "unknown variant $variant" >&2; exit 2 ;;
    esac
    workdir=$(mktemp -d)
    before=$(cut -d' ' -f1 /proc/loadavg)
    port=$(python3 -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
    env "${env[@]}" .venv/bin/dsbd serve --port "$port" --ready-file "$workdir/ready" "${flags[@]}" \
      > "$workdir/server.log" 2>&1 &
    server=$!
    until [ -s "$workdir/ready" ]; do
      kill -0 "$server" 2>/dev/null || { tail -20 "$workdir/server.log"; exit 1; }
      sleep 1
    done
    url=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['url'])" "$workdir/ready")
    .venv/bin/python -m dsbd bench soak --url "$url" --pid "$server" --duration "$seconds" \
      --window "$(( seconds / 2 ))" --out "$out/ab_${variant}_${round}.json" > "$workdir/soak.log"
    kill -TERM "$server"; wait "$server" || true
    after=$(cut -d' ' -f1 /proc/loadavg)
    python3 - "$out/ab_${variant}_${round}.json" "$variant" "$round" "$before" "$after" \
      >> "$out/ab_runs.txt" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
print(*sys.argv[2:4], d["requests"], d["ok"], d["latency_s"]["p50"], d["latency_s"]["p99"],
      *sys.argv[4:6])
EOF
    tail -1 "$out/ab_runs.txt"
  done
done
