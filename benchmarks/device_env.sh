#!/usr/bin/env bash
# Source on the GPU machine before a benchmark:  source benchmarks/device_env.sh
# 1. installs the carried wheels (.whl/: bash benchmarks/device_wheels.sh here first) into /tmp/site;
# 2. gives every process a bytecode cache. The device's Python environment is read-only and ships without
#    .pyc files, so each process there compiles ~3,000 modules from source (~8 s of a job's start-up under
#    cProfile); an installed environment on a user's cluster has them
#    (pip writes them at install). PYTHONPYCACHEPREFIX sends the caches to /tmp/pyc, filled here once, before
#    anything is timed, for the seed loop and shardgen alike. SHARDGEN_NO_PYC=1 leaves this step out.
# the pure-Python wheels the runs need, then the optional kernels (a platform wheel: fa3-fwd), whose failure to
# install only leaves their ways refused
python3 -m pip install -q --no-index --no-deps --target /tmp/site $(ls .whl/*.whl | grep -v -- '-abi3-') || return 1
for w in .whl/*-abi3-*.whl; do
  [ -e "$w" ] || continue
  python3 -m pip install -q --no-index --no-deps --target /tmp/site "$w" || echo "device_env: $w not installed"
done
export PYTHONPATH=/tmp/site:$PWD
if [ -z "${SHARDGEN_NO_PYC:-}" ]; then
  export PYTHONPYCACHEPREFIX=/tmp/pyc
  site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  t0=$(date +%s.%N)
  python3 -m compileall -q -j 0 -x '/tests?/' "$site" /tmp/site "$PWD/shardgen" "$PWD/jobs" \
    "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')" >/dev/null 2>&1
  echo "device_env: bytecode for $site and /tmp/site in /tmp/pyc: $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s"
fi
