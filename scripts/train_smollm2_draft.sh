#!/usr/bin/env bash
# The SmolLM2-135M-Instruct draft run (docs/DRAFTS.md), on CPU, in the background, resumable.
#
#   bash scripts/train_smollm2_draft.sh            # start, or resume where it stopped
#   tail -f ~/.cache/dsbd/distill/smollm2/{cache,train}.log
#
# Two nice'd single-thread processes: one keeps building the teacher cache (target samples +
# local text, top-64 distributions; `--cache-only`), the other trains on the shards that exist
# and picks up new ones at each epoch boundary (`--grow-data`). Both resume from their own state
# (cache shards; run/state.pt) when rerun. The draft is written to $WORK/draft when training
# ends; `--export-checkpoint` (below) writes the latest checkpoint's draft at any time:
#   .venv/bin/dsbd distill --target smollm2 --work-dir "$WORK" --out DIR --export-checkpoint
# Ship it: .venv/bin/python scripts/ship_draft.py --draft DIR --run "$WORK/run"
#
# The recorded run (docs/DRAFTS.md) changed two settings on resume, both allowed mid-run: the
# schedule was planned for 4000 then 1500 then 1000 steps (from steps 0 / 225 / 475), then
# extended to 1400 (from step 1000) and 1800 (from step 1400: the shipped draft), and the TV
# weight was 0 until step 475, 1 until 550, 4 until 625, 16 from then on. Rerunning this script
# resumes with STEPS / TV_WEIGHT below.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK="${WORK:-$HOME/.cache/dsbd/distill/smollm2}"
STEPS="${STEPS:-1800}"
TV_WEIGHT="${TV_WEIGHT:-16}"
mkdir -p "$WORK"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
common=(--target smollm2 --work-dir "$WORK" --out "$WORK/draft" --threads 1 --no-progress
        --samples 4096 --text-chunks 1024 --sample-batch 32)
# The cache settings (top-k 64, 80 sampled tokens, seed 0) are the defaults.
setsid nohup nice -n 10 .venv/bin/dsbd distill "${common[@]}" --cache-only >> "$WORK/cache.log" 2>&1 &
# Training waits for the held-out set and two shards, then runs.
until [ -f "$WORK/cache/heldout.json" ] && [ "$(ls "$WORK"/cache/*.pt 2>/dev/null | wc -l)" -ge 2 ]; do
    sleep 30
done
setsid nohup nice -n 10 .venv/bin/dsbd distill "${common[@]}" --train-only --grow-data \
    --arch cut --layers 4 --steps "$STEPS" --batch-size 16 --lr 5e-4 --warmup 100 \
    --tv-weight "$TV_WEIGHT" \
    --eval-every 100 --checkpoint-every 25 >> "$WORK/train.log" 2>&1 &
echo "started; logs: $WORK/cache.log $WORK/train.log; curve: $WORK/run/log.jsonl"
