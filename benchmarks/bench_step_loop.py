"""Output throughput of the online API against generate() on bench.py's workload (same
prompts, lengths, sampling and dummy weights): every request queued with add_request(), then
step() called back to back until the engine is idle, as a server's engine thread runs it.
Both keep one step in flight on the device, so the two rates should be close.

    python -m benchmarks.bench_step_loop             # the GPU workload: 256 sequences, Qwen3-0.6B shape
    python -m benchmarks.bench_step_loop --num-seqs 64
"""
import time

from nanovllm.entrypoints.bench import apply_defaults, device_name, make_workload, parse_args, sync, timed_generate
from nanovllm import LLM, SamplingParams


def timed_step_loop(llm, prompts, params) -> tuple[int, float]:
    sync(llm)
    start = time.perf_counter()
    for prompt, sp in zip(prompts, params):
        llm.add_request(prompt, sp)
    tokens = 0
    while not llm.is_finished():
        tokens += len(llm.step())  # one output per token received
    sync(llm)
    return tokens, time.perf_counter() - start


def main():
    args = parse_args()
    dummy = apply_defaults(args)
    prompts, params = make_workload(args)
    llm = LLM(args.model, device=args.device, dtype=args.dtype, enforce_eager=args.enforce_eager,
              load_format="dummy" if dummy else "auto", max_model_len=args.max_input_len + args.max_output_len)
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    expected = sum(sp.max_tokens for sp in params)
    rates = {}
    for name, run in (("generate", timed_generate), ("step loop", timed_step_loop)):
        tokens, seconds = run(llm, prompts, params)
        assert tokens == expected, f"{name}: {tokens} output tokens, expected {expected}"
        rates[name] = tokens / seconds
        print(f"{name:9s}: {tokens} tokens in {seconds:.2f} s, {rates[name]:.1f} output tok/s")
    print(f"{device_name(llm)}: step loop / generate = {rates['step loop'] / rates['generate']:.3f}")


if __name__ == "__main__":
    main()
