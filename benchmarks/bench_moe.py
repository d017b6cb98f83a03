"""The fused MoE layer (kernels.moe_topk + kernels.fused_moe) against two PyTorch layers of the
same routing and weights: a loop over the experts that got tokens with cuBLAS GEMMs
(transformers' expert loop: it reads the routing on the host) and torch._grouped_mm over the
tokens sorted by expert, where this torch and GPU have it. Qwen3-30B-A3B's layer shape
(hidden 2048, 128 experts of intermediate 768, 8 a token; read from nanovllm/configs), bf16,
at 1, 64 and 4096 tokens. Times are medians of kernels.benchmark_kernel (CUDA-graph replays;
the loop, which synchronises, eagerly). "floor ms": the bytes of the experts that the batch
reaches plus x and the output, at the copy rate of a 1 GiB device-to-device copy measured in
the same run. Each layer's output is checked against the fused one's. One JSON object.

    python -m benchmarks.bench_moe --out out/moe     # about a minute on an H100 / H200"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

from benchmarks.bench_latency import CONFIGS, copy_rate_gbs, write_json
from benchmarks.kernel_cases import relative_error
from nanovllm import kernels
from nanovllm.models import model_config_from_dir

TOKENS = (1, 64, 4096)


def fused_layer(x, logits, w13, w2, top_k):
    weights, ids = kernels.moe_topk(logits, top_k, True)
    return kernels.fused_moe(x, w13, w2, weights, ids)


def expert_loop(x, logits, w13, w2, top_k):
    """One pair of cuBLAS GEMMs per expert that got tokens."""
    weights, ids = kernels.moe_topk(logits, top_k, True)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in ids.unique().tolist():
        tokens, which = (ids == expert).nonzero(as_tuple=True)
        activated = kernels.silu_and_mul(F.linear(x[tokens], w13[expert]))
        out.index_add_(0, tokens, F.linear(activated, w2[expert]).float() * weights[tokens, which, None])
    return out.to(x.dtype)


def grouped_mm_layer(x, logits, w13, w2, top_k):
    """Slots sorted by expert, torch._grouped_mm over the experts' runs, the k rows summed."""
    weights, ids = kernels.moe_topk(logits, top_k, True)
    order = ids.flatten().argsort(stable=True)
    sorted_ids = ids.flatten()[order]
    ends = torch.searchsorted(sorted_ids, torch.arange(1, w13.shape[0] + 1, device=x.device, dtype=torch.int32),
                              out_int32=True)
    rows = x[order // top_k]
    activated = kernels.silu_and_mul(torch._grouped_mm(rows, w13.transpose(1, 2), offs=ends))
    down = torch._grouped_mm(activated, w2.transpose(1, 2), offs=ends).float() * weights.flatten()[order, None]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    return out.index_add_(0, order // top_k, down).to(x.dtype)


def experts_reached(ids: torch.Tensor) -> int:
    return int(ids.unique().numel())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-config", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--out", default="bench_out/moe")
    args = parser.parse_args()
    config = model_config_from_dir(os.path.join(CONFIGS, args.model_config))
    device, dtype = torch.device("cuda"), torch.bfloat16
    copy_gbs = copy_rate_gbs(device)
    experts, top_k, hidden, inter = (config.num_experts, config.num_experts_per_tok, config.hidden_size,
                                     config.moe_intermediate_size)
    torch.manual_seed(0)
    w13 = torch.randn(experts, 2 * inter, hidden, dtype=dtype, device=device) * hidden ** -0.5
    w2 = torch.randn(experts, hidden, inter, dtype=dtype, device=device) * inter ** -0.5
    expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    layers = {"fused": fused_layer, "cublas_loop": expert_loop, "grouped_mm": grouped_mm_layer}
    result = {"model": args.model_config, "device": torch.cuda.get_device_name(device), "dtype": str(dtype),
              "torch": torch.__version__, "copy_gbs": copy_gbs, "experts": experts, "top_k": top_k,
              "hidden": hidden, "moe_intermediate": inter, "cases": []}
    for tokens in args.tokens:
        x = torch.randn(tokens, hidden, dtype=dtype, device=device)
        logits = torch.randn(tokens, experts, dtype=dtype, device=device)
        reached = experts_reached(kernels.moe_topk(logits, top_k, True)[1])
        floor_ms = (reached * expert_bytes + 2 * x.numel() * x.element_size()) / (copy_gbs * 1e9) * 1e3
        case = {"tokens": tokens, "experts_reached": reached, "floor_ms": floor_ms}
        expected = fused_layer(x, logits, w13, w2, top_k)
        for name, layer in layers.items():
            try:
                error = relative_error(layer(x, logits, w13, w2, top_k), expected)
                ms = kernels.benchmark_kernel(layer, x, logits, w13, w2, top_k)
            except (RuntimeError, AttributeError, NotImplementedError) as exc:  # _grouped_mm absent or refused
                case[name] = {"unavailable": f"{type(exc).__name__}: {exc}"[:200]}
                continue
            case[name] = {"ms": ms, "rel_err_vs_fused": error, "pct_of_floor": 100 * floor_ms / ms}
        result["cases"].append(case)
        print(case, file=sys.stderr)
    write_json(result, args.out, "moe.json")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
