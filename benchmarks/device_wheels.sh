#!/usr/bin/env bash
# Here (not on the GPU machine): fill .whl/ with the wheels benchmarks/device_env.sh installs there, which has no
# package registry (../shared/GPU.md). Each device call then names .whl in `carry`.
#   bash benchmarks/device_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
  diffusers==0.42.1 importlib_metadata hydra-core==1.3.8 'omegaconf>=2.3,<2.4' webdataset==1.0.2 braceexpand \
  submitit==1.5.4
python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3  # an sdist only: built here
# FlashAttention-3's forward kernels (sdpa_backend=fa3 / fa3_fp8 / auto_8bit on Hopper): one abi3 wheel for
# manylinux_2_24, which the platform list above leaves out
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_24_x86_64 -d .whl fa3-fwd==0.0.3
ls .whl
