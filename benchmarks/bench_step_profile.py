"""Where bench.py's workload spends its steps, against the floor computed the same way.

    python -m benchmarks.bench_step_profile --out out/step_profile                 # Qwen3-0.6B, < 2 minutes
    python -m benchmarks.bench_step_profile --model nanovllm/configs/qwen3-8b --out out/step_profile_8b

Takes bench.py's flags and workload (256 sequences, 100-1024 prompt and output tokens, dummy
weights). Two runs of it:

1. Timed, unprofiled. Every scheduled batch is recorded, and each step's floor computed: the
   bytes it must read (every weight once, each sequence's keys and values up to its new
   tokens) at the copy rate of a 1 GiB device-to-device copy, or its FLOPs (2 x the matmul
   parameters x tokens, plus causal attention) at the rate of a bf16 GEMM of the model's
   gate_up shape, whichever is longer. Printed: output tok/s, the run's seconds against the
   sum of its steps' floors, for the steps that prefill (mixed: prompt chunks next to
   decodes) and the decode-only steps apart.
2. Profiled, on the same workload with every token id shifted by one (the prefix cache cannot
   serve it): a torch.profiler trace of the first WINDOW sampled steps (mixed prefill) and of
   WINDOW decode steps from the middle of the run. A step's GPU activity is cut at the kernel
   that publishes its sampled tokens (as bench_latency does); per window, the mean step's GPU
   busy time by kernel family (busy time a family adds: how far each of its kernels ends past
   the latest end before it), GPU idle time, and the host's time per step() call outside the
   wait for tokens.
"""
import argparse
import json
import os
import time

import torch

from benchmarks.bench_latency import decode_steps, gpu_activity, weight_bytes
from nanovllm import LLM
from nanovllm.engine.sampled_tokens import SampledTokens
from nanovllm.entrypoints import bench
from nanovllm.utils.timing import benchmark_kernel, device_copy_gbs

# kernel family: substrings of kernel names, first match wins
FAMILIES = (
    ("attention", ("attention", "merge_splits", "paged_decode", "flash", "fmha")),
    ("gemv", ("gemv",)),
    ("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "splitk")),
    ("norm+rope+kv", ("norm", "rope", "rotary", "kvcache")),
    ("activation", ("act_and_mul", "gelu", "silu", "mul_add")),
    ("sampling", ("scan", "draw", "finalize", "sample", "gumbel", "topk", "sort")),
    ("staging", ("stage", "publish")),
    ("copy", ("memcpy", "memset", "copy")),
)


def kernel_family(name: str) -> str:
    lower = name.lower()
    return next((family for family, keys in FAMILIES if any(k in lower for k in keys)), "other")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=16, help="steps profiled in each window")
    own, rest = parser.parse_known_args(argv)
    args = bench.parse_args(rest)
    args.window = own.window
    return args


def matmul_tflops(hidden: int, intermediate: int, dtype: torch.dtype, device) -> float:
    """Dense GEMM rate of a prefill chunk's gate_up projection: 8192 tokens."""
    a = torch.randn(8192, hidden, dtype=dtype, device=device)
    b = torch.randn(hidden, 2 * intermediate, dtype=dtype, device=device)
    seconds = benchmark_kernel(torch.mm, a, b) / 1e3
    return 2 * a.shape[0] * hidden * 2 * intermediate / seconds / 1e12


class StepFloors:
    """The floor of each scheduled batch, recorded as the scheduler hands it out."""

    def __init__(self, llm, copy_gbs: float, tflops: float):
        runner, hf = llm.model_runner, llm.config.hf_config
        self.weights = weight_bytes(runner.model)
        self.kv_per_key = runner.block_bytes() // llm.config.kvcache_block_size
        embed = runner.model.model.embed_tokens.weight
        self.matmul_params = sum(p.numel() for p in runner.model.parameters() if p.dim() == 2) - embed.numel() * (
            embed is not runner.model.lm_head.weight)
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        self.attention_width = hf.num_hidden_layers * hf.num_attention_heads * head_dim
        self.copy_bps, self.flops = copy_gbs * 1e9, tflops * 1e12
        self.steps = []

    def record(self, batch) -> None:
        if not batch:
            return
        keys = attention_flops = prefill = 0
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            keys += start + num_new
            attention_flops += 4 * num_new * (start + (num_new + 1) / 2) * self.attention_width
            prefill += num_new if num_new > 1 or start < seq.num_prompt_tokens else 0
        tokens = sum(batch.num_new_tokens)
        read_s = (self.weights + keys * self.kv_per_key) / self.copy_bps
        compute_s = (2 * self.matmul_params * tokens + attention_flops) / self.flops
        self.steps.append({"tokens": tokens, "prefill_tokens": prefill, "seqs": len(batch),
                           "samples": len(batch.sample_rows), "floor_s": max(read_s, compute_s)})


def run(llm, prompts, params, on_step=None) -> float:
    """bench.py's generate loop by step(); on_step(i) before each step. -> seconds."""
    for prompt, sp in zip(prompts, params):
        llm.add_request(prompt, sp)
    bench.sync(llm)
    start, i = time.perf_counter(), 0
    while not llm.is_finished():
        if on_step:
            on_step(i)
        llm.step()
        i += 1
    bench.sync(llm)
    return time.perf_counter() - start


class Windows:
    """Profiles two windows of sampled steps: from the start, and from `middle`."""

    def __init__(self, llm, floors: StepFloors, window: int, middle: int, out_dir: str):
        self.llm, self.floors, self.window, self.out_dir = llm, floors, window, out_dir
        self.starts = {"mixed": 0, "decode": middle}
        self.active, self.prof, self.results = None, None, {}
        self.waits, self.walls = [], []

    def on_step(self, i: int) -> None:
        sampled_steps = sum(1 for s in self.floors.steps if s["samples"])
        if self.active and sampled_steps >= self.starts[self.active] + self.window:
            self.stop()
        for name, first in self.starts.items():
            if self.active is None and name not in self.results and sampled_steps == first:
                self.active, self.first_step = name, len(self.floors.steps)
                # GPU activity only: recording every host op would slow the host work it measures
                self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                self.prof.start()
                self.waits.clear()
                self.walls.clear()
        if self.active:
            self.walls.append(time.perf_counter())

    def stop(self) -> None:
        bench.sync(self.llm)
        self.prof.stop()
        path = os.path.join(self.out_dir, f"step_profile_{self.active}_trace.json")
        self.prof.export_chrome_trace(path)
        with open(path) as f:
            segments = decode_steps(gpu_activity(json.load(f)))
        batches = self.floors.steps[self.first_step:]
        step_calls = [b - a for a, b in zip(self.walls, self.walls[1:])]
        self.results[self.active] = summarise(segments, batches, step_calls, self.waits, path)
        self.active = None


def summarise(segments, batches, step_calls, waits, trace) -> dict:
    """Mean GPU step, by family, next to the host's work per step() call and the floor."""
    if not segments:
        return {"trace": trace, "steps": 0}
    by_family = {}
    for segment in segments:
        for name, us in segment["critical_us_by_name"].items():
            family = kernel_family(name)
            by_family[family] = by_family.get(family, 0.0) + us / len(segments)
    mean = lambda values: sum(values) / max(len(values), 1)  # noqa: E731
    sampled = [b for b in batches if b["samples"]][:len(segments)]
    host_us = mean([(call - wait) * 1e6 for call, wait in zip(step_calls, waits)])
    return {"trace": trace, "steps": len(segments), "step_us": mean([s["step_us"] for s in segments]),
            "busy_us": mean([s["busy_us"] for s in segments]), "idle_us": mean([s["gap_us"] for s in segments]),
            "kernels": mean([s["kernels"] for s in segments]),
            "busy_us_by_family": dict(sorted(by_family.items(), key=lambda kv: -kv[1])),
            "host_us_per_call": host_us, "wait_us_per_call": mean([w * 1e6 for w in waits]),
            "floor_us": mean([b["floor_s"] * 1e6 for b in sampled]),
            "tokens": mean([b["tokens"] for b in sampled]), "prefill_tokens": mean([b["prefill_tokens"] for b in sampled]),
            "seqs": mean([b["seqs"] for b in sampled])}


def timed_waits(windows: Windows):
    """SampledTokens.tolist timed while a window is open: the host's wait for a step's tokens."""
    original = SampledTokens.tolist

    def tolist(self):
        start = time.perf_counter()
        try:
            return original(self)
        finally:
            if windows.active:
                windows.waits.append(time.perf_counter() - start)
    return original, tolist


def main(argv=None):
    args = parse_args(argv)
    dummy = bench.apply_defaults(args)
    os.makedirs(args.out, exist_ok=True)
    prompts, params = bench.make_workload(args)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    copy_gbs = device_copy_gbs(device) if device.type == "cuda" else device_copy_gbs(device, 64 << 20)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    llm = LLM(args.model, device=args.device, dtype=args.dtype, enforce_eager=args.enforce_eager,
              load_format="dummy" if dummy else "auto", max_model_len=args.max_input_len + args.max_output_len)
    hf = llm.config.hf_config
    tflops = matmul_tflops(hf.hidden_size, hf.intermediate_size, llm.config.torch_dtype, device)
    llm.generate([[1, 2, 3, 4]], bench.SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up

    floors = StepFloors(llm, copy_gbs, tflops)
    schedule = llm.scheduler.schedule

    def recorded_schedule():
        batch = schedule()
        floors.record(batch)
        return batch
    llm.scheduler.schedule = recorded_schedule
    seconds = run(llm, prompts, params)
    output_tokens = sum(sp.max_tokens for sp in params)
    mixed = [s for s in floors.steps if s["prefill_tokens"]]
    decode = [s for s in floors.steps if not s["prefill_tokens"]]
    floor_s = sum(s["floor_s"] for s in floors.steps)
    result = {"device": bench.device_name(llm), "model": os.path.basename(os.path.normpath(args.model)),
              "copy_gbs": round(copy_gbs, 1), "matmul_tflops": round(tflops, 1), "output_tokens": output_tokens,
              "seconds": round(seconds, 3), "output_tok_per_s": round(output_tokens / seconds, 1),
              "floor_s": round(floor_s, 3), "pct_of_floor": round(100 * floor_s / seconds, 1),
              "floor_tok_per_s": round(output_tokens / floor_s, 1),
              "mixed_steps": len(mixed), "mixed_floor_s": round(sum(s["floor_s"] for s in mixed), 3),
              "decode_steps": len(decode), "decode_floor_s": round(sum(s["floor_s"] for s in decode), 3),
              **bench.versions(), "date": time.strftime("%Y-%m-%d")}

    shifted = [[t + 1 for t in p] for p in prompts]
    sampled_steps = sum(1 for s in floors.steps if s["samples"])
    floors.steps = []
    windows = Windows(llm, floors, args.window, sampled_steps // 2, args.out)
    original, timed = timed_waits(windows)
    SampledTokens.tolist = timed
    try:
        run(llm, shifted, params, windows.on_step)
        if windows.active:  # a run shorter than its windows
            windows.stop()
    finally:
        SampledTokens.tolist = original
    result["windows"] = windows.results
    with open(os.path.join(args.out, "step_profile.json"), "w") as f:
        json.dump(result, f, indent=2)
    print_result(result)


def print_result(result: dict) -> None:
    print(f"{result['model']} on {result['device']}: {result['output_tok_per_s']} output tok/s, "
          f"{result['seconds']} s against a floor of {result['floor_s']} s ({result['pct_of_floor']}%; "
          f"{result['mixed_steps']} steps with prefill: {result['mixed_floor_s']} s, "
          f"{result['decode_steps']} decode steps: {result['decode_floor_s']} s); copy {result['copy_gbs']} GB/s, "
          f"GEMM {result['matmul_tflops']} TFLOP/s")
    for name, w in result["windows"].items():
        if not w.get("steps"):
            print(f"  {name}: no complete step in the trace (no GPU?)")
            continue
        print(f"  {name} steps ({w['steps']}; {w['seqs']:.0f} seqs, {w['tokens']:.0f} tokens, "
              f"{w['prefill_tokens']:.0f} prefill): GPU step {w['step_us']:.0f} us, busy {w['busy_us']:.0f}, "
              f"idle {w['idle_us']:.0f}; floor {w['floor_us']:.0f} us; host {w['host_us_per_call']:.0f} us "
              f"a step() outside a {w['wait_us_per_call']:.0f} us wait")
        for family, us in w["busy_us_by_family"].items():
            print(f"      {us:8.1f} us  {family}")


if __name__ == "__main__":
    main()
