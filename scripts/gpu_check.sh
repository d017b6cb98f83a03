#!/usr/bin/env bash
# Everything the GPU has to say in one call of the lent machine: GPU tests, the kernel
# suite, the attention and HF-swap benchmarks, and bench.py. Results go under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
# The device tool returns at most 8 files: logs and results are packed into one archive.
FINAL=${OUT:-gpu_out}
OUT=$(mktemp -d)
trap 'tar czf "$FINAL/gpu_results.tgz" -C "$OUT" .' EXIT
mkdir -p "$FINAL"
export PYTHONUNBUFFERED=1
STAGES=${STAGES:-"info tests kernels bench single attention launch hfswap concurrency comparehf"}
run() { local name=$1; shift; echo "=== $name: $*"; local t0=$SECONDS
  timeout "${STAGE_TIMEOUT:-300}" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - t0)) s"; tail -n "${TAIL:-25}" "$OUT/$name.log"; }
for stage in $STAGES; do case $stage in
  info) run info bash -c 'nvidia-smi; python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())"' ;;
  tests) run tests python3 -m pytest -q -m gpu --durations=15 tests ;;
  kernels) run kernels python3 test_custom_kernels.py --out "$OUT/kernels" ;;
  mlp) run mlp python3 -m nanovllm.layers.custom_mlp ;;
  attention) run attention python3 benchmarks/bench_attention.py --out "$OUT/attention" ;;
  bench) run bench python3 bench.py --profile --out "$OUT/bench" ;;
  bench_eager) run bench_eager python3 bench.py --enforce-eager --out "$OUT/bench_eager" ;;
  single) run single python3 bench.py --num-seqs 1 --min-input-len 128 --max-input-len 128 --min-output-len 512 --max-output-len 512 --out "$OUT/single" ;;
  comparehf) run comparehf python3 bench.py --compare-hf --num-seqs 32 --max-input-len 512 --min-output-len 128 --max-output-len 128 --out "$OUT/comparehf" ;;
  hfswap) run hfswap python3 -m benchmarks.bench_hf_swap --out "$OUT/hfswap" ;;
  sweep) run sweep python3 benchmarks/sweep_tiling.py --out "$OUT/sweep" ;;
  launch) run launch python3 benchmarks/bench_launch.py --out "$OUT/launch" ;;
  concurrency) run concurrency python3 benchmarks/bench_concurrency.py --out "$OUT/concurrency" ;;
esac; done
