"""transformers `generate` on the Qwen3-0.6B architecture, with and without
nanovllm.integrations.transformers.swap_layers: time per generated token and the speed-up.

Weights are random (nothing is downloaded), so the text is meaningless; min_new_tokens equal to
max_new_tokens makes every run produce the same number of tokens. Both variants run on one
model instance, swapped and restored in turn, and alternate between timed repeats so drift in
clocks or allocator state falls on both.

From the repository root:

    python -m benchmarks.bench_hf_swap --out out/bench_hf_swap       # H100/H200, about 1-2 minutes
    python -m benchmarks.bench_hf_swap --device cpu --dtype float32 --layers 2 --batch-sizes 1 2 \\
        --prompt-len 8 --new-tokens 4 --repeats 1                      # a smoke run without a GPU"""
import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import transformers
from transformers import Qwen3Config, Qwen3ForCausalLM

from nanovllm.integrations.transformers import restore_layers, swap_layers

# Qwen3-0.6B's published architecture.
QWEN3_0_6B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                  rope_parameters=dict(rope_type="default", rope_theta=1000000.0), rms_norm_eps=1e-6,
                  max_position_embeddings=40960, hidden_act="silu")


def build_model(layers: int, dtype: torch.dtype, device: str) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(**{**QWEN3_0_6B, "num_hidden_layers": layers})
    with torch.device(device):  # initialise on the device: far faster than random init on the host
        model = Qwen3ForCausalLM(config)
    return model.to(dtype).eval()


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_generate(model, input_ids, new_tokens: int, device: str):
    synchronize(device)
    start = time.perf_counter()
    output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                            max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    synchronize(device)
    elapsed = time.perf_counter() - start
    assert output.shape[1] == input_ids.shape[1] + new_tokens, "generate stopped early"
    return elapsed, output[:, input_ids.shape[1]:]


@torch.inference_mode()
def last_logits(model, input_ids):
    return model(input_ids, logits_to_keep=1).logits.float()


def run_variant(model, swapped: bool, input_ids, new_tokens: int, device: str):
    if swapped:
        swap_layers(model)
    try:
        return timed_generate(model, input_ids, new_tokens, device)
    finally:
        restore_layers(model)


def bench_batch(model, batch: int, args) -> dict:
    generator = torch.Generator().manual_seed(batch)
    input_ids = torch.randint(0, model.config.vocab_size, (batch, args.prompt_len), generator=generator).to(args.device)
    expected = last_logits(model, input_ids)
    swap_layers(model)
    actual = last_logits(model, input_ids)
    restore_layers(model)
    rel_err = ((actual - expected).norm() / expected.norm()).item()

    for swapped in (False, True):  # warm-up: Triton compiles and the allocator settles
        run_variant(model, swapped, input_ids, args.warmup_tokens, args.device)
    seconds = {False: [], True: []}
    tokens = {}
    for _ in range(args.repeats):
        for swapped in (False, True):
            elapsed, tokens[swapped] = run_variant(model, swapped, input_ids, args.new_tokens, args.device)
            seconds[swapped].append(elapsed)
    baseline_ms = statistics.median(seconds[False]) / args.new_tokens * 1e3
    swapped_ms = statistics.median(seconds[True]) / args.new_tokens * 1e3
    return {
        "batch": batch,
        "baseline_ms_per_token": baseline_ms,
        "swapped_ms_per_token": swapped_ms,
        "speedup": baseline_ms / swapped_ms,
        "baseline_tokens_per_s": batch * 1e3 / baseline_ms,
        "swapped_tokens_per_s": batch * 1e3 / swapped_ms,
        "prefill_logits_rel_err": rel_err,
        # random weights give near-tied logits, so bf16 rounding may send greedy decoding elsewhere
        "greedy_token_agreement": (tokens[False] == tokens[True]).float().mean().item(),
    }


def markdown(result: dict) -> str:
    lines = [
        f"Qwen3-0.6B architecture ({result['layers']} layers), random {result['dtype']} weights, "
        f"{result['prompt_len']}-token prompts, {result['new_tokens']} new tokens, greedy; "
        f"{result['device_name']}, torch {result['torch']}, transformers {result['transformers']}; "
        f"swap: {result['swap_report']}",
        "",
        "| batch | transformers ms/token | swapped ms/token | speed-up | tokens/s before -> after "
        "| prefill logits rel. err | greedy token agreement |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        lines.append(f"| {row['batch']} | {row['baseline_ms_per_token']:.2f} | {row['swapped_ms_per_token']:.2f} "
                     f"| {row['speedup']:.2f}x "
                     f"| {row['baseline_tokens_per_s']:.0f} -> {row['swapped_tokens_per_s']:.0f} "
                     f"| {row['prefill_logits_rel_err']:.1e} | {row['greedy_token_agreement']:.0%} |")
    lines.append(f"\nTotal benchmark time: {result['wall_s']:.0f} s")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--warmup-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=QWEN3_0_6B["num_hidden_layers"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--out", type=Path, help="folder for bench_hf_swap.json and bench_hf_swap.md")
    args = parser.parse_args()

    start = time.perf_counter()
    model = build_model(args.layers, getattr(torch, args.dtype), args.device)
    swap_report = str(swap_layers(model))
    restore_layers(model)
    print(swap_report)
    rows = []
    for batch in args.batch_sizes:
        rows.append(bench_batch(model, batch, args))
        print(json.dumps(rows[-1]))
    on_cuda = args.device.startswith("cuda")
    result = {
        "device_name": torch.cuda.get_device_name() if on_cuda else platform.processor() or "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__, "dtype": args.dtype,
        "layers": args.layers, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "repeats": args.repeats, "swap_report": swap_report, "rows": rows,
        "wall_s": time.perf_counter() - start,
    }
    table = markdown(result)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_hf_swap.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.out / "bench_hf_swap.md").write_text(table)


if __name__ == "__main__":
    main()
