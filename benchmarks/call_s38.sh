#!/usr/bin/env bash
# One device call: the whole-run figures at 96 prompts with fp8=true for Qwen-Image and FLUX.1-dev, each against the
# seed loop's steady rate on 8 prompts (lossy_runs.py). Qwen-Image first: the shorter of the two.
#   source benchmarks/device_env.sh; bash benchmarks/call_s38.sh [SECONDS]
set -u
out=${OUT:-/tmp/out}
deadline=$(( $(date +%s) + ${1:-560} ))
mkdir -p "$out" /tmp/lossy
run() {  # run NAME ARGS...: lossy_runs.py until the deadline
  local name=$1
  shift
  timeout $(( deadline - $(date +%s) )) python3 benchmarks/lossy_runs.py "$@" --out "/tmp/lossy/$name" \
    > "$out/$name.txt" 2>&1
  echo "$name rc=$?"
  tar -czf "$out/$name.tar.gz" --exclude='*.tar' --exclude='cache-*' --exclude=seed-cache --exclude=work \
    --exclude='*.png' --exclude='*.jpg' --exclude='*.parquet' -C /tmp/lossy "$name"
  tail -12 "$out/$name.txt"
}
run qwen_image-96-fp8 --model qwen_image --steps 8 --n 96 --seed-n 8 --ways fp8
run flux_dev-96-fp8 --model flux_dev --steps 28 --n 96 --seed-n 8 --ways fp8
