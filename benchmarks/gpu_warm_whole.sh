#!/usr/bin/env bash
# A whole run with compiled artifacts reused, side by side with the seed loop:
#   bash benchmarks/gpu_warm_whole.sh MODEL STEPS
# 1. fill: a process compiles from a fresh cache ($SHARDGEN_CACHE/inductor), one batch, no baseline;
# 2. warm: a second process (as a requeued job or a second node would): the seed loop on 2 prompts, then
#    shardgen's default path on 16 prompts from the warm cache; its whole-run figure includes the warm
#    compilation. Results: $OUT/MODEL-fill/bench.json, $OUT/MODEL-whole/bench.json.
set -u
model=$1 steps=$2
export SHARDGEN_CACHE=/tmp/sgcache-$model
rm -rf "$SHARDGEN_CACHE"
out=${OUT:-results}
common=(--model "$model" --steps "$steps" --no-warmup --accel none)
echo "== $model fill: $(date -u +%T)"
python3 -m jobs.bench "${common[@]}" --n 4 --skip-baseline --profile-batch 99 --out "$out/$model-fill"
echo "== $model warm whole run: $(date -u +%T)"
python3 -m jobs.bench "${common[@]}" --n 16 --baseline-n 2 --out "$out/$model-whole"
echo "== $model done: $(date -u +%T)"
