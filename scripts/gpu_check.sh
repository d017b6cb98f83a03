#!/usr/bin/env bash
# Everything on one GPU, in stages: the gpu-marked tests, the kernel suite, bench.py (default
# workload with a profile, one sequence, against transformers), decode latency with a profile,
# the sampler, and the attention, launch, swap_layers and concurrency benchmarks. The server
# has scripts/serve_check.sh, several GPUs scripts/multi_gpu_check.sh. Each stage's log and results go to a folder
# of their own, and all of them into one archive, $OUT/gpu_results.tgz (OUT defaults to
# ./gpu_out); the last lines of each log are printed as the stage ends.
#
#   bash scripts/gpu_check.sh                                # every default stage
#   STAGES="tests kernels" bash scripts/gpu_check.sh         # chosen stages (also: mlp, sweep, bench_eager, gemv,
#                                                            # sliding_window, chain)
#
# STAGE_TIMEOUT (seconds, default 300, 600 for the tests) bounds each stage; TAIL (default 25) is
# the lines shown. Packages the device lacks (the server's) install from .whl/ where it holds them.
set -uo pipefail
cd "$(dirname "$0")/.."
FINAL=${OUT:-gpu_out}
OUT=$(mktemp -d)
trap 'tar czf "$FINAL/gpu_results.tgz" -C "$OUT" .' EXIT
mkdir -p "$FINAL"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_check_site .whl/*.whl \
    && export PYTHONPATH=/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}
fi
STAGES=${STAGES:-"info tests kernels bench single latency sampling attention launch hfswap concurrency comparehf"}
run() { local name=$1; shift; echo "=== $name: $*"; local t0=$SECONDS
  timeout "${STAGE_TIMEOUT:-300}" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - t0)) s"; tail -n "${TAIL:-25}" "$OUT/$name.log"; }
for stage in $STAGES; do case $stage in
  info) run info bash -c 'nvidia-smi; python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())"' ;;
  tests) # the server's tests need its packages: from .whl/ (as scripts/serve_check.sh), else left out
    python3 -c "import fastapi, uvicorn, httpx" 2>/dev/null || { echo "=== tests: no server packages, tests/entrypoints left out"; SKIP_SERVER="--ignore=tests/entrypoints"; }
    STAGE_TIMEOUT=${STAGE_TIMEOUT:-600} run tests python3 -m pytest -q -m gpu --durations=15 ${SKIP_SERVER:-} tests ;;
  kernels) run kernels python3 -m benchmarks.bench_kernels --out "$OUT/kernels" ;;
  mlp) run mlp python3 -m nanovllm.layers.custom_mlp ;;
  latency) run latency python3 -m benchmarks.bench_latency --profile --out "$OUT/latency" ;;
  gemv) run gemv python3 -m benchmarks.bench_gemv --out "$OUT/gemv" ;;
  chain) run chain python3 -m benchmarks.bench_chain --out "$OUT/chain" ;;
  sampling) run sampling python3 -m benchmarks.bench_sampling --out "$OUT/sampling" ;;
  sliding_window) run sliding_window python3 -m benchmarks.bench_sliding_window --out "$OUT/sliding_window" ;;
  attention) run attention python3 -m benchmarks.bench_attention --out "$OUT/attention" ;;
  bench) run bench python3 bench.py --profile --out "$OUT/bench" ;;
  bench_eager) run bench_eager python3 bench.py --enforce-eager --out "$OUT/bench_eager" ;;
  single) run single python3 bench.py --num-seqs 1 --min-input-len 128 --max-input-len 128 --min-output-len 512 --max-output-len 512 --out "$OUT/single" ;;
  comparehf) run comparehf python3 bench.py --compare-hf --num-seqs 32 --max-input-len 512 --min-output-len 128 --max-output-len 128 --out "$OUT/comparehf" ;;
  hfswap) run hfswap python3 -m benchmarks.bench_hf_swap --out "$OUT/hfswap" ;;
  sweep) run sweep python3 -m benchmarks.sweep_tiling --out "$OUT/sweep" ;;
  launch) run launch python3 -m benchmarks.bench_launch --out "$OUT/launch" ;;
  concurrency) run concurrency python3 -m benchmarks.bench_concurrency --out "$OUT/concurrency" ;;
  *) echo "=== unknown stage: $stage" ;;
esac; done
