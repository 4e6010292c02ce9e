#!/usr/bin/env bash
# One model on one GPU, the seed loop against shardgen's default path:
#   bash benchmarks/gpu_bench.sh MODEL STEPS [N] [EXTRA jobs.bench ARGS...]
# 1. cold: a fresh compile cache; the seed loop (equal work) and its bf16 noise floor, then shardgen's default
#    path (compile=auto) on N prompts (default 16) from cold: the first batch pays the compilation, the
#    whole-run figure includes it, the steady figure leaves it out;
# 2. warm: a second process on the same cache ($SHARDGEN_CACHE/inductor), one batch: the warm first batch.
# Results: $OUT/MODEL-cold/bench.json, $OUT/MODEL-warm/bench.json.
set -u
model=$1 steps=$2 n=${3:-16}
shift $(( $# < 3 ? $# : 3 ))
export SHARDGEN_CACHE=/tmp/sgcache-$model
rm -rf "$SHARDGEN_CACHE"
out=${OUT:-results}
common=(--model "$model" --steps "$steps" --no-warmup --accel none)
echo "== $model cold: $(date -u +%T)"
python3 -m jobs.bench "${common[@]}" --n "$n" --baseline-n 2 --noise-floor 2 --out "$out/$model-cold" "$@"
echo "== $model warm: $(date -u +%T)"
python3 -m jobs.bench "${common[@]}" --n 4 --skip-baseline --profile-batch 99 --out "$out/$model-warm"
echo "== $model done: $(date -u +%T)"
