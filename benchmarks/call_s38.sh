#!/usr/bin/env bash
# One device call: the row passes' sweep (LayerNorm + modulation warps, the proj_out concatenation), Qwen-Image's fp8
# step by kernel kind, then Qwen-Image's whole runs (bf16, fp8; the seed loop on 8 prompts).
#   source benchmarks/device_env.sh; bash benchmarks/call_s38.sh
set -u
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/lossy
timeout 120 python3 benchmarks/probe_quantize_rows.py --out "$out/probe_quantize_rows.json" > "$out/probe_quantize_rows.txt" 2>&1
echo "probe_quantize_rows rc=$?"
timeout 150 python3 benchmarks/probe_fp8_step.py --models qwen_image --no-gemms --ways fp8_fast_accum \
  --out "$out/probe_fp8_step_qwen.json" > "$out/probe_fp8_step_qwen.txt" 2>&1
echo "probe_fp8_step qwen rc=$?"
timeout 330 python3 benchmarks/lossy_runs.py --model qwen_image --steps 8 --n 24 --seed-n 8 --ways bf16,fp8 \
  --out /tmp/lossy/5-qwen_image > "$out/qwen_runs.txt" 2>&1
echo "qwen runs rc=$?"
tar -czf "$out/qwen.tar.gz" --exclude='*.tar' --exclude='cache-*' --exclude=seed-cache --exclude=work \
  --exclude='*.png' --exclude='*.jpg' --exclude='*.parquet' -C /tmp/lossy 5-qwen_image
tail -5 "$out/probe_fp8_step_qwen.txt" | cut -c1-3000
tail -40 "$out/qwen_runs.txt"
