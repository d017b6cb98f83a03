"""The kernel boundary: every layer calls only these functions. Each checks its arguments
(checks.py: a ValueError naming the argument, before any launch) and then runs the Triton
kernel, the CUDA C++ one or the PyTorch reference, as `dispatch` decides. The ops live in
ops.py (element-wise, norms, rotary, KV cache, attention, sampling), linear_ops.py (the
projections and which rows take the GEMV), moe_ops.py (mixtures of experts) and
staging_layout.py (a step's inputs and tokens through pinned memory)."""
from nanovllm.kernels.dispatch import KERNELS_AVAILABLE, backend_for, graph_capturable
from nanovllm.kernels.linear_ops import (GEMV_MAX_ROWS, GEMV_ROW_MAX_ROWS, act_linear, embed_norm_linear, fp8_linear,
                                         linear,
                                         linear_act, norm_linear, small_batch_linear)
from nanovllm.kernels.moe_ops import fused_moe, moe_align, moe_topk
from nanovllm.kernels.ops import (apply_rotary_emb, element_wise_mul_add, fused_add_gelu, fused_add_rms_norm,
                                  gelu_and_mul, paged_attention, qk_norm_rope_attention, qk_norm_rope_store,
                                  rms_norm, sample, silu_and_mul, store_kvcache)
from nanovllm.kernels.staging_layout import (STAGE_SLOT_MIN, publish_tokens, stage_inputs, staged_length,
                                             staged_values)
from nanovllm.utils.timing import benchmark_kernel  # noqa: F401  (importable from here too; not a kernel)

__all__ = [
    "KERNELS_AVAILABLE", "backend_for", "graph_capturable",
    "silu_and_mul", "gelu_and_mul", "fused_add_gelu", "element_wise_mul_add", "rms_norm",
    "fused_add_rms_norm", "apply_rotary_emb", "store_kvcache", "qk_norm_rope_store", "paged_attention",
    "qk_norm_rope_attention",
    "sample", "small_batch_linear", "linear", "norm_linear", "embed_norm_linear", "linear_act", "act_linear",
    "GEMV_MAX_ROWS", "GEMV_ROW_MAX_ROWS",
    "staged_values", "staged_length", "stage_inputs", "publish_tokens", "STAGE_SLOT_MIN",
    "moe_topk", "moe_align", "fused_moe", "fp8_linear",
]
