"""FP8 weights (quantization="fp8": e4m3 weights with per-output-row scales, per-token FP8
activations) against bf16, on dummy weights: the FP8 engine quantizes the same bf16 values the
bf16 engine runs. Prints one JSON object:

- decode: batch-1 greedy decode tok/s (a 128-token prompt, --decode-tokens outputs) on the
  Qwen3-8B shape, bf16 and FP8, and their ratio;
- throughput: bench.py's workload (nanovllm.entrypoints.bench.make_workload; --num-seqs
  sequences on Qwen3-8B) in output tok/s, on Qwen3-0.6B and Qwen3-8B;
- prefill: TFLOP/s (2 x parameters x tokens / time) of one --prefill-tokens prompt on
  Qwen3-8B, and of the o_proj-shaped GEMM alone (kernels.fp8_linear against F.linear);
- accuracy: on Qwen3-0.6B with its LM head scaled up (--sharpen) so that greedy choices are
  clear, the share of greedy tokens where FP8 agrees with bf16 before their first difference,
  and the relative error of FP8's last-position logits of random prompts.

    python -m benchmarks.bench_fp8 --out out/fp8          # about 3 minutes on an H200"""
import argparse
import json
import os
import random
import time

import torch
import torch.nn.functional as F

from nanovllm import LLM, SamplingParams
from nanovllm.entrypoints.bench import make_workload, timed_generate
from nanovllm.utils.context import reset_context, set_context

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "nanovllm", "configs")
ENGINE = dict(load_format="dummy", dtype="bfloat16", max_model_len=4096)


def engine(name: str, quantization: str | None) -> LLM:
    return LLM(os.path.join(CONFIGS, name), quantization=quantization, **ENGINE)


def decode_tok_s(llm: LLM, tokens: int) -> float:
    prompt = [random.Random(0).randrange(1000, 10000) for _ in range(128)]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    generated, seconds = timed_generate(llm, [prompt], params)
    return generated / seconds


def throughput_tok_s(llm: LLM, num_seqs: int) -> float:
    workload = argparse.Namespace(num_seqs=num_seqs, min_input_len=100, max_input_len=1024, min_output_len=100,
                                  max_output_len=1024)
    prompts, params = make_workload(workload)
    llm.generate(prompts[:2], SamplingParams(max_tokens=8), use_tqdm=False)
    generated, seconds = timed_generate(llm, prompts, params)
    return generated / seconds


@torch.inference_mode()
def prefill_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Logits of every position of one prompt, run straight through the model into blocks
    0, 1, ... of the idle engine's cache."""
    runner = llm.model_runner
    on = dict(device=runner.device)
    n = len(ids)
    set_context(cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, **on),
                seq_lens=torch.tensor([n], dtype=torch.int32, **on),
                block_tables=torch.arange(-(-n // runner.block_size), dtype=torch.int32, **on)[None],
                slot_mapping=torch.arange(n, **on), max_seqlen_q=n)
    try:
        return runner.model.compute_logits(runner.model(torch.tensor(ids, **on), torch.arange(n, **on)))
    finally:
        reset_context()


def prefill_tflops(llm: LLM, tokens: int) -> float:
    # The embedding is a lookup, not a matmul: the projections and the LM head count.
    params = sum(p.numel() for name, p in llm.model_runner.model.named_parameters()
                 if p.dim() == 2 and "embed_tokens" not in name)
    ids = [random.Random(1).randrange(1000, 10000) for _ in range(tokens)]
    prefill_logits(llm, ids[:256])
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(3):
        prefill_logits(llm, ids)
    torch.cuda.synchronize()
    return 2 * params * tokens * 3 / (time.perf_counter() - start) / 1e12


def gemm_tflops(rows: int, n: int = 4096, k: int = 4096) -> dict:
    from nanovllm import kernels
    from nanovllm.kernels.reference import quantize_fp8
    x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
    q, s = quantize_fp8(w, None)
    qb, sb = quantize_fp8(w, (128, 128))
    out = {}
    for name, fn in (("bf16", lambda: F.linear(x, w)), ("fp8_rows", lambda: kernels.fp8_linear(x, q, s, None)),
                     ("fp8_blocks", lambda: kernels.fp8_linear(x, qb, sb, (128, 128)))):
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        out[name] = round(2 * rows * n * k * 20 / (time.perf_counter() - start) / 1e12, 1)
    return out


def sharpen(llm: LLM, factor: float) -> None:
    with torch.no_grad():
        llm.model_runner.model.lm_head.weight.mul_(factor)


def accuracy(sharpen_by: float, prompts: int, tokens: int) -> dict:
    rng = random.Random(2)
    batch = [[rng.randrange(1000, 10000) for _ in range(64)] for _ in range(prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    results = {}
    for quantization in (None, "fp8"):
        llm = engine("qwen3-0.6b", quantization)
        sharpen(llm, sharpen_by)
        outputs = [o["token_ids"] for o in llm.generate(batch, params, use_tqdm=False)]
        logits = torch.stack([prefill_logits(llm, ids)[-1].float() for ids in batch])
        results[quantization] = outputs, logits
        llm.close()
    (ref_tokens, ref_logits), (fp8_tokens, fp8_logits) = results[None], results["fp8"]
    agreed = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(ref_tokens, fp8_tokens)]
    return {"greedy_tokens_before_first_difference": round(sum(agreed) / (prompts * tokens), 4),
            "first_token_agreement": sum(x[0] == y[0] for x, y in zip(ref_tokens, fp8_tokens)) / prompts,
            "last_logits_relative_error": round(((fp8_logits - ref_logits).norm() / ref_logits.norm()).item(), 4)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--num-seqs", type=int, default=64, help="bench.py workload sequences on Qwen3-8B")
    parser.add_argument("--small-num-seqs", type=int, default=256, help="bench.py workload sequences on Qwen3-0.6B")
    parser.add_argument("--prefill-tokens", type=int, default=4096)
    parser.add_argument("--sharpen", type=float, default=30.0)
    parser.add_argument("--accuracy-prompts", type=int, default=16)
    parser.add_argument("--accuracy-tokens", type=int, default=32)
    parser.add_argument("--out", default=None, help="folder for fp8.json")
    args = parser.parse_args()
    result = {"device": torch.cuda.get_device_name(), "decode_tok_s": {}, "throughput_tok_s": {},
              "prefill_tflops": {}, "gemm_tflops": {rows: gemm_tflops(rows) for rows in (1, 16, 4096)}}
    for name, num_seqs in (("qwen3-0.6b", args.small_num_seqs), ("qwen3-8b", args.num_seqs)):
        for quantization in (None, "fp8"):
            key = f"{name}/{quantization or 'bf16'}"
            llm = engine(name, quantization)
            if name == "qwen3-8b":
                result["decode_tok_s"][key] = round(decode_tok_s(llm, args.decode_tokens), 1)
                result["prefill_tflops"][key] = round(prefill_tflops(llm, args.prefill_tokens), 1)
            result["throughput_tok_s"][key] = round(throughput_tok_s(llm, num_seqs), 1)
            llm.close()
    decode = result["decode_tok_s"]
    result["decode_speedup_8b"] = round(decode["qwen3-8b/fp8"] / decode["qwen3-8b/bf16"], 2)
    result["accuracy_0.6b"] = accuracy(args.sharpen, args.accuracy_prompts, args.accuracy_tokens)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fp8.json"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
