"""Output throughput against the number of concurrent sequences, for nanovllm and for
transformers' batched `generate`, on the same random-weight checkpoint: equal-length prompts
(so transformers needs no padding) and a fixed number of output tokens.

    python -m benchmarks.bench_concurrency --out DIR      # writes concurrency.json
    python -m benchmarks.bench_concurrency --plot DIR/concurrency.json --png docs/throughput_vs_concurrency.png
"""
import argparse
import json
import os
import shutil
import time

import torch

from nanovllm.entrypoints.bench import CONFIGS, save_hf_checkpoint, versions
from nanovllm import LLM, SamplingParams


def nanovllm_rate(llm, batch: int, prompt_len: int, output_len: int) -> float:
    prompts = [[(7 * i + j) % 10000 for j in range(prompt_len)] for i in range(batch)]
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=output_len)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    return sum(len(o["token_ids"]) for o in outputs) / (time.perf_counter() - start)


@torch.inference_mode()
def hf_rate(model, batch: int, prompt_len: int, output_len: int) -> float:
    input_ids = torch.tensor([[(7 * i + j) % 10000 for j in range(prompt_len)] for i in range(batch)], device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True,
                         temperature=0.6, top_k=0, max_new_tokens=output_len, min_new_tokens=output_len,
                         pad_token_id=0)
    torch.cuda.synchronize()
    return (out.shape[1] - prompt_len) * batch / (time.perf_counter() - start)


def measure(args) -> dict:
    checkpoint = save_hf_checkpoint(os.path.join(CONFIGS, "qwen3-0.6b"), torch.bfloat16)
    rows = []
    try:
        llm = LLM(checkpoint, dtype="bfloat16", max_model_len=args.prompt_len + args.output_len + 16)
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
        for batch in args.batches:
            rows.append({"batch": batch, "nanovllm": nanovllm_rate(llm, batch, args.prompt_len, args.output_len)})
        del llm
        torch.cuda.empty_cache()
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).cuda().eval()
        hf_rate(model, 1, args.prompt_len, 4)
        for row in rows:
            row["transformers"] = hf_rate(model, row["batch"], args.prompt_len, args.output_len)
            print(f"batch {row['batch']:4d}: nanovllm {row['nanovllm']:9.1f} tok/s   "
                  f"transformers {row['transformers']:8.1f} tok/s   ratio {row['nanovllm'] / row['transformers']:.1f}x")
    finally:
        shutil.rmtree(checkpoint, ignore_errors=True)
    return {"device": torch.cuda.get_device_name(), "prompt_len": args.prompt_len, "output_len": args.output_len,
            "rows": rows, **versions(), "date": time.strftime("%Y-%m-%d")}


def plot(json_path: str, png_path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(json_path) as f:
        data = json.load(f)
    batches = [r["batch"] for r in data["rows"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    for engine in ("nanovllm", "transformers"):
        ax.plot(batches, [r[engine] for r in data["rows"]], marker="o", label=engine)
    ax.set(xscale="log", yscale="log", xlabel="concurrent sequences", ylabel="output tokens / s",
           title=f"Qwen3-0.6B bf16, {data['device']}\nprompt {data['prompt_len']}, output {data['output_len']} tokens")
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--plot", help="concurrency.json to plot instead of measuring")
    parser.add_argument("--png", default="docs/throughput_vs_concurrency.png")
    args = parser.parse_args()
    if args.plot:
        return plot(args.plot, args.png)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "concurrency.json"), "w") as f:
        json.dump(measure(args), f, indent=2)


if __name__ == "__main__":
    main()
