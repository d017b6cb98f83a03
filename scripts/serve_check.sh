#!/usr/bin/env bash
# The serving measurements on one GPU, on the Qwen3-0.6B architecture with random bf16 weights:
#   1. bench.py offline (LLM.generate, 256 sequences): the baseline output tok/s;
#   2. the offline decode step time at 64 sequences of 1,024-token prompts (online step() loop);
#   3. `nanovllm serve` on the same model, and bench_serving.py against it: bench.py's workload
#      at max concurrency 256, then 128 requests of 1,024 prompt and 128 output tokens at 1,
#      16 and 64 concurrent streams.
# Results: $OUT/serve_summary.json (the figures side by side) and $OUT/serve_results.tgz (logs,
# every JSON, the latency plot). Where the server's packages are missing and cannot be
# downloaded, put their wheels in .whl/: they are installed from there.
set -uo pipefail
cd "$(dirname "$0")/.."
FINAL=${OUT:-serve_out}
OUT=$(mktemp -d)
mkdir -p "$FINAL"
SERVER=
finish() {
  [ -n "$SERVER" ] && kill -TERM "$SERVER" 2>/dev/null && wait "$SERVER"
  cp "$OUT/serve_summary.json" "$FINAL/" 2>/dev/null
  tar czf "$FINAL/serve_results.tgz" -C "$OUT" .
}
trap finish EXIT
export PYTHONUNBUFFERED=1
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/serve_site .whl/*.whl \
    && export PYTHONPATH=/tmp/serve_site${PYTHONPATH:+:$PYTHONPATH}
fi
MODEL=nanovllm/configs/qwen3-0.6b
stage() { echo "=== $1"; }

stage "offline bench.py"
python3 bench.py --out "$OUT/offline" 2>&1 | tee "$OUT/offline.log" | tail -n 2

stage "offline decode step, 64 sequences of 1024 + 128 tokens"
python3 - "$OUT/decode_step.json" <<'EOF' 2>&1 | tee "$OUT/decode_step.log" | tail -n 1
import json, random, sys, time
import torch
from nanovllm import LLM, SamplingParams
llm = LLM("nanovllm/configs/qwen3-0.6b", load_format="dummy", dtype="bfloat16", max_model_len=2048)
llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
rng = random.Random(0)
for _ in range(64):
    llm.add_request([rng.randint(0, 10000) for _ in range(1024)],
                    SamplingParams(temperature=0.6, max_tokens=128, ignore_eos=True))
started = set()
while len(started) < 64:  # prefill done: every request has its first token
    started.update(out["request_id"] for out in llm.step())
torch.cuda.synchronize()
start, steps = time.perf_counter(), 100
for _ in range(steps):
    llm.step()
torch.cuda.synchronize()
result = {"decode_step_ms_64_seqs": round((time.perf_counter() - start) / steps * 1e3, 3),
          "device": torch.cuda.get_device_name()}
json.dump(result, open(sys.argv[1], "w"), indent=2)
print(json.dumps(result))
EOF

stage "nanovllm serve"
python3 -m nanovllm.serve "$MODEL" --load-format dummy --dtype bfloat16 --max-model-len 2048 --port 0 \
  > "$OUT/server.log" 2>&1 &
SERVER=$!
URL=
for _ in $(seq 600); do
  URL=$(grep -o 'http://127\.0\.0\.1:[0-9]*' "$OUT/server.log" | head -n 1)
  [ -n "$URL" ] && python3 -c "import httpx, sys; sys.exit(httpx.get('$URL/health').status_code != 200)" 2>/dev/null && break
  kill -0 "$SERVER" 2>/dev/null || { echo "the server exited"; tail -n 30 "$OUT/server.log"; exit 1; }
  sleep 0.5
done
echo "serving on $URL"

stage "bench_serving: bench.py's workload at max concurrency 256"
python3 -m benchmarks.bench_serving --base-url "$URL" --max-concurrency 256 --out "$OUT/serving_256" \
  2>&1 | tee "$OUT/serving_256.log" | grep -E "throughput|P50|P99|Failed"

stage "bench_serving: 1024-token prompts, 128 output tokens, 1/16/64 streams"
python3 -m benchmarks.bench_serving --base-url "$URL" --max-concurrency 1,16,64 --num-prompts 128 \
  --min-input-len 1024 --max-input-len 1024 --min-output-len 128 --max-output-len 128 --out "$OUT/serving_streams" \
  2>&1 | tee "$OUT/serving_streams.log" | grep -E "====|Output token|P50 TTFT|P99 TTFT|P50 TPOT|P99 TPOT|Failed"

kill -TERM "$SERVER"
wait "$SERVER"
echo "server exit code $?"
SERVER=

stage "summary"
python3 - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
load = lambda path: json.load(open(os.path.join(out, path)))
offline, step = load("offline/bench_result.json"), load("decode_step.json")
full, streams = load("serving_256/bench_serving.json"), load("serving_streams/bench_serving.json")
run256 = full["runs"][0]
summary = {"device": offline["device"], "date": offline["date"],
           **{k: offline[k] for k in ("python", "torch", "transformers", "triton")},
           "offline_output_tok_per_s": offline["output_tok_per_s"],
           "serving_output_tok_per_s_c256": run256["output_throughput"],
           "serving_over_offline": round(run256["output_throughput"] / offline["output_tok_per_s"], 3),
           "serving_c256": {k: run256[k] for k in ("completed", "failed", "duration_s", "p50_ttft_ms", "p99_ttft_ms",
                                                    "p50_tpot_ms", "p99_tpot_ms")},
           "offline_decode_step_ms_64": step["decode_step_ms_64_seqs"]}
for run in streams["runs"]:
    summary[f"streams_{run['max_concurrency']}"] = {k: run[k] for k in (
        "completed", "failed", "p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "output_throughput")}
summary["tpot_p50_c64_over_decode_step"] = round(summary["streams_64"]["p50_tpot_ms"] / step["decode_step_ms_64_seqs"], 3)
json.dump(summary, open(os.path.join(out, "serve_summary.json"), "w"), indent=2)
print(json.dumps(summary, indent=2))
EOF
