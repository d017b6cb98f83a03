"""Speed of kernels.sample on a GPU, and what sampling filters cost the engine.

    python -m benchmarks.bench_sampling [--rows 256] [--vocab 151936] [--dtype float32] [--out DIR]
    python -m benchmarks.bench_sampling --engine [--out DIR]

The kernel table: `rows` x `vocab` logits (default 256 x Qwen3's 151,936, float32), each row
adding a filter to the one above, ending at Qwen3's recommended sampling and more:
temperature 0.6; + top_k 20; + top_p 0.95; + min_p 0.05; + the chosen token's logprob; then
temperature 0.6 and top_k 20 with a token bitmask allowing half the vocabulary, and with
presence, frequency and repetition penalties (counts of 64 tokens a row, a 256-token prompt).
Columns: the Triton sampler, the CUDA C++ sampler (built on first use; absent where it cannot
be, and for the bitmask and penalty rows, which it hands to Triton), and the sort path (the filters through a sort, as a batch with a top-p row and no top-k
takes). Each figure is the median microseconds of one call (nanovllm.utils.timing.
benchmark_kernel: CUDA-graph replays) and its multiple of one read of the logits at the copy
rate measured in this run (nanovllm.utils.timing.device_copy_gbs).

--engine: bench.py's workload (its GPU defaults: 256 sequences, Qwen3-0.6B with dummy bf16
weights) run in one process with temperature 0.6 alone, then with 0.6 / top_k 20 / top_p 0.95,
twice each, interleaved; output tokens a second and the ratio. Results: DIR/sampling.json."""
import argparse
import json
import os
import statistics

import torch

from nanovllm.engine.sampling_inputs import pack_token_set
from nanovllm.kernels import penalties, sampling
from nanovllm.utils.timing import benchmark_kernel, device_copy_gbs

# (name, keyword arguments of kernels.sample beyond logits, temperatures, seeds)
ROWS = [("temperature 0.6", dict()),
        ("+ top_k 20", dict(top_ks=20, max_top_k=20)),
        ("+ top_p 0.95", dict(top_ks=20, top_ps=0.95, max_top_k=20)),
        ("+ min_p 0.05", dict(top_ks=20, top_ps=0.95, min_ps=0.05, max_top_k=20)),
        ("+ logprobs", dict(top_ks=20, top_ps=0.95, min_ps=0.05, max_top_k=20, logprobs=True)),
        ("top_k 20 + bitmask", dict(top_ks=20, max_top_k=20, token_bitmask=True)),
        ("top_k 20 + penalties", dict(top_ks=20, max_top_k=20, penalties=(0.5, 0.5, 1.1)))]
EDITS = ("token_bitmask", "penalties")  # rows the CUDA C++ sampler does not take


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--engine", action="store_true", help="bench.py's workload with and without filters")
    parser.add_argument("--out", default="bench_out")
    return parser.parse_args()


def samplers() -> dict:
    from nanovllm.kernels.cuda import sampling as cuda_sampling
    found = {"triton": sampling.sample, "cuda": cuda_sampling.sampler()}

    def sort(logits, temperatures, seeds, max_top_k=None, **filters):  # the bound says "unknown"
        return sampling.sample(logits, temperatures, seeds, **filters)
    found["sort"] = sort
    return {name: fn for name, fn in found.items() if fn is not None}


def row_arguments(rows: int, vocab: int, spec: dict) -> dict:
    args = {}
    for name, value in spec.items():
        if name == "token_bitmask":  # random words: each token allowed with probability 1/2
            args[name] = torch.randint(-2**31, 2**31, (rows, -(-vocab // 32)), device="cuda").to(torch.int32)
        elif name == "penalties":
            presence, frequency, repetition = (torch.full((rows,), v, device="cuda") for v in value)
            counts = torch.zeros(rows, vocab, dtype=torch.int32, device="cuda")
            counts.scatter_(1, torch.randint(0, vocab, (rows, 64), device="cuda"), 1)
            prompt = torch.stack([pack_token_set(torch.randint(0, vocab, (256,)).tolist(), vocab)
                                  for _ in range(rows)]).cuda()
            args[name] = penalties.Penalties(torch.arange(rows, dtype=torch.int32, device="cuda"), presence,
                                             frequency, repetition, counts, prompt)
        elif name in ("top_ks", "top_ps", "min_ps"):
            dtype = torch.long if name == "top_ks" else torch.float32
            args[name] = torch.full((rows,), value, dtype=dtype, device="cuda")
        else:
            args[name] = value
    return args


def kernel_table(args) -> dict:
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    logits = (torch.randn(args.rows, args.vocab, device="cuda") * 2).to(dtype)
    temperatures = torch.full((args.rows,), 0.6, device="cuda")
    seeds = torch.arange(args.rows, device="cuda")
    copy_gbs = device_copy_gbs()
    read_us = logits.numel() * logits.element_size() / copy_gbs / 1e3
    table = {"device": torch.cuda.get_device_name(), "shape": [args.rows, args.vocab], "dtype": args.dtype,
             "copy_gbs": round(copy_gbs, 1), "one_read_us": round(read_us, 1), "rows": {}}
    print(f"{table['device']}: {args.rows} x {args.vocab} {args.dtype} logits; copy {copy_gbs:.0f} GB/s, "
          f"one read {read_us:.1f} us")
    found = samplers()
    print(f"{'':18}" + "".join(f"{name:>20}" for name in found))
    for name, spec in ROWS:
        kwargs = row_arguments(args.rows, args.vocab, spec)
        line, table["rows"][name] = f"{name:18}", {}
        for sampler, fn in found.items():
            if sampler == "cuda" and any(edit in spec for edit in EDITS):
                line += f"{'-':>20}"
                continue
            us = benchmark_kernel(fn, logits, temperatures, seeds, **kwargs) * 1e3
            table["rows"][name][sampler] = {"us": round(us, 1), "x_read": round(us / read_us, 2)}
            line += f"{us:12.1f} us {us / read_us:4.2f}x"
        print(line)
    return table


def engine_ratio() -> dict:
    """bench.py's workload, plain and filtered, interleaved in one process."""
    from nanovllm import LLM, SamplingParams
    from nanovllm.entrypoints import bench
    args = argparse.Namespace(model=None, load_format=None, num_seqs=None, min_input_len=None, max_input_len=None,
                              min_output_len=None, max_output_len=None, device="auto", dtype="auto")
    bench.apply_defaults(args)
    prompts, params = bench.make_workload(args)
    llm = LLM(args.model, device=args.device, dtype=args.dtype, load_format="dummy",
              max_model_len=args.max_input_len + args.max_output_len)
    filtered = [SamplingParams(temperature=0.6, top_k=20, top_p=0.95, ignore_eos=True, max_tokens=p.max_tokens)
                for p in params]
    for warm_up in (params, filtered):  # each path's kernels compile outside the timed runs
        llm.generate(prompts[:8], warm_up[:8], use_tqdm=False)
    rates = {"temperature 0.6": [], "0.6 / top_k 20 / top_p 0.95": []}
    for _ in range(2):
        for name, workload in zip(rates, (params, filtered)):
            tokens, seconds = bench.timed_generate(llm, prompts, workload)
            rates[name].append(tokens / seconds)
            print(f"{name}: {tokens / seconds:.1f} output tok/s")
    result = {name: round(statistics.median(r), 1) for name, r in rates.items()}
    result["ratio"] = round(result["0.6 / top_k 20 / top_p 0.95"] / result["temperature 0.6"], 4)
    print(f"filtered / plain: {result['ratio']:.3f}")
    return result


def main():
    args = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_sampling needs a CUDA GPU")
    os.makedirs(args.out, exist_ok=True)
    result = {"engine": engine_ratio()} if args.engine else {"kernel": kernel_table(args)}
    with open(os.path.join(args.out, "sampling.json"), "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
