"""Decode latency of the engine: for each batch size (1/4/16/64) and context (1k/8k/32k
tokens), the time one decode step takes, the output tok/s, and the share of the step that
the floor takes: reading every weight and the batch's KV cache once at the device's copy
rate. Then the time to first token of 1k/8k/32k-token prompts. Qwen3-0.6B config with dummy
weights (bf16 on a GPU) and CUDA graphs; --model-config picks another packaged config
(qwen3-8b) or any config folder.

    python -m benchmarks.bench_latency --out out/latency          # < 4 minutes on an H200
    python -m benchmarks.bench_latency --profile --out out/latency

How a step is timed. The engine's own parts run the steps as LLM.generate does: the
scheduler schedules, the model runner prepares the inputs, replays the batch's captured graph
and samples, the scheduler records, and step N + 1 is launched before step N's tokens are
read. The sequences are seated in the scheduler with their context already in the KV cache
(blocks allocated, all but the last prompt token computed), so no prefill runs; the cache's
zeros stand in for keys and values and cost the same to read. A step's time is the interval
between the arrivals on the host of two consecutive steps' tokens, averaged over --steps
steps after --warmup: in steady state that is the step's period, set by the GPU or by the
host, whichever is slower. Timing one step from its launch to its tokens would instead add
the host's launch work to the GPU's, though in the engine the two overlap. "wait ms" is the
mean time the host spent blocked on a step's tokens: near 0, the host sets the pace and GPU
work taken off the step does not shorten it.

The floor. Bytes a step must read: every parameter once (the LM head included; an untied
embedding table is not counted, a step reads one row of it per sequence; of a mixture of
experts, the experts a batch of that size reaches on average: weight_bytes) plus each
sequence's keys and values (2 x layers x kv heads x head_dim x element size per key, at the
measured steps' mean length). Divided by the copy rate of a 1 GiB device-to-device copy
measured in the same run (bytes read + written per second, the "% of copy" of
docs/performance.md#methodology; nanovllm.utils.timing.device_copy_gbs), before the engine
takes the memory.

Time to first token: LLM.generate of one prompt of fresh random tokens to one output token,
median of --ttft-repeats after one warm-up (prefix caching is off).

--profile: a torch.profiler trace (Chrome JSON) of --profile-steps batch-1 decode steps at
the first context, and the GPU activity of its median step: the work between the kernels
that store two steps' sampled tokens for the host (TOKENS_OUT). Printed: its kernel count;
kernel time, the sum of kernel durations (with programmatic dependent launch a kernel starts
while its predecessor runs and its duration includes that wait, so the sum can exceed the
busy time); busy time, the union of all kernels and copies; gap time, the step minus busy
time: the GPU idle between its activities; the largest gaps and the kernels that take the
most time. Per kernel name, the busy time it adds: how far each kernel's end reaches past the
latest end before it, summed; what the step would lose with those kernels gone and nothing
else moving.

NANOVLLM_GEMV=0 runs the projections and the LM head on cuBLAS instead of the Triton GEMV;
the JSON records which. Without a GPU (a smoke run of the logic):
    python -m benchmarks.bench_latency --device cpu --model-config qwen3-tiny --batch-sizes 1 2 \\
        --contexts 64 --ttft-prompts 64 --steps 4 --warmup 2 --profile --out /tmp/latency"""
import argparse
import itertools
import json
import os
import platform
import random
import statistics
import time
from collections import Counter, deque

import torch

from nanovllm import LLM, SamplingParams, kernels
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.layers.fused_moe import FusedMoE
from nanovllm.utils.timing import device_copy_gbs

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "nanovllm", "configs")
GPU_ACTIVITY = ("kernel", "gpu_memcpy", "gpu_memset")
TOKENS_OUT = "_publish_kernel"  # kernels/staging.py: stores a step's sampled tokens for the host
_request_ids = itertools.count(1 << 40)  # apart from the ids LLM.generate hands out


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-config", default="qwen3-0.6b", help="a folder under nanovllm/configs, or any folder")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--ttft-prompts", type=int, nargs="*", default=[1024, 8192, 32768])
    parser.add_argument("--ttft-repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed per case")
    parser.add_argument("--warmup", type=int, default=8, help="decode steps run before the timed ones")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", help="'auto': the config's (fp32 configs run in bf16 on a GPU)")
    parser.add_argument("--block-size", type=int, default=128, help="KV cache block size")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--profile", action="store_true", help="also profile batch-1 decode steps")
    parser.add_argument("--profile-steps", type=int, default=6)
    parser.add_argument("--out", default="bench_out/latency", help="folder for latency.json and the profile")
    args = parser.parse_args()
    if min(args.batch_sizes + args.contexts + [args.steps, args.warmup + 1, args.profile_steps - 2]) < 1:
        parser.error("batch sizes, contexts, --steps and --profile-steps - 2 must be at least 1, --warmup at least 0")
    return args


def model_dir(name: str) -> str:
    return name if os.path.isdir(name) else os.path.join(CONFIGS, name)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_rate_gbs(device: torch.device) -> float:
    """GB/s of a device-to-device copy, bytes read + written: on a GPU the 1 GiB yardstick of
    device_copy_gbs; on the CPU a 64 MiB copy, a rough figure only so that the arithmetic runs."""
    if device.type == "cuda":
        gbs = device_copy_gbs(device)
        torch.cuda.empty_cache()  # its 1 GiB, before the engine sizes its cache
        return gbs
    return device_copy_gbs(device, 64 << 20)


def write_json(result: dict, out_dir: str, name: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    return path


def weight_bytes(model, batch: int | None = None) -> int:
    """Bytes of the parameters a decode step of `batch` sequences reads whole (parameters()
    lists a tied one once). A mixture-of-experts layer's experts count as many times as a
    step reaches distinct experts on average, E (1 - (1 - k/E)^batch) for tokens routed
    uniformly (k of E experts each); all of them where batch is None."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    if embed is not model.lm_head.weight:
        total -= embed.numel() * embed.element_size()
    for module in model.modules():
        if batch is not None and isinstance(module, FusedMoE):
            experts = module.w13_weight.numel() * module.w13_weight.element_size() + \
                module.w2_weight.numel() * module.w2_weight.element_size()
            reached = 1 - (1 - module.top_k / module.num_experts) ** batch
            total -= int(experts * (1 - reached))
    return total


# --- decode steps ------------------------------------------------------------------------
def seat(llm, batch: int, context: int, max_tokens: int) -> list[Sequence]:
    """`batch` running sequences of `context` tokens whose first context - 1 are in the cache.
    Each ends in a token of its own, so the sequences decode different tokens: a mixture of
    experts routes them as a batch of distinct requests, not as one."""
    scheduler = llm.scheduler
    rng = random.Random(context)
    vocab = min(10000, llm.config.hf_config.vocab_size)
    prompt = [rng.randrange(vocab) for _ in range(context - 1)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    seqs = []
    for _ in range(batch):
        seq = Sequence(next(_request_ids), prompt + [rng.randrange(vocab)], params)
        if scheduler.block_manager.admit(seq, context) != context:
            raise RuntimeError(f"no KV blocks for a {context}-token sequence")
        seq.num_computed_tokens = context - 1
        seq.status = SequenceStatus.RUNNING
        scheduler.running.append(seq)
        seqs.append(seq)
    return seqs


def run_steps(llm, steps: int) -> tuple[list[float], list[float]]:
    """Runs `steps` decode steps of the running sequences, one in flight while the next is
    launched, as the engine's generate loop does; returns when each step's tokens arrived and
    how long the host waited for them (near 0: the host, not the GPU, sets the pace)."""
    scheduler, runner = llm.scheduler, llm.model_runner
    in_flight, arrivals, waits = deque(), [], []

    def collect():
        batch, sampled = in_flight.popleft()
        started = time.perf_counter()
        tokens = sampled.tolist()  # waits for the step
        arrivals.append(time.perf_counter())
        waits.append(arrivals[-1] - started)
        scheduler.postprocess(batch, tokens)

    for _ in range(steps):
        batch = scheduler.schedule()
        in_flight.append((batch, runner.launch(batch)))
        scheduler.launched(batch)
        if len(in_flight) > 1:
            collect()
    while in_flight:
        collect()
    return arrivals, waits


def decode_case(llm, batch: int, context: int, warmup: int, steps: int, step_room: int) -> dict:
    manager = llm.scheduler.block_manager
    needed = batch * manager.blocks_needed(context + step_room)
    if context + step_room > llm.config.max_model_len:
        return {"batch": batch, "context": context, "skipped": f"exceeds max_model_len {llm.config.max_model_len}"}
    if needed > manager.num_free_blocks:
        gb = needed * llm.model_runner.block_bytes() / 1e9
        return {"batch": batch, "context": context,
                "skipped": f"needs {needed} KV blocks ({gb:.0f} GB), the cache has {manager.num_free_blocks}"}
    seqs = seat(llm, batch, context, max_tokens=step_room)
    try:
        arrivals, waits = run_steps(llm, warmup + steps + 1)
    finally:
        for seq in seqs:
            llm.abort(seq.request_id)
    timed = arrivals[warmup:warmup + steps + 1]
    intervals = [b - a for a, b in zip(timed, timed[1:])]
    # the timed steps read context + warmup + 1 ... context + warmup + steps keys
    return {"batch": batch, "context": context, "step_ms": (timed[-1] - timed[0]) / steps * 1e3,
            "step_ms_median": statistics.median(intervals) * 1e3,
            "wait_ms": statistics.fmean(waits[warmup + 1:warmup + steps + 1]) * 1e3,
            "mean_keys": context + warmup + (steps + 1) / 2}


def add_floor(case: dict, weights: int, kv_per_key: int, copy_gbs: float) -> dict:
    kv = case["batch"] * case["mean_keys"] * kv_per_key
    floor_ms = (weights + kv) / (copy_gbs * 1e9) * 1e3
    return {**case, "tok_per_s": case["batch"] / case["step_ms"] * 1e3, "kv_bytes": int(kv), "weight_bytes": weights,
            "floor_ms": floor_ms, "pct_of_floor": 100 * floor_ms / case["step_ms"]}


def time_to_first_token_ms(llm, prompt_len: int, repeats: int) -> float:
    rng = random.Random(prompt_len)
    vocab = min(10000, llm.config.hf_config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        sync(llm.config.torch_device)
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        sync(llm.config.torch_device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])


# --- profile -------------------------------------------------------------------------------
def gpu_activity(trace: dict) -> list[dict]:
    """Kernels, copies and memsets of a Chrome trace written by torch.profiler, by start time."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_ACTIVITY),
                  key=lambda e: e["ts"])


def _busy_us(events: list[dict], start: float, end: float) -> float:
    """Length of the union of the events' intervals within [start, end]."""
    busy, reach = 0.0, start
    for e in events:
        lo, hi = max(e["ts"], reach), min(e["ts"] + e["dur"], end)
        if hi > lo:
            busy += hi - lo
            reach = hi
    return busy


def decode_steps(activity: list[dict]) -> list[dict]:
    """GPU activity cut into decode steps: every step ends with the kernel that stores its
    sampled tokens for the host; a step is what runs after one such kernel, up to the end of
    the next."""
    ends = [i for i, e in enumerate(activity) if e["cat"] == "kernel" and e["name"] == TOKENS_OUT]
    steps = []
    for before, last in zip(ends, ends[1:]):
        start, end = activity[before]["ts"] + activity[before]["dur"], activity[last]["ts"] + activity[last]["dur"]
        events = activity[before + 1:last + 1]
        launched = [e for e in events if e["cat"] == "kernel"]
        busy = _busy_us(events, start, end)
        idle, reach, previous = [], start, "(previous step)"
        for e in events:
            if e["ts"] > reach:
                idle.append((e["ts"] - reach, previous, e["name"]))
            if e["ts"] + e["dur"] > reach:
                reach, previous = e["ts"] + e["dur"], e["name"]
        by_name, critical, reach = Counter(), Counter(), start
        for e in launched:
            by_name[e["name"]] += e["dur"]
            critical[e["name"]] += max(0.0, e["ts"] + e["dur"] - max(reach, e["ts"]))
            reach = max(reach, e["ts"] + e["dur"])
        steps.append({"step_us": end - start, "kernels": len(launched), "kernel_us": sum(e["dur"] for e in launched),
                      "busy_us": busy, "gap_us": end - start - busy, "gaps": len(idle),
                      "largest_gaps": [{"us": us, "after": a, "before": b} for us, a, b in sorted(idle, reverse=True)[:8]],
                      "kernel_us_by_name": dict(by_name.most_common(12)),
                      "critical_us_by_name": dict(critical.most_common(12)),
                      "kernel_count_by_name": dict(Counter(e["name"] for e in launched).most_common(12))})
    return steps


def profile_decode(llm, context: int, warmup: int, steps: int, out_dir: str) -> dict:
    device = llm.config.torch_device
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    seqs = seat(llm, 1, context, max_tokens=warmup + steps + 4)
    try:
        run_steps(llm, warmup)
        with torch.profiler.profile(activities=activities) as prof:
            run_steps(llm, steps)
            sync(device)
    finally:
        for seq in seqs:
            llm.abort(seq.request_id)
    path = os.path.join(out_dir, "decode_profile_trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        measured = decode_steps(gpu_activity(json.load(f)))
    result = {"batch": 1, "context": context, "trace": path, "steps": measured}
    if measured:
        result["median_step"] = sorted(measured, key=lambda s: s["step_us"])[len(measured) // 2]
    return result


def print_profile(profile: dict) -> None:
    print(f"\nprofile trace: {profile['trace']}")
    step = profile.get("median_step")
    if step is None:
        print("  no complete step of GPU activity in the trace (no GPU?)")
        return
    print(f"one batch-1 decode step at context {profile['context']} (median of {len(profile['steps'])}): "
          f"{step['step_us']:.0f} us, {step['kernels']} kernels, kernel time {step['kernel_us']:.0f} us, "
          f"GPU busy {step['busy_us']:.0f} us, gaps {step['gap_us']:.0f} us in {step['gaps']} gaps")
    print("  kernel time and busy time added by kernel (us, count):")
    for name, us in step["kernel_us_by_name"].items():
        print(f"    {us:8.1f} {step['critical_us_by_name'].get(name, 0):8.1f} "
              f"{step['kernel_count_by_name'].get(name, ''):>5}  {name[:90]}")
    print("  largest gaps (us, after -> before):")
    for gap in step["largest_gaps"]:
        print(f"    {gap['us']:8.1f}  {gap['after'][:50]} -> {gap['before'][:50]}")


# --- main ----------------------------------------------------------------------------------
def main():
    args = parse_args()
    started = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    config_dir = model_dir(args.model_config)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    copy_gbs = copy_rate_gbs(device)
    step_room = args.warmup + args.steps + 8  # tokens a decode case adds to its context, with margin
    max_model_len = max(max(args.contexts) + step_room, max(args.ttft_prompts, default=0) + 1)
    llm = LLM(config_dir, load_format="dummy", device=str(device), dtype=args.dtype, max_model_len=max_model_len,
              max_num_seqs=max(args.batch_sizes), kvcache_block_size=args.block_size, enable_prefix_caching=False,
              enforce_eager=args.enforce_eager, gpu_memory_utilization=args.gpu_memory_utilization)
    runner = llm.model_runner
    weights, kv_per_key = weight_bytes(runner.model), runner.block_bytes() // args.block_size
    result = {
        "model": os.path.basename(os.path.normpath(config_dir)), "dtype": str(runner.dtype),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "copy_gbs": copy_gbs, "gemv": kernels.dispatch.gemv_enabled,
        "pdl": os.environ.get("NANOVLLM_PDL", "1") != "0",
        "cuda_graphs": bool(runner.graphs), "kv_block_size": args.block_size, "kv_blocks": runner.num_kvcache_blocks,
        "max_model_len": llm.config.max_model_len, "weight_bytes": weights, "kv_bytes_per_key": kv_per_key,
        "warmup_steps": args.warmup, "timed_steps": args.steps, "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    print(f"{result['model']} {result['dtype']} on {result['device']}: copy {copy_gbs:.0f} GB/s, weights read per "
          f"step {weights / 1e9:.3f} GB, KV {kv_per_key / 1024:.0f} KiB a key; GEMV {'on' if result['gemv'] else 'off'}, "
          f"CUDA graphs {'on' if result['cuda_graphs'] else 'off'}, {runner.num_kvcache_blocks} KV blocks of "
          f"{args.block_size}")
    print(f"{'batch':>6} {'context':>8} {'step ms':>9} {'median':>9} {'wait ms':>8} {'tok/s':>9} {'floor ms':>9} "
          f"{'% floor':>8}")
    result["decode"] = []
    for context in args.contexts:
        for batch in args.batch_sizes:
            case = decode_case(llm, batch, context, args.warmup, args.steps, step_room)
            if "skipped" in case:
                print(f"{batch:6d} {context:8d}  skipped: {case['skipped']}")
            else:
                case = add_floor(case, weight_bytes(runner.model, batch), kv_per_key, copy_gbs)
                print(f"{batch:6d} {context:8d} {case['step_ms']:9.3f} {case['step_ms_median']:9.3f} "
                      f"{case['wait_ms']:8.3f} {case['tok_per_s']:9.0f} {case['floor_ms']:9.3f} {case['pct_of_floor']:8.1f}")
            result["decode"].append(case)
    result["ttft_ms"] = {}
    for prompt_len in args.ttft_prompts:
        if prompt_len >= llm.config.max_model_len:
            continue
        result["ttft_ms"][prompt_len] = ms = time_to_first_token_ms(llm, prompt_len, args.ttft_repeats)
        print(f"time to first token, {prompt_len}-token prompt: {ms:.2f} ms")
    if args.profile:
        result["profile"] = profile_decode(llm, args.contexts[0], args.warmup, args.profile_steps, args.out)
        print_profile(result["profile"])
    result["seconds"] = time.perf_counter() - started
    print(f"wrote {write_json(result, args.out, 'latency.json')} ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
