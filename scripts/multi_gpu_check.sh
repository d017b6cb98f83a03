#!/usr/bin/env bash
# Tensor and data parallelism on the GPUs of one machine, every measurement of
# docs/distributed.md's "Measured scaling" in one script; bf16 (dummy weights, and a random
# checkpoint for the comparison of sizes, which must hold the same weights). Results go under
# $OUT (one archive, multi_gpu_results.tgz, and the console summary).
#   TP=2 DP=2 bash scripts/multi_gpu_check.sh     two or more GPUs (the default sizes)
#   TP=1 DP=1 bash scripts/multi_gpu_check.sh     one GPU: every path but the failure stage
# STAGES picks stages, to split the run over several commands:
#   info tests correctness single8b bench8b bench06b allreduce fault
# CHECK_LAYERS: layers of the random Qwen3-8B-shaped checkpoint of the correctness stage (36).
set -uo pipefail
cd "$(dirname "$0")/.."
FINAL=${OUT:-multi_gpu_out}
OUT=$(mktemp -d)
WORK=$(mktemp -d)
trap 'tar czf "$FINAL/multi_gpu_results.tgz" -C "$OUT" .; rm -rf "$WORK"' EXIT
mkdir -p "$FINAL"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# The server's packages, where they are missing, from wheels in .whl/ (scripts/serve_check.sh).
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/serve_site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/serve_site
fi
TP=${TP:-2}
DP=${DP:-2}
STAGES=${STAGES:-"info tests correctness single8b bench8b bench06b allreduce fault"}
run() { local name=$1; shift; echo "=== $name: $*"; local t0=$SECONDS
  timeout "${STAGE_TIMEOUT:-540}" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - t0)) s"; tail -n "${TAIL:-12}" "$OUT/$name.log"; }

# Qwen3-8B's shape: 36 layers, hidden 4096, 32 query and 8 key/value heads, intermediate 12288.
QWEN3_8B="$WORK/qwen3-8b"
mkdir -p "$QWEN3_8B"
cat > "$QWEN3_8B/config.json" <<'EOF'
{"architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "eos_token_id": 151645, "head_dim": 128,
 "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 12288, "max_position_embeddings": 40960,
 "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
 "rms_norm_eps": 1e-06, "rope_theta": 1000000, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
 "vocab_size": 151936}
EOF
QWEN3_06B=nanovllm/configs/qwen3-0.6b

# The measurements bench.py does not make. A file, not stdin: spawned ranks import the
# Recorder class from it.
cat > "$WORK/parallel_check.py" <<'EOF'
"""correctness: greedy agreement and teacher-forced logits of tensor_parallel_size TP against 1,
on a random bf16 checkpoint. fault: a rank killed mid-generation. allreduce: NCCL kernel times
in a bench.py profile trace."""
import gc, json, os, random, signal, statistics, subprocess, sys, threading, time

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine import llm_engine
from nanovllm.engine.model_runner import ModelRunner


class Recorder(ModelRunner):
    """Rank 0 keeps every request's logits, a row per sampled token."""

    def _sample(self, hidden, step, sample_rows, seqs):
        self.request_ids = [seq.request_id for seq in seqs]
        return super()._sample(hidden, step, sample_rows, seqs)

    def _logits(self, hidden, step, sample_rows):
        logits = super()._logits(hidden, step, sample_rows)
        if logits is not None:
            rows = self.__dict__.setdefault("rows", {})
            for request_id, row in zip(self.request_ids, logits.cpu()):
                rows.setdefault(request_id, []).append(row)
        return logits


def generate(model, tp, prompts, params):
    llm_engine.ModelRunner = Recorder
    llm = LLM(model, tensor_parallel_size=tp, max_model_len=1024, max_num_seqs=len(prompts))
    tokens = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    rows = llm.model_runner.rows
    llm.close()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, rows


def agreed(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))


def correctness(config_dir, tp, layers):
    from transformers import AutoConfig, AutoModelForCausalLM
    with open(os.path.join(config_dir, "config.json")) as f:
        raw = {**json.load(f), "num_hidden_layers": layers}
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    path = os.path.join(os.environ["WORK"], "random_checkpoint")
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    rng = random.Random(0)
    prompts = [[rng.randrange(config.vocab_size) for _ in range(rng.randint(16, 256))] for _ in range(64)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    one, rows_one = generate(path, 1, prompts, params)
    split, rows_split = generate(path, tp, prompts, params)
    lengths = [agreed(a, b) for a, b in zip(one, split)]
    # Rows up to a sequence's first difference saw the same tokens on both: teacher-forced.
    diffs = [(rows_one[i][j].float() - rows_split[i][j].float()).abs().max().item()
             for i, n in enumerate(lengths) for j in range(min(n + 1, len(one[i])))]
    gaps = [rows_one[i][n].float().topk(2).values.diff().abs().item() for i, n in enumerate(lengths) if n < len(one[i])]
    scale = max(row.float().abs().max().item() for rows in rows_one.values() for row in rows)
    print(json.dumps({"tensor_parallel_size": tp, "layers": layers, "prompts": len(prompts), "max_tokens": 32,
                      "identical_sequences": sum(n == len(a) for n, a in zip(lengths, one)),
                      "mean_agreed_fraction": statistics.mean(n / len(a) for n, a in zip(lengths, one)),
                      "teacher_forced_rows": len(diffs), "max_logit_diff": max(diffs),
                      "median_logit_diff": statistics.median(diffs), "max_abs_logit": scale,
                      "top2_gap_at_first_difference": sorted(gaps)}))


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def fault(config_dir, tp):
    llm = LLM(config_dir, tensor_parallel_size=tp, load_format="dummy", max_model_len=2048)
    pids = [process.pid for process in llm.model_runner.workers.processes]
    rng = random.Random(0)
    prompts = [[rng.randrange(10000) for _ in range(256)] for _ in range(256)]  # a minute of work, killed at 5 s
    result = {"tensor_parallel_size": tp, "killed_pid": pids[-1]}

    def kill():
        time.sleep(5)
        result["killed_at"] = time.monotonic()
        os.kill(pids[-1], signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()
    try:
        llm.generate(prompts, SamplingParams(max_tokens=1024, ignore_eos=True), use_tqdm=False)
        result["raised"] = None
    except Exception as exc:
        result["raised_after_kill_s"] = round(time.monotonic() - result.pop("killed_at"), 3)
        result["raised"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    started = time.monotonic()
    llm.close()
    result["close_s"] = round(time.monotonic() - started, 3)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    result["workers_alive"] = [pid for pid in pids if alive(pid)]
    result["rank0_allocated_bytes_after"] = torch.cuda.memory_allocated()
    result["gpu_processes_after"] = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
        capture_output=True, text=True).stdout.strip().splitlines()
    result["this_pid"] = os.getpid()
    print(json.dumps(result))


def allreduce(trace):
    with open(trace) as f:
        kernels = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    total = sum(e["dur"] for e in kernels)
    by_name = {}
    for e in kernels:
        if "nccl" in e["name"].lower():
            by_name.setdefault(e["name"].split("(")[0], []).append(e["dur"])
    print(json.dumps({"trace": trace, "kernel_us": total, "nccl": {
        name: {"count": len(d), "median_us": statistics.median(d), "max_us": max(d),
               "share_of_kernel_time": sum(d) / total} for name, d in by_name.items()}}))


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "correctness":
        correctness(args[0], int(args[1]), int(args[2]))
    elif command == "fault":
        fault(args[0], int(args[1]))
    else:
        allreduce(args[0])
EOF
export WORK
CHECK="$WORK/parallel_check.py"
bench() { local name=$1; shift; run "$name" python3 bench.py --out "$OUT/$name" "$@"; }
SINGLE="--num-seqs 1 --min-input-len 128 --max-input-len 128 --min-output-len 512 --max-output-len 512"
sizes() { local list=1; [ "$1" != 1 ] && list="1 $1"; echo $list; }  # 1, and the size asked for

for stage in $STAGES; do case $stage in
  info) run info bash -c 'nvidia-smi; date -u; python3 -c "import torch, triton, transformers
print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.device_count())"' ;;
  tests) run tests python3 -m pytest -q -m gpu --durations=10 -o faulthandler_timeout=150 tests/distributed \
      tests/entrypoints/test_data_parallel.py ;;  # the server's replicas need its packages (below)
  correctness) run correctness python3 "$CHECK" correctness "$QWEN3_8B" "$TP" "${CHECK_LAYERS:-36}" ;;
  single8b) for tp in $(sizes "$TP"); do
      bench "single8b_tp$tp" --model "$QWEN3_8B" --tensor-parallel-size "$tp" $SINGLE; done ;;
  bench8b) for tp in $(sizes "$TP"); do
      bench "bench8b_tp$tp" --model "$QWEN3_8B" --tensor-parallel-size "$tp"; done ;;
  bench06b) for tp in $(sizes "$TP"); do bench "bench06b_tp$tp" --tensor-parallel-size "$tp"; done
      [ "$DP" != 1 ] && bench "bench06b_dp$DP" --data-parallel-size "$DP" ;;
  allreduce) for batch in 1 256; do
      bench "allreduce_b$batch" --model "$QWEN3_8B" --tensor-parallel-size "$TP" --profile \
        --num-seqs "$batch" --min-input-len 128 --max-input-len 128 --min-output-len 256 --max-output-len 256
      run "allreduce_b${batch}_nccl" python3 "$CHECK" allreduce "$OUT/allreduce_b$batch/profile_trace.json"
      rm -f "$OUT/allreduce_b$batch"/*trace.json; done ;;  # tens of MB each; the summary and report stay
  fault) if [ "$TP" -lt 2 ]; then echo "=== fault: skipped (TP=1 has no worker ranks)"
      else run fault python3 "$CHECK" fault "$QWEN3_06B" "$TP"; fi ;;
esac; done
