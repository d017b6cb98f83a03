"""Throughput of LLM.generate() on nano-vllm's published workload: 256 sequences, prompts of
100-1024 random token ids, 100-1024 output tokens each, ignore_eos, temperature 0.6, on the
Qwen3-0.6B architecture with random (dummy) bf16 weights. No download, no arguments needed.

Without a GPU the defaults shrink to a small Qwen3-shaped model and workload (under a minute
on 2 CPU cores). --profile writes a torch.profiler trace of a few prefill and decode steps;
--compare-hf runs the same prompts through Hugging Face transformers in the same run.
--tensor-parallel-size and --data-parallel-size split the model over GPUs or run replicas
(docs/distributed.md). Run as `python bench.py` from a checkout, or `nanovllm bench`."""
import argparse
import cProfile
import gc
import glob
import json
import os
import platform
import pstats
import random
import shutil
import tempfile
import time

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.config import DTYPES

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
GPU_DEFAULTS = dict(model=os.path.join(CONFIGS, "qwen3-0.6b"), num_seqs=256, min_input_len=100,
                    max_input_len=1024, min_output_len=100, max_output_len=1024)
CPU_DEFAULTS = dict(model=os.path.join(CONFIGS, "qwen3-tiny"), num_seqs=16, min_input_len=32,
                    max_input_len=256, min_output_len=16, max_output_len=64)


def parse_args(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint folder; one with only a config.json (nanovllm/configs/*) runs on "
                                        "dummy weights (default: the packaged Qwen3 config)")
    parser.add_argument("--num-seqs", type=int)
    parser.add_argument("--min-input-len", type=int)
    parser.add_argument("--max-input-len", type=int)
    parser.add_argument("--min-output-len", type=int)
    parser.add_argument("--max-output-len", type=int)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--data-parallel-size", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="write profile_trace.json and profile_report.txt")
    parser.add_argument("--compare-hf", action="store_true", help="also run Hugging Face transformers")
    parser.add_argument("--penalties", action="store_true",
                        help="every request with presence, frequency and repetition penalties (draws eagerly)")
    parser.add_argument("--out", default="bench_out", help="folder for the profile and the JSON results")
    args = parser.parse_args(argv)
    if args.data_parallel_size != 1 and args.profile:
        parser.error("--profile profiles one engine's steps: it needs --data-parallel-size 1")
    return args


def apply_defaults(args) -> bool:
    """Fills unset workload flags for the device; returns whether the model runs on dummy
    weights (its folder has no safetensors)."""
    on_gpu = args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
    defaults = GPU_DEFAULTS if on_gpu else CPU_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    dummy = not glob.glob(os.path.join(args.model, "*.safetensors"))
    if args.dtype == "auto" and dummy:
        args.dtype = "bfloat16" if on_gpu else "float32"
    if not on_gpu:
        print("No GPU: using the small CPU workload "
              f"({args.num_seqs} sequences, model {os.path.basename(args.model)}).")
    return dummy


def make_workload(args):
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(args.min_input_len, args.max_input_len))]
               for _ in range(args.num_seqs)]
    penalties = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1) \
        if getattr(args, "penalties", False) else {}
    params = [SamplingParams(temperature=0.6, ignore_eos=True,
                             max_tokens=random.randint(args.min_output_len, args.max_output_len), **penalties)
              for _ in range(args.num_seqs)]
    return prompts, params


def versions() -> dict:
    import transformers
    info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def device_name(llm) -> str:
    device = llm.config.torch_device
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def timed_generate(llm, prompts, params) -> tuple[int, float]:
    sync(llm)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    sync(llm)
    return sum(len(o["token_ids"]) for o in outputs), time.perf_counter() - start


def sync(llm) -> None:
    """Waits for this process's GPU work; data-parallel replicas have none left here."""
    if llm.config.torch_device.type == "cuda" and llm.config.data_parallel_size == 1:
        torch.cuda.synchronize()


def profiler_activities(llm):
    cuda = [torch.profiler.ProfilerActivity.CUDA] if llm.config.torch_device.type == "cuda" else []
    return [torch.profiler.ProfilerActivity.CPU, *cuda]


def write_profile(prof, llm, out_dir: str, name: str) -> None:
    """Chrome trace and key-averages table (by device time on a GPU, else CPU time)."""
    trace, report = os.path.join(out_dir, f"{name}_trace.json"), os.path.join(out_dir, f"{name}_report.txt")
    prof.export_chrome_trace(trace)
    sort_by = "device_time_total" if llm.config.torch_device.type == "cuda" else "cpu_time_total"
    with open(report, "w") as f:
        f.write(prof.key_averages().table(sort_by=sort_by, row_limit=50))
    print(f"profile trace: {trace}\nprofile report: {report}")


def profile_steps(llm, prompts, params, out_dir: str, num_steps: int = 12) -> None:
    """Profiles the workload where prefill ends and decode takes over: the last two steps
    that prefill prompts, then decode steps of the full batch."""
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    prefill_steps = -(-sum(len(p) for p in prompts) // llm.config.max_num_batched_tokens)
    for _ in range(max(prefill_steps - 2, 0)):
        llm.step()
    with torch.profiler.profile(activities=profiler_activities(llm)) as prof:
        for _ in range(num_steps):
            with torch.profiler.record_function("nanovllm.step"):
                llm.step()
        sync(llm)
    for request_id in ids:
        llm.abort(request_id)
    write_profile(prof, llm, out_dir, "profile")


def profile_first_token(llm, prompt_len: int, out_dir: str) -> None:
    """One prompt to its first token: the eager prefill path, where host overhead shows. The
    Python profile names the host-side hot spots the torch profiler cannot see."""
    with torch.profiler.profile(activities=profiler_activities(llm)) as prof:
        time_to_first_token_ms(llm, prompt_len, repeats=1)
    write_profile(prof, llm, out_dir, "profile_first_token")
    python_profile = cProfile.Profile()
    python_profile.runcall(time_to_first_token_ms, llm, prompt_len, 1)
    path = os.path.join(out_dir, "profile_first_token_python.txt")
    with open(path, "w") as f:
        pstats.Stats(python_profile, stream=f).sort_stats("tottime").print_stats(40)
    print(f"python profile: {path}")


def time_to_first_token_ms(llm, prompt_len: int, repeats: int = 5) -> float:
    """Median latency of one prompt to its first token; fresh tokens each time, so the prefix
    cache cannot serve it."""
    rng = random.Random(1)
    times = []
    for _ in range(repeats):
        prompt = [rng.randint(0, 10000) for _ in range(prompt_len)]
        sync(llm)
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def save_hf_checkpoint(config_dir: str, dtype: torch.dtype, device: str) -> str:
    """A real checkpoint with random weights, so both engines run the same weights. Drawn on
    the GPU where there is one: a 7B model's random init takes minutes on the CPU."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(config_dir)
    torch.manual_seed(0)
    with torch.device("cuda" if device != "cpu" and torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    path = tempfile.mkdtemp(prefix="nanovllm_bench_")
    model.save_pretrained(path)
    del model
    return path


def run_hf(model_dir: str, prompts, params, device: torch.device, dtype: torch.dtype) -> dict:
    """transformers on the same prompts: its continuous-batching API where it exists, else
    batched generate with left padding (every row generates the longest output length)."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    max_new = max(p.max_tokens for p in params)
    config = GenerationConfig(do_sample=True, temperature=0.6, top_k=0, top_p=1.0, max_new_tokens=max_new,
                              eos_token_id=-1, pad_token_id=0)
    if hasattr(model, "generate_batch") and device.type == "cuda":
        start = time.perf_counter()
        outputs = model.generate_batch(inputs=prompts, generation_config=config)
        torch.cuda.synchronize()
        tokens = sum(len(o.generated_tokens) for o in outputs.values())
        return {"method": "generate_batch (continuous batching)", "tokens": tokens,
                "seconds": time.perf_counter() - start}
    return _run_hf_padded(model, prompts, config, device)


@torch.inference_mode()
def _run_hf_padded(model, prompts, config, device) -> dict:
    longest = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=device)
    start = time.perf_counter()
    out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config,
                         min_new_tokens=config.max_new_tokens)
    if device.type == "cuda":
        torch.cuda.synchronize()
    tokens = (out.shape[1] - longest) * out.shape[0]
    return {"method": "generate (static batch, left padding)", "tokens": tokens, "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None):
    args = parse_args(argv)
    dummy = apply_defaults(args)
    os.makedirs(args.out, exist_ok=True)
    prompts, params = make_workload(args)
    model_dir, load_format, checkpoint = args.model, "dummy" if dummy else "auto", None
    if args.compare_hf and dummy:
        checkpoint = model_dir = save_hf_checkpoint(args.model, DTYPES[args.dtype], args.device)
        load_format = "auto"
    max_len = args.max_input_len + args.max_output_len
    llm = LLM(model_dir, device=args.device, dtype=args.dtype, enforce_eager=args.enforce_eager,
              load_format=load_format, max_model_len=max_len, tensor_parallel_size=args.tensor_parallel_size,
              data_parallel_size=args.data_parallel_size)
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    tokens, seconds = timed_generate(llm, prompts, params)
    prompt_tokens = sum(len(p) for p in prompts)
    result = {"engine": "nanovllm", "device": device_name(llm), "dtype": str(llm.config.torch_dtype),
              "model": os.path.basename(os.path.normpath(args.model)), "num_seqs": len(prompts),
              "output_tokens": tokens, "seconds": round(seconds, 3), "output_tok_per_s": round(tokens / seconds, 1),
              "total_tok_per_s": round((tokens + prompt_tokens) / seconds, 1),
              "enforce_eager": args.enforce_eager, "tensor_parallel_size": args.tensor_parallel_size,
              "data_parallel_size": args.data_parallel_size, **versions(), "date": time.strftime("%Y-%m-%d")}
    ttft_len = min(1024, args.max_input_len)
    result[f"ttft_ms_{ttft_len}_tokens"] = round(time_to_first_token_ms(llm, ttft_len), 2)
    print(f"Generated {tokens} tokens in {seconds:.2f} s: {tokens / seconds:.1f} output tok/s, "
          f"{(tokens + prompt_tokens) / seconds:.1f} total tok/s; time to first token "
          f"({ttft_len}-token prompt) {result[f'ttft_ms_{ttft_len}_tokens']} ms")
    if args.profile:
        profile_steps(llm, prompts, params, args.out)
        profile_first_token(llm, ttft_len, args.out)
    if args.compare_hf:
        device, dtype = llm.config.torch_device, llm.config.torch_dtype
        llm.close()  # a tensor-parallel engine frees its other GPUs too
        del llm
        gc.collect()  # the engine's weights and KV cache, before transformers loads its copy
        if device.type == "cuda":
            torch.cuda.empty_cache()
        hf = run_hf(model_dir, prompts, params, device, dtype)
        hf_rate = hf["tokens"] / hf["seconds"]
        result["hf"] = {**hf, "output_tok_per_s": round(hf_rate, 1)}
        result["speedup_vs_hf"] = round(result["output_tok_per_s"] / hf_rate, 2)
        print(f"transformers [{hf['method']}]: {hf['tokens']} tokens in {hf['seconds']:.2f} s: "
              f"{hf_rate:.1f} tok/s; nanovllm is {result['speedup_vs_hf']:.2f}x")
    if checkpoint:
        shutil.rmtree(checkpoint, ignore_errors=True)
    with open(os.path.join(args.out, "bench_result.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
