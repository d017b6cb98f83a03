"""Load generator for an OpenAI-compatible server (`nanovllm serve`, or vLLM / SGLang for a
comparison): bench.py's workload (random token-id prompts, ignore_eos, temperature 0.6) sent to
/v1/completions as streams, arriving as a Poisson process at --request-rate requests/s
("inf": all at once) and/or at most --max-concurrency at a time. Reports what `vllm bench
serve` reports: request and token throughput, failures, and time to first token (TTFT), time
per output token after the first (TPOT), inter-token latency (ITL, between streamed chunks)
and end-to-end latency (E2EL), mean and p50/p90/p99 in ms.

    nanovllm serve nanovllm/configs/qwen3-0.6b --load-format dummy --max-model-len 2048 &
    python -m benchmarks.bench_serving --max-concurrency 1,16,64,256 --out serving_out

Several comma-separated rates or concurrencies run one after the other; the results go to
OUT/bench_serving.json and a plot of latency against the varied setting to OUT/bench_serving.png.
Output tokens are counted from the usage chunk (stream_options.include_usage).

--json-schema FILE (a JSON schema, or a list of them that the requests take in turn) sends each
request with response_format json_schema; outputs end where the schema's JSON does. With
--tokenizer DIR (the served model's folder) the result also holds the schemas' cold compile
times (engine.structured_outputs.GrammarCompiler, p50 / p99 over --compile-repeats each). The
server needs a tokenizer in its model folder: for dummy weights, a copy of
nanovllm/configs/qwen3-0.6b with a tokenizer's files added (benchmarks.bench_structured_output
--write-model DIR writes one with SmolLM2's tokenizer)."""
import argparse
import asyncio
import json
import os
import random
import ssl
import time

import httpx
import numpy as np

from nanovllm.entrypoints.bench import GPU_DEFAULTS, make_workload, versions

PERCENTILES = (50, 90, 99)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", help="model name to send (default: the server's first in /v1/models)")
    parser.add_argument("--api-key", default=os.environ.get("NANOVLLM_API_KEY"))
    parser.add_argument("--num-prompts", type=int, default=GPU_DEFAULTS["num_seqs"])
    for name in ("min_input_len", "max_input_len", "min_output_len", "max_output_len"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=GPU_DEFAULTS[name])
    parser.add_argument("--vocab-size", type=int,
                        help="fold the prompts' token ids into [0, VOCAB_SIZE) (for a model with a small vocabulary)")
    parser.add_argument("--request-rate", default="inf", help="requests/s, comma-separated; inf: all at once")
    parser.add_argument("--max-concurrency", default="", help="requests in flight at most, comma-separated")
    parser.add_argument("--seed", type=int, default=0, help="seeds the arrival times")
    parser.add_argument("--label", default="nanovllm")
    parser.add_argument("--out", default="bench_serving_out")
    parser.add_argument("--json-schema", help="a JSON file: a schema, or a list of schemas, for response_format")
    parser.add_argument("--tokenizer", help="with --json-schema: the folder whose tokenizer compiles the schemas")
    parser.add_argument("--compile-repeats", type=int, default=20)
    args = parser.parse_args(argv)
    args.num_seqs = args.num_prompts  # make_workload's name
    args.rates = [float(r) for r in args.request_rate.split(",")]
    args.concurrencies = [int(c) for c in args.max_concurrency.split(",") if c] or [None]
    return args


def workload(args) -> list[dict]:
    """bench.py's prompts and output lengths, as request bodies."""
    prompts, params = make_workload(args)
    if args.vocab_size:
        prompts = [[t % args.vocab_size for t in p] for p in prompts]
    bodies = [{"prompt": p, "max_tokens": sp.max_tokens, "temperature": sp.temperature, "ignore_eos": True,
               "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
              for p, sp in zip(prompts, params)]
    for i, schema in enumerate(json_schemas(args) * len(bodies)):
        if i < len(bodies):
            bodies[i]["response_format"] = {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}
    return bodies


def json_schemas(args) -> list[dict]:
    if not args.json_schema:
        return []
    with open(args.json_schema) as f:
        schemas = json.load(f)
    return schemas if isinstance(schemas, list) else [schemas]


def compile_times(args) -> dict:
    """Cold compiles (the cache emptied before each) of every schema, in ms."""
    from transformers import AutoTokenizer

    from nanovllm.engine.structured_outputs import GrammarCompiler
    from nanovllm.sampling_params import StructuredOutputsParams
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    compiler = GrammarCompiler(tokenizer, len(tokenizer))
    times = []
    for schema in json_schemas(args):
        for _ in range(args.compile_repeats):
            compiler._compiled.clear()
            started = time.perf_counter()
            compiler.compile(StructuredOutputsParams(json=schema))
            times.append((time.perf_counter() - started) * 1e3)
    return {"compile_ms_p50": float(np.percentile(times, 50)), "compile_ms_p99": float(np.percentile(times, 99))}


async def send(http: httpx.AsyncClient, body: dict) -> dict:
    """One streamed request: when its token-bearing chunks arrived, and its usage."""
    start = time.perf_counter()
    result = {"prompt_len": len(body["prompt"]), "ttft": None, "itl": [], "output_tokens": 0, "error": None}
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result["error"] = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            last = start
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result["error"] = chunk["error"]["message"]
                    return result
                if chunk.get("usage"):
                    result["output_tokens"] = chunk["usage"]["completion_tokens"]
                if any(c.get("text") or c.get("token_ids") for c in chunk["choices"]):
                    now = time.perf_counter()
                    if result["ttft"] is None:
                        result["ttft"] = now - start
                    else:
                        result["itl"].append(now - last)
                    last = now
    except httpx.HTTPError as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        return result
    result["e2el"] = time.perf_counter() - start
    if result["ttft"] is None or not result["output_tokens"]:
        result["error"] = "no tokens or no usage chunk"
    return result


async def run(args, bodies: list[dict], rate: float, concurrency: int | None) -> dict:
    gate = asyncio.Semaphore(concurrency or len(bodies))
    rng = random.Random(args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # One client (one connection) per request in flight, reused: a shared client's pool does
    # work quadratic in its connections for every request, which delays hundreds of them.
    ssl_context, idle = ssl.create_default_context(), []

    async def one(body):
        async with gate:
            http = idle.pop() if idle else httpx.AsyncClient(base_url=args.base_url, headers=headers,
                                                             timeout=httpx.Timeout(None), verify=ssl_context)
            try:
                return await send(http, body)
            finally:
                idle.append(http)

    try:
        # Warm-up on a prompt no request shares (the first one reversed): the prefix cache must
        # not serve the first request.
        await one({**bodies[0], "prompt": bodies[0]["prompt"][::-1], "max_tokens": 8})
        tasks, start = [], time.perf_counter()
        for body in bodies:
            tasks.append(asyncio.create_task(one(body)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    finally:
        await asyncio.gather(*(http.aclose() for http in idle))
    return summarize(results, duration, rate, concurrency)


def summarize(results: list[dict], duration: float, rate: float, concurrency: int | None) -> dict:
    ok = [r for r in results if r["error"] is None]
    out_tokens = sum(r["output_tokens"] for r in ok)
    in_tokens = sum(r["prompt_len"] for r in ok)
    summary = {"request_rate": "inf" if rate == float("inf") else rate, "max_concurrency": concurrency,
               "completed": len(ok), "failed": len(results) - len(ok),
               "errors": sorted({str(r["error"]) for r in results if r["error"] is not None})[:5],
               "duration_s": round(duration, 3), "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
               "request_throughput": round(len(ok) / duration, 3), "output_throughput": round(out_tokens / duration, 1),
               "total_token_throughput": round((in_tokens + out_tokens) / duration, 1)}
    samples = {"ttft": [r["ttft"] for r in ok], "e2el": [r["e2el"] for r in ok],
               "tpot": [(r["e2el"] - r["ttft"]) / (r["output_tokens"] - 1) for r in ok if r["output_tokens"] > 1],
               "itl": [t for r in ok for t in r["itl"]]}
    for name, values in samples.items():
        ms = np.array(values or [np.nan]) * 1e3
        summary[f"mean_{name}_ms"] = round(float(ms.mean()), 3)
        for p in PERCENTILES:
            summary[f"p{p}_{name}_ms"] = round(float(np.percentile(ms, p)), 3)
    return summary


def report(summary: dict) -> None:
    setting = (f"request rate {summary['request_rate']}/s" if summary["max_concurrency"] is None
               else f"max concurrency {summary['max_concurrency']}, request rate {summary['request_rate']}/s")
    lines = [f"==== Serving benchmark: {setting} ====",
             f"Successful requests: {summary['completed']}", f"Failed requests: {summary['failed']}",
             f"Benchmark duration (s): {summary['duration_s']}",
             f"Total input tokens: {summary['total_input_tokens']}",
             f"Total generated tokens: {summary['total_output_tokens']}",
             f"Request throughput (req/s): {summary['request_throughput']}",
             f"Output token throughput (tok/s): {summary['output_throughput']}",
             f"Total token throughput (tok/s): {summary['total_token_throughput']}"]
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"---- {title} ----")
        lines.append(f"Mean {name.upper()} (ms): {summary[f'mean_{name}_ms']}")
        lines += [f"P{p} {name.upper()} (ms): {summary[f'p{p}_{name}_ms']}" for p in PERCENTILES]
    for error in summary["errors"]:
        lines.append(f"error: {error}")
    print("\n".join(lines), flush=True)


def plot(runs: list[dict], path: str) -> None:
    """Latency against whichever of request rate and max concurrency varies."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[plot]'): no plot")
        return
    by_concurrency = len({r["max_concurrency"] for r in runs}) > 1
    key, label = ("max_concurrency", "max concurrency") if by_concurrency else ("request_rate", "request rate (req/s)")
    # "inf" (all at once) is drawn at the request rate it achieved.
    x = [r["request_throughput"] if r[key] == "inf" else r[key] for r in runs]
    x, runs = zip(*sorted(zip(x, runs), key=lambda pair: pair[0]))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, name in zip(axes, ("ttft", "tpot", "e2el")):
        for p in (50, 99):
            ax.plot(x, [r[f"p{p}_{name}_ms"] for r in runs], marker="o", label=f"p{p}")
        ax.set(xlabel=label, ylabel=f"{name.upper()} (ms)", title=name.upper())
        ax.legend()
        ax.grid(alpha=0.3)
    if by_concurrency:
        for ax in axes:
            ax.set_xscale("log", base=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.model is None:
        args.model = httpx.get(f"{args.base_url}/v1/models", timeout=60,
                               headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
                               ).json()["data"][0]["id"]
    bodies = [{**body, "model": args.model} for body in workload(args)]
    runs = []
    for concurrency in args.concurrencies:
        for rate in args.rates:
            runs.append(asyncio.run(run(args, bodies, rate, concurrency)))
            report(runs[-1])
    result = {"label": args.label, "base_url": args.base_url, "model": args.model, "num_prompts": args.num_prompts,
              "input_len": [args.min_input_len, args.max_input_len],
              "output_len": [args.min_output_len, args.max_output_len], "runs": runs,
              **versions(), "date": time.strftime("%Y-%m-%d")}
    if args.json_schema:
        result["json_schema"] = args.json_schema
        if args.tokenizer:
            result["grammar"] = compile_times(args)
            print(json.dumps(result["grammar"]))
    with open(os.path.join(args.out, "bench_serving.json"), "w") as f:
        json.dump(result, f, indent=2)
    plot(runs, os.path.join(args.out, "bench_serving.png"))
    return result


if __name__ == "__main__":
    main()
