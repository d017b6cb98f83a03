"""Start-up time of the engine: from the start of a process to LLM() ready, then to the
first token, and the stages of LLM() (rank 0's, with several ranks): the model's build and
weights, the KV cache (on a GPU sized by a warm-up step), the CUDA graphs' capture and the
sampler's warm-up, which launches every variant of the sampling kernels so that no request
compiles one. Qwen3-0.6B config with dummy weights; --model-config picks another.

Cold: fresh Triton and CUDA C++ kernel caches (TRITON_CACHE_DIR, NANOVLLM_CUDA_CACHE), every
kernel compiles. Warm: the same caches again, kernels load from disk. Each run is a fresh
process; the first request is one prompt of --prompt-tokens ids to one token, with Qwen3's
recommended sampling (temperature 0.6, top-k 20, top-p 0.95).

    python -m benchmarks.bench_startup --out out/startup        # two runs of ~1 minute or less each
Without a GPU (a smoke run of the logic):
    python -m benchmarks.bench_startup --device cpu --model-config qwen3-tiny --warm-runs 1 --out /tmp/startup"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.bench_latency import model_dir, write_json

# ModelRunner's methods timed as LLM()'s stages
STAGES = {"model": "_build_model", "kv_cache": "_allocate_kv_cache", "graph_capture": "_capture_graphs",
          "sampler_warmup": "_warm_up_sampler"}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-config", default="qwen3-0.6b", help="a folder under nanovllm/configs, or any folder")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--warm-runs", type=int, default=2, help="runs with the caches the cold run filled")
    parser.add_argument("--out", default="bench_out/startup", help="folder for startup.json")
    parser.add_argument("--child", type=float, help=argparse.SUPPRESS)  # a run's process: the time it was started
    return parser.parse_args(argv)


def engine_args(args) -> dict:
    return dict(load_format="dummy", device=args.device, tensor_parallel_size=args.tensor_parallel_size,
                gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
                max_model_len=max(1024, args.prompt_tokens + 1))


def timed_stages(runner_cls, seconds: dict) -> None:
    """Wraps the ModelRunner methods of STAGES to add their durations to `seconds`."""
    for stage, name in STAGES.items():
        method = getattr(runner_cls, name)

        def timed(self, *a, _method=method, _stage=stage, **kw):
            started = time.perf_counter()
            try:
                return _method(self, *a, **kw)
            finally:
                seconds[_stage] = seconds.get(_stage, 0.0) + time.perf_counter() - started
        setattr(runner_cls, name, timed)


def child(args) -> dict:
    """One run, in this process: seconds since its start (args.child, the parent's clock)."""
    from nanovllm import LLM, SamplingParams
    from nanovllm.engine.model_runner import ModelRunner
    imported = time.time()  # the interpreter's start, torch's and nanovllm's imports
    stages = {}
    timed_stages(ModelRunner, stages)
    llm = LLM(model_dir(args.model_config), **engine_args(args))
    ready = time.time()
    params = SamplingParams(temperature=0.6, top_k=20, top_p=0.95, max_tokens=1)
    llm.generate([list(range(2, 2 + args.prompt_tokens))], params, use_tqdm=False)
    first_token = time.time()
    runner = llm.model_runner
    result = {"imports_s": imported - args.child, "llm_ready_s": ready - args.child,
              "first_token_s": first_token - args.child, "first_request_s": first_token - ready, "stages_s": stages,
              "device": str(runner.device), "cuda_graphs": bool(runner.graphs)}
    llm.close()
    return result


def run(args, caches: dict) -> dict:
    """A run in a fresh process with the kernel caches `caches` (environment variables)."""
    command = [sys.executable, "-m", "benchmarks.bench_startup", *sys.argv[1:], "--child"]
    started = time.time()
    done = subprocess.run([*command, repr(started)], env={**os.environ, **caches}, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the run failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    args = parse_args()
    if args.child is not None:
        print(json.dumps(child(args)))
        return
    import torch
    with tempfile.TemporaryDirectory() as caches:
        env = {"TRITON_CACHE_DIR": os.path.join(caches, "triton"), "NANOVLLM_CUDA_CACHE": os.path.join(caches, "cuda")}
        runs = [{"cache": "cold", **run(args, env)}] + [{"cache": "warm", **run(args, env)}
                                                          for _ in range(args.warm_runs)]
    result = {"model": os.path.basename(os.path.normpath(model_dir(args.model_config))),
              "device": torch.cuda.get_device_name() if runs[0]["device"].startswith("cuda") else "cpu",
              "tensor_parallel_size": args.tensor_parallel_size, "prompt_tokens": args.prompt_tokens,
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "runs": runs}
    print(f"{'cache':>6} {'ready s':>8} {'1st token s':>12} {'request s':>10}  stages (s)")
    for r in runs:
        stages = ", ".join(f"{name} {seconds:.2f}" for name, seconds in r["stages_s"].items())
        print(f"{r['cache']:>6} {r['llm_ready_s']:8.2f} {r['first_token_s']:12.2f} {r['first_request_s']:10.3f}  "
              f"{stages}")
    print("wrote", write_json(result, args.out, "startup.json"))


if __name__ == "__main__":
    main()
