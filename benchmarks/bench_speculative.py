"""Speculative decoding's speed-ups and costs, on packaged configs with dummy weights (bf16 on a
GPU, CUDA graphs):

- batch 1, greedy, a prompt of a repeated phrase (a dummy model's greedy output repeats
  too): output tok/s with speculation off; n-gram; the target as its own draft (same dummy
  weights: every proposal accepted, the ceiling); a draft whose proposals are always wrong
  (its tokens plus one: the overhead, once adaptive k has turned proposals down);
- bench.py's default workload (batch 256, sampled) off and with n-gram, first model only;
- one verifying step of a sequence (launch to tokens on the host) for k = 1..8 proposals
  against a plain decode step, at batch 1 and 8, with a context of --context tokens.

Every speed-up is printed with the acceptance rate and mean accepted length it came with.
Prints one JSON object.

    python -m benchmarks.bench_speculative --out out/spec      # < 3 minutes on an H200
    python -m benchmarks.bench_speculative --device cpu --models qwen3-tiny --output-len 16 \\
        --context 64 --repeats 2 --skip-batch --out /tmp/spec      # a smoke run of the logic"""
import argparse
import gc
import json
import os
import statistics
import time
from types import SimpleNamespace

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine.scheduler import ScheduledBatch
from nanovllm.engine.sequence import Sequence
from nanovllm.entrypoints.bench import GPU_DEFAULTS, device_name, make_workload, timed_generate, versions

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "nanovllm", "configs")
PHRASE = [785, 3974, 13876, 3883, 3420, 916, 279, 15678, 5562, 13]  # ids below every packaged vocabulary
K = 4


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["qwen3-0.6b", "qwen3-8b"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=20, help="verification steps timed per case")
    parser.add_argument("--skip-batch", action="store_true", help="leave out bench.py's batch-256 workload")
    parser.add_argument("--out", default="bench_out")
    return parser.parse_args()


def engine(model: str, args, speculative_config=None, max_model_len=4096) -> LLM:
    on_gpu = args.device != "cpu" and torch.cuda.is_available()
    return LLM(model, device=args.device, dtype="bfloat16" if on_gpu else "float32", load_format="dummy",
               max_model_len=max_model_len, speculative_config=speculative_config,
               **({} if on_gpu else {"enforce_eager": True, "max_num_seqs": 16}))


def speculation(llm, before: dict | None = None) -> dict:
    """The acceptance since `before` (an earlier return's counters)."""
    stats = {key: value for key, value in llm.memory_stats().items() if key.startswith("spec_decode_num")}
    delta = {key: value - (before or {}).get(key, 0) for key, value in stats.items()}
    proposed, accepted, drafts = (delta[f"spec_decode_num_{key}"] for key in ("draft_tokens", "accepted_tokens",
                                                                               "drafts"))
    return {"proposed": proposed, "accepted": accepted, "acceptance_rate": round(accepted / max(proposed, 1), 3),
            "mean_accepted_length": round(1 + accepted / max(drafts, 1), 2), "_counters": stats}


def batch_one(llm, args) -> float:
    """Output tok/s of one greedy request (after a warm-up request)."""
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([PHRASE * 4], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    tokens, seconds = timed_generate(llm, [PHRASE * 8], params)
    return round(tokens / seconds, 1)


def always_wrong(draft) -> None:
    """The draft model runs as ever; every token it proposes is replaced by the next id."""
    propose, vocab = draft.propose, draft.runner.config.hf_config.vocab_size
    draft.propose = lambda seqs, ks: [[(t + 1) % vocab for t in tokens] for tokens in propose(seqs, ks)]


def step_ms(llm, batch_size: int, k: int, args) -> float:
    """Median time of one step of `batch_size` sequences of --context tokens, each verifying k
    proposals (k = 0: a plain decode), from launch to tokens on the host."""
    runner, manager = llm.model_runner, llm.scheduler.block_manager
    greedy = SamplingParams(temperature=0.0, max_tokens=args.output_len)
    seqs = [Sequence(-1 - i, [PHRASE[i % len(PHRASE)]] * args.context, greedy) for i in range(batch_size)]
    for seq in seqs:
        seq.num_computed_tokens = args.context - 1
        manager.grow(seq, 1 + k)
    batch = ScheduledBatch(seqs, [1 + k] * batch_size, sample_rows=list(range(batch_size)))
    if k:
        batch.num_speculative = dict.fromkeys(range(batch_size), k)
        batch.proposals = {row: PHRASE[:k] for row in range(batch_size)}
    times = []
    for _ in range(args.repeats + 3):
        start = time.perf_counter()
        runner.launch(batch).tolist()
        times.append(time.perf_counter() - start)
    for seq in seqs:
        manager.free(seq)
    return round(statistics.median(times[3:]) * 1000, 3)


def run_model(name: str, args, first: bool) -> dict:
    model = os.path.join(CONFIGS, name)
    result = {}
    off = engine(model, args)
    result["off_tok_per_s"] = batch_one(off, args)
    batch_args = SimpleNamespace(**GPU_DEFAULTS)
    if first and not args.skip_batch:
        prompts, params = make_workload(batch_args)
        tokens, seconds = timed_generate(off, prompts, params)
        result["batch256_off_tok_per_s"] = round(tokens / seconds, 1)
    result["device"] = device_name(off)
    off.close()
    del off
    gc.collect()

    ngram = engine(model, args, {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4})
    rate = batch_one(ngram, args)
    result["ngram"] = {"tok_per_s": rate, "speedup": round(rate / result["off_tok_per_s"], 2),
                       **speculation(ngram)}
    if first and not args.skip_batch:
        before = speculation(ngram)["_counters"]
        tokens, seconds = timed_generate(ngram, prompts, params)
        rate = round(tokens / seconds, 1)
        result["batch256_ngram"] = {"tok_per_s": rate, "speedup": round(rate / result["batch256_off_tok_per_s"], 2),
                                    **speculation(ngram, before)}
    result["step_ms"] = {f"batch{b}": {f"k={k}": step_ms(ngram, b, k, args) for k in range(9)} for b in (1, 8)}
    ngram.close()
    del ngram
    gc.collect()

    draft = engine(model, args, {"method": "draft_model", "model": model, "num_speculative_tokens": K})
    rate = batch_one(draft, args)
    result["draft_is_target"] = {"k": K, "tok_per_s": rate, "speedup": round(rate / result["off_tok_per_s"], 2),
                                 **speculation(draft)}
    before = speculation(draft)["_counters"]
    always_wrong(draft.speculator.draft)
    rate = batch_one(draft, args)
    result["draft_never_accepted"] = {"k": K, "tok_per_s": rate, "speedup": round(rate / result["off_tok_per_s"], 2),
                                      **speculation(draft, before)}
    draft.close()
    for case in result.values():
        if isinstance(case, dict):
            case.pop("_counters", None)
    return result


def main():
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    result = {"benchmark": "speculative", "output_len": args.output_len, "context": args.context, **versions(),
              "date": time.strftime("%Y-%m-%d")}
    for i, name in enumerate(args.models):
        result[name] = run_model(name, args, first=i == 0)
        for case, values in result[name].items():
            if isinstance(values, dict) and "speedup" in values:
                print(f"{name} {case}: {values['tok_per_s']} tok/s, {values['speedup']}x, acceptance "
                      f"{values['acceptance_rate']}, mean accepted length {values['mean_accepted_length']}")
    with open(os.path.join(args.out, "speculative.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
