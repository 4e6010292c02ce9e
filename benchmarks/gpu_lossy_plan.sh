#!/usr/bin/env bash
# The lossy measurements (docs/lossy.md) in as few device calls as time allows, in order of what decides most:
#   source benchmarks/device_env.sh; bash benchmarks/gpu_lossy_plan.sh [FIRST_STEP|STEP,STEP,...] [SECONDS]
# Runs FIRST_STEP (default 1) and the steps after it in this file's order (not by number: 25-27, 20 and 23 run after 1,
# 21 and 22 after 4), or only the listed ones in this file's order (e.g. 1,4; one step alone: 7,7), while SECONDS
# (default 560: one call's 600 s less the transfers) last;
# a step that cannot finish in what is left is not started, one running at the deadline is stopped. Each step's
# output goes to /tmp/lossy/<step>; after each step /tmp/lossy is packed into $OUT/lossy.tar.gz (one file back, within
# the device tool's file limits) and the plan's log is $OUT/plan.log. A later call continues from the step the log
# says was next.
#   1 kernel: the 8-bit attention kernels (shardgen's float8 one, FlashAttention-3's, also from the projections)
#            against their references and exact attention, float8 layers at any token count, the row quantisation
#            of strided views, the RMSNorm + RoPE kernel, the gated residual's kernel (tests/test_gpu_fp8.py,
#            tests/test_gpu.py)
#   2 attention: every attention kernel at the FLUX.1, Qwen-Image and FLUX.2 shapes: time and error; fa3_fp8 from the
#            projections kernel by kernel (wall and GPU time)
#   3 step:   one FLUX.1-dev transformer step, fp8 GEMMs with and without FA3's float8 attention, by kernel kind,
#            each also with SDPA's queries and keys tokens-major (fused_kernels.SDPA_TOKENS_MAJOR); the row passes'
#            launch configurations at that step's shapes
#   4-6 runs: lossy_runs.py per model (bf16, fp8, fp8 + FA3's float8 attention; the seed loop on 8 prompts)
#   7 matrix: every fp8 and attention path per model within its fidelity bound (tests/test_gpu_fp8.py), FLUX.2-dev's
#            in step 17
#   8-12 96 prompts: the whole-run figures against the seed loop (its steady rate on 8 prompts), one or two ways a
#        step (a 96-prompt way takes 3-6 minutes); fidelity comes from steps 4-6 (the same first 24 captions)
#   13 (a card under 120 GB only): FLUX.2-dev's seed loop under enable_model_cpu_offload, on 4 prompts
#   14 matrix-fa3: the matrix's FA3 ways alone (step 7 has them among the others)
#   15 streaming: device_map's streamed text encoder makes the same pixels (tests/test_gpu.py)
#   16 flux2-step: one FLUX.2-dev transformer step by kernel kind (bf16, fp8, fp8 + fa3_fp8); the joined rows'
#            launches (FLUX.1's and FLUX.2's single blocks, FLUX.2's feed-forward SwiGLU) at their warps
#   17 matrix-flux2: FLUX.2-dev's fp8 paths in whole jobs (the matrix's FLUX.2-dev rows, eager and fa3)
#   18 batch-cycle: where a FLUX.1-dev fp8 + fa3_fp8 batch's time goes beyond its 28 transformer calls (text
#            encoders, VAE decode, the host): jobs.bench's torch.profiler trace of one batch cycle (eager, as
#            compile=auto runs a short fp8 job)
#   25 speed-fast (runs after step 1): speed=fast per model, the attention it pins (fa3_fp8 for FLUX.1 and FLUX.2 on
#            Hopper with fa3-fwd, lossless for Qwen-Image) and its calibration within the model's bound; CUDA graphs'
#            replays equal to the eager calls (tests/test_gpu_fp8.py, tests/test_gpu.py)
#   26-28 fast (26, 27 run after step 25; 28 after step 7): speed=fast as a whole run of 24 prompts beside the bf16
#            default and the seed loop, FLUX.1-dev (26), Qwen-Image (27), FLUX.2-dev (28; under strategy=auto on an
#            80 GB card, without the seed loop): its calibration's cost included, fidelity against bf16
#   29-30 fast-noseed (run after step 27): steps 26 and 27 without the seed loop (its ~2 minutes of building a
#            dummy model), for a call that must fit both: speed=fast against the bf16 default, whole and steady
#   20 decode (runs after step 27): fused_decode's GPU test and its decode against the stock one (probe_vae.py);
#            FA3 bf16 against cuDNN (tests/test_gpu.py)
#   21 flux_dev-compiled (runs after step 4): FLUX.1-dev's fp8 + fa3_fp8 eager and compiled (compile=true) beside
#            bf16 and the seed loop, 24 prompts: the compiled blocks' steady rate
#   22 gemms (runs after step 21): the float8 GEMMs at FLUX.1-dev's shapes, row-wise against tensor-wise scales,
#            beside bf16
#   23 fa3-keys (runs after step 20): fa3_fp8's passes from the projections against rms_rope then quantise on the
#            GPU (tests/test_gpu_fp8.py), and timed kernel by kernel, the keys' mean from a sample of their tokens
#            beside the mean of all (probe_fa3_parts.py); a gated residual and the next norm in one pass against the
#            two passes (tests/test_gpu.py)
#   19 outside: each model's VAE decode (as built, cuDNN autotuned, channels-last, compiled) and text encoders
#            alone, timed at batch 4
#   24 chain: the fused blocks' GPU tests (FLUX.1's and FLUX.2's against the stock blocks' bf16 error, CUDA graphs'
#            replays, the gated residual + norm kernel), and one transformer call per model with and without the
#            block chain and the sampled keys' mean (probe_fp8_step.py --before), FLUX.2-dev in a process of its own
#            (after the other two, an 80 GB card has no room left for its 32B transformer)
# Each step's SECONDS is what it took on an H100 (benchmarks/results/2026-12-05-h100-lossy-8f38c80) plus a margin, or
# an estimate where it has not run whole.
set -u
first=${1:-1} budget=${2:-560} only="" started=0
case "$first" in *,*) only=",$first," first=1 ;; esac
deadline=$(( $(date +%s) + budget ))
out=${OUT:-/tmp/out}
work=/tmp/lossy
mkdir -p "$work" "$out"
log="$out/plan.log"

step() {  # step NUMBER NAME SECONDS_IT_NEEDS COMMAND...
  local n=$1 name=$2 needs=$3
  shift 3
  if [ -n "$only" ]; then
    [ "${only#*,"$n",}" = "$only" ] && return 0
  elif [ "$started" = 0 ]; then  # FIRST_STEP and every step after it in this file's order (20 follows 1)
    [ "$n" != "$first" ] && return 0
    started=1
  fi
  local left=$(( deadline - $(date +%s) ))
  if [ "$left" -lt "$needs" ]; then
    local next="FIRST_STEP=$n"
    [ -n "$only" ] && next="the listed steps from $n on"
    echo "== step $n $name: not started ($left s left, needs ~$needs s); next call: $next" | tee -a "$log"
    exit 0
  fi
  mkdir -p "$work/$n-$name"
  echo "== step $n $name: started $(date -u +%T), $left s left" | tee -a "$log"
  local t0
  t0=$(date +%s)
  timeout "$(( left - 10 ))" "$@" > "$work/$n-$name/output.txt" 2>&1
  local rc=$?
  tail -n 25 "$work/$n-$name/output.txt" >> "$log"
  echo "== step $n $name: rc=$rc in $(( $(date +%s) - t0 )) s" | tee -a "$log"
  # the figures and logs only: the runs' tars and compile caches would pass the 16 MiB a returned file may have
  tar -czf "$out/lossy.tar.gz" --exclude='*.tar' --exclude='cache-*' --exclude=seed-cache --exclude=work \
    --exclude='*.png' --exclude='*.jpg' -C /tmp lossy
}

step 1 kernel 60 python3 -m pytest -m gpu -o addopts="" -q -s \
  -k "8bit_attention_kernel or fa3_triton or fa3_attention_from or token_count or float8_linear or in_place \
  or norm_pass or rms_rope_kernel or gated_residual or row_quantisation or gelu_quantisation or proj_out_input \
  or tokens_major or swiglu or read_twice" \
  tests/test_gpu_fp8.py tests/test_gpu.py
step 25 speed-fast 420 python3 -m pytest -m gpu -o addopts="" -q -s -rs -k "speed_fast or replayed_cuda_graphs" \
  tests/test_gpu_fp8.py tests/test_gpu.py
step 26 fast-flux_dev 360 python3 benchmarks/lossy_runs.py --model flux_dev --steps 28 --n 24 --seed-n 8 \
  --ways bf16,fast --out "$work/26-fast-flux_dev"
step 27 fast-qwen_image 260 python3 benchmarks/lossy_runs.py --model qwen_image --steps 8 --n 24 --seed-n 8 \
  --ways bf16,fast --out "$work/27-fast-qwen_image"
step 29 fast-flux_dev-noseed 240 python3 benchmarks/lossy_runs.py --model flux_dev --steps 28 --n 24 \
  --ways bf16,fast --out "$work/29-fast-flux_dev"
step 30 fast-qwen_image-noseed 150 python3 benchmarks/lossy_runs.py --model qwen_image --steps 8 --n 24 \
  --ways bf16,fast --out "$work/30-fast-qwen_image"
step 20 decode 200 bash -c "python3 -m pytest -m gpu -o addopts='' -q -s -k 'fused_decoder or fa3_matches or fa3_and_the_fused' tests/test_gpu.py; \
  OUT=$work/20-decode python3 benchmarks/probe_vae.py --models flux_dev,flux2_dev,qwen_image --variants eager,fused"
step 23 fa3-keys 120 bash -c "python3 -m pytest -m gpu -o addopts='' -q -s \
  -k 'fa3_attention_from or fa3_triton or next_norm_in_one_pass' tests/test_gpu_fp8.py tests/test_gpu.py; python3 benchmarks/probe_fa3_parts.py --iters 10 --out $work/23-fa3-keys/probe_fa3_parts.json"
step 2 attention 150 bash -c "python3 benchmarks/probe_fp8_attention.py --shapes flux_dev,qwen_image,flux2_dev \
  --iters 10 --out $work/2-attention/probe_fp8_attention.json; python3 benchmarks/probe_fa3_parts.py --iters 10 \
  --out $work/2-attention/probe_fa3_parts.json"
step 3 step 220 bash -c "python3 benchmarks/probe_fp8_step.py --models flux_dev --no-gemms \
  --ways fp8_fast_accum,fp8_fa3 --tokens-major --out $work/3-step/probe_fp8_step.json; \
  python3 benchmarks/probe_quantize_rows.py \
  --out $work/3-step/probe_quantize_rows.json"
step 4 flux_dev 400 python3 benchmarks/lossy_runs.py --model flux_dev --steps 28 --n 24 --seed-n 8 \
  --ways bf16,fp8,fp8-fa3 --out "$work/4-flux_dev"
step 21 flux_dev-compiled 460 python3 benchmarks/lossy_runs.py --model flux_dev --steps 28 --n 24 --seed-n 8 \
  --ways bf16,fp8-fa3,fp8-fa3-compiled --out "$work/21-flux_dev-compiled"
step 22 gemms 60 python3 benchmarks/probe_fp8_step.py --models none --out "$work/22-gemms/probe_fp8_step.json"
step 5 qwen_image 360 python3 benchmarks/lossy_runs.py --model qwen_image --steps 8 --n 24 --seed-n 8 \
  --ways bf16,fp8,fp8-fa3 --out "$work/5-qwen_image"
# FLUX.2-dev's bf16 pipeline (32B transformer, 24B text encoder: ~104 GiB) fits an H200, not an 80 GB card: there
# every way runs under strategy=auto (device_map on one GPU, the text encoder streamed in for each batch's encoding;
# a way takes ~80 s to start, then 3.9 s/sample bf16, 2.6 fp8 on an H100), the seed loop, which holds the whole
# pipeline, is left out, and so is the 8-bit attention way (step 12 has it), so bf16 and fp8 fit one call
flux2_seed=8 flux2_set=() flux2_ways=bf16,fp8,fp8-fa3
gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
[ "${gpu_mib:-0}" -lt 120000 ] && flux2_seed=0 flux2_set=(--set strategy=auto) flux2_ways=bf16,fp8
step 6 flux2_dev 420 python3 benchmarks/lossy_runs.py --model flux2_dev --steps 8 --n 24 --seed-n $flux2_seed \
  "${flux2_set[@]}" --ways $flux2_ways --out "$work/6-flux2_dev"
# FLUX.2-dev's rows are step 17's: on an 80 GB card each of its ways is ~95 s (a fresh 32B transformer and 24B
# encoder under device_map), and all nine pass one call's 600 s
step 7 matrix 500 python3 -m pytest -m gpu -o addopts="" -q -s -rs -k "every_fp8_path and not flux2_dev" \
  tests/test_gpu_fp8.py
step 28 fast-flux2_dev 420 python3 benchmarks/lossy_runs.py --model flux2_dev --steps 8 --n 24 --seed-n $flux2_seed \
  "${flux2_set[@]}" --ways bf16,fast --out "$work/28-fast-flux2_dev"
step 8 flux_dev-96-fp8 400 python3 benchmarks/lossy_runs.py --model flux_dev --steps 28 --n 96 --seed-n 8 \
  --ways fp8 --out "$work/8-flux_dev-96-fp8"
step 9 flux_dev-96-fa3 420 python3 benchmarks/lossy_runs.py --model flux_dev --steps 28 --n 96 --seed-n 8 \
  --ways fp8-fa3 --out "$work/9-flux_dev-96-fa3"
# fp8 alone: fa3_fp8 is slower than fp8 alone on Qwen-Image (docs/lossy.md)
step 10 qwen_image-96 300 python3 benchmarks/lossy_runs.py --model qwen_image --steps 8 --n 96 --seed-n 8 \
  --ways fp8 --out "$work/10-qwen_image-96"
step 11 flux2_dev-96-fp8 480 python3 benchmarks/lossy_runs.py --model flux2_dev --steps 8 --n 96 --seed-n $flux2_seed \
  "${flux2_set[@]}" --ways fp8 --out "$work/11-flux2_dev-96-fp8"
step 12 flux2_dev-96-fa3 420 python3 benchmarks/lossy_runs.py --model flux2_dev --steps 8 --n 96 \
  "${flux2_set[@]}" --ways fp8-fa3 --out "$work/12-flux2_dev-96-fa3"
# on an 80 GB card: the guide's loop as diffusers runs a pipeline larger than the GPU (enable_model_cpu_offload), the
# seed loop steps 6, 11 and 12 leave out there (their shardgen figures are under strategy=auto)
[ "${gpu_mib:-0}" -lt 120000 ] && step 13 flux2_dev-seed-offload 300 python3 benchmarks/lossy_runs.py --model flux2_dev \
  --steps 8 --n 24 --seed-n 4 --seed-offload --ways none --out "$work/13-flux2_dev-seed-offload"
step 14 matrix-fa3 300 python3 -m pytest -m gpu -o addopts="" -q -s -k "every_fp8_path and fa3" \
  tests/test_gpu_fp8.py
step 15 streaming 120 python3 -m pytest -m gpu -o addopts="" -q -s -k streams_an_encoder tests/test_gpu.py
step 16 flux2-step 200 bash -c "python3 benchmarks/probe_fp8_step.py --models flux2_dev --no-gemms \
  --ways fp8_fast_accum,fp8_fa3 --out $work/16-flux2-step/probe_fp8_step.json; \
  python3 benchmarks/probe_quantize_rows.py --only joined --out $work/16-flux2-step/probe_quantize_rows.json"
step 17 matrix-flux2 400 python3 -m pytest -m gpu -o addopts="" -q -s \
  -k "every_fp8_path and flux2_dev and (eager or fa3)" tests/test_gpu_fp8.py
step 18 batch-cycle 240 python3 -m jobs.bench --model flux_dev --steps 28 --n 16 --skip-baseline --no-warmup \
  --no-compile --set fp8=true --set sdpa_backend=fa3_fp8 --profile-batch 2 --out "$work/18-batch-cycle"
step 19 outside 300 bash -c "python3 benchmarks/probe_text_encoders.py --out $work/19-outside/probe_text_encoders.json; \
  OUT=$work/19-outside python3 benchmarks/probe_vae.py --models flux_dev,flux2_dev,qwen_image --compiled"
step 24 chain 240 bash -c "python3 -m pytest -m gpu -o addopts='' -q -s \
  -k 'stay_at_the_stock or replayed_cuda_graphs or next_norm_in_one_pass' tests/test_gpu.py; \
  python3 benchmarks/probe_fp8_step.py --models flux_dev,qwen_image --no-gemms --ways fp8_fast_accum,fp8_fa3 \
  --before --out $work/24-chain/probe_fp8_step.json; \
  python3 benchmarks/probe_fp8_step.py --models flux2_dev --no-gemms --ways fp8_fast_accum,fp8_fa3 --before \
  --out $work/24-chain/probe_fp8_step_flux2.json"
echo "== plan done $(date -u +%T)" | tee -a "$log"
