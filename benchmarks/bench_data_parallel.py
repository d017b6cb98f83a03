"""Makespan of a mixed-length workload over M data-parallel replicas under each balancing rule:
`tokens` (a request weighs its prompt and max_tokens: data_parallel.request_load, the rule in
use) and `requests` (every request weighs 1). Prompt and output lengths are bench.py's (its GPU
workload on a GPU, its small CPU one otherwise, with more sequences), ignore_eos; both rules
run on the same replicas, alternately, each repeat with fresh token ids of the same lengths so
that no prefix cache serves a later run. Prints one JSON object: per rule the median makespan
(wall clock, and the largest replica CPU time: on a CPU shared with other programs, the fair
one) and, for its last run, each replica's requests, prompt tokens, max_tokens, seconds until its share came back
and CPU seconds.

On CPU each process uses one thread, so the replicas are equally fast:
    python -m benchmarks.bench_data_parallel
On two GPUs, Qwen3-0.6B with dummy weights:
    python -m benchmarks.bench_data_parallel --device cuda --model nanovllm/configs/qwen3-0.6b"""
import argparse
import json
import os
import random
import statistics
import time

import torch

from nanovllm import LLM
from nanovllm.engine import data_parallel
from nanovllm.entrypoints.bench import CPU_DEFAULTS, GPU_DEFAULTS, make_workload

RULES = {"tokens": data_parallel.request_load, "requests": lambda num_prompt_tokens, params: 1}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", help="default: bench.py's for the device")
    parser.add_argument("--data-parallel-size", type=int, default=2)
    parser.add_argument("--num-seqs", type=int, help="default: bench.py's on a GPU, 128 on CPU")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    defaults = GPU_DEFAULTS if args.device.startswith("cuda") else {**CPU_DEFAULTS, "num_seqs": 128}
    for name, value in defaults.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    return args


def fresh_ids(prompts: list[list[int]], rng: random.Random) -> list[list[int]]:
    return [[rng.randint(0, 10000) for _ in prompt] for prompt in prompts]


def cpu_seconds(pid: int) -> float:
    """A process's user and system time (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed_run(llm, prompts, params, rule: str) -> dict:
    """One generate() under `rule`, with what each replica was sent, when its share came back
    and the CPU time its process spent (on a busy machine the wall clock also counts the time
    other programs took the cores; a replica's own CPU time does not)."""
    workers = llm.replicas
    cpu_before = [cpu_seconds(process.pid) for process in workers.processes]
    data_parallel.request_load, sent, done_at, start = RULES[rule], {}, {}, time.perf_counter()

    def recorded_send(message, to=None):
        _, share_prompts, share_params, _ = message
        sent[to] = {"requests": len(share_prompts), "prompt_tokens": sum(map(len, share_prompts)),
                    "max_tokens": sum(sp.max_tokens for sp in share_params)}
        return type(workers).send(workers, message, to)

    def timed_replies(shares):
        for replica, share in type(workers).replies(workers, shares):
            done_at[replica] = time.perf_counter() - start
            yield replica, share

    workers.send, workers.replies = recorded_send, timed_replies
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        del workers.send, workers.replies
        data_parallel.request_load = RULES["tokens"]
    makespan = time.perf_counter() - start
    cpu = [cpu_seconds(process.pid) - before for process, before in zip(workers.processes, cpu_before)]
    return {"makespan_s": makespan, "cpu_makespan_s": max(cpu),
            "replicas": [{**sent[i], "seconds": round(done_at[i], 3), "cpu_seconds": round(cpu[i], 3)}
                         for i in sorted(sent)]}


def main():
    args = parse_args()
    torch.set_num_threads(1)  # the replicas inherit it: one core each on CPU
    prompts, params = make_workload(args)
    llm = LLM(args.model, device=args.device, load_format="dummy", data_parallel_size=args.data_parallel_size,
              max_model_len=args.max_input_len + args.max_output_len,
              dtype="bfloat16" if args.device.startswith("cuda") else "float32")
    rng = random.Random(1)
    with llm:
        llm.generate(fresh_ids(prompts[:8], rng), params[:8], use_tqdm=False)  # warm-up: every replica's first steps
        runs = {rule: [] for rule in RULES}
        for repeat in range(args.repeats):
            for rule in list(RULES)[::1 if repeat % 2 == 0 else -1]:  # ABBA: drifts in load cancel out
                runs[rule].append(timed_run(llm, fresh_ids(prompts, rng), params, rule))
    result = {"device": args.device, "model": args.model, "data_parallel_size": args.data_parallel_size,
              "num_seqs": len(prompts), "repeats": args.repeats,
              "input_len": [args.min_input_len, args.max_input_len],
              "output_len": [args.min_output_len, args.max_output_len]}
    for rule, timings in runs.items():
        result[rule] = {"makespan_s": round(statistics.median(t["makespan_s"] for t in timings), 3),
                        "makespans_s": [round(t["makespan_s"], 3) for t in timings],
                        "cpu_makespan_s": round(statistics.median(t["cpu_makespan_s"] for t in timings), 3),
                        "cpu_makespans_s": [round(t["cpu_makespan_s"], 3) for t in timings],
                        "replicas": timings[-1]["replicas"]}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
