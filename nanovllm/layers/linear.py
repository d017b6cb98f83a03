"""Linear layers whose parameters carry a `weight_loader`: it copies a checkpoint tensor into
this rank's part of the parameter, and into the right slice of a merged projection, so tensor
parallelism needs no change to the loader. Column-parallel layers split the output features
across ranks, row-parallel ones the input features (their partial sums are all-reduced).

Layers built inside weight_quantization("fp8", block) hold float8_e4m3fn weights and fp32
dequant multipliers `weight_scale_inv`: one per block[0] x block[1] tile, loaded from an FP8
checkpoint (Hugging Face's layout, sharded along the weight's dims), or with block None one
per output row, computed as a higher-precision checkpoint loads (kernels.fp8_linear)."""
import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm import distributed, kernels
from nanovllm.kernels.reference import quantize_fp8
from nanovllm.utils.loader import copy_checked

# (method, weight block) of the layers being built; see weight_quantization.
_quantization: tuple[str, tuple[int, int] | None] | None = None
# kernels' gated activations by the names normed_forward and activated_forward take
_GATED = {"silu": kernels.silu_and_mul, "gelu": functools.partial(kernels.gelu_and_mul, approximate="none"),
          "gelu_tanh": functools.partial(kernels.gelu_and_mul, approximate="tanh")}


@contextlib.contextmanager
def weight_quantization(method: str | None, block: tuple[int, int] | None = None):
    """Linear layers built inside hold `method`'s weights ("fp8"; None: the model dtype)."""
    global _quantization
    previous, _quantization = _quantization, (method, block) if method else None
    try:
        yield
    finally:
        _quantization = previous


def tensor_parallel_rank_and_size() -> tuple[int, int]:
    """This process's rank and the number of ranks a model built now is split across (0 and 1
    outside a tensor-parallel engine)."""
    return distributed.rank_and_size()


class LinearBase(nn.Module):
    """y = x W^T (+ b). `shard_dim` is the weight dimension split across ranks (None: replicated)."""
    following: "LinearBase | None" = None  # the projection a decode step runs next (read_ahead)

    def __init__(self, input_size: int, output_size: int, bias: bool, shard_dim: int | None):
        super().__init__()
        self.tp_rank, self.tp_size = tensor_parallel_rank_and_size()
        self.shard_dim = shard_dim
        out_local = output_size // self.tp_size if shard_dim == 0 else output_size
        in_local = input_size // self.tp_size if shard_dim == 1 else input_size
        self.quantized = _quantization is not None
        if self.quantized:
            self._fp8_parameters(out_local, in_local, _quantization[1])
        else:
            self.weight = nn.Parameter(torch.empty(out_local, in_local))
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_local))
            self.bias.weight_loader = self.weight_loader

    def _fp8_parameters(self, out_local: int, in_local: int, block: tuple[int, int] | None) -> None:
        self.fp8_block = block
        self.weight = nn.Parameter(torch.empty(out_local, in_local, dtype=torch.float8_e4m3fn), requires_grad=False)
        # For load_format="dummy": random values of the model dtype, quantized as a checkpoint's would be.
        self.weight.quantize_from, self.weight.compute_dtype = self._store_quantized, torch.get_default_dtype()
        if block is None:  # computed at load: not a checkpoint tensor
            self.register_buffer("weight_scale_inv", torch.ones(out_local, 1, dtype=torch.float32))
        else:
            scales = torch.ones(-(-out_local // block[0]), -(-in_local // block[1]), dtype=torch.float32)
            self.weight_scale_inv = nn.Parameter(scales, requires_grad=False)
            self.weight_scale_inv.weight_loader = self.weight_loader

    def _store_quantized(self, values: torch.Tensor) -> None:
        weight, scale = quantize_fp8(values, self.fp8_block)
        self.weight.data.copy_(weight)
        self.weight_scale_inv.data.copy_(scale)

    def _copy(self, param: nn.Parameter, dst: torch.Tensor, part: torch.Tensor, name: str) -> None:
        """copy_checked, quantizing a higher-precision checkpoint's rows into an FP8 weight
        with row scales."""
        if not (self.quantized and param is self.weight and part.dtype != torch.float8_e4m3fn):
            return copy_checked(dst, part, name)
        if self.fp8_block is not None:
            raise ValueError(f"{name}: the checkpoint's FP8 layers store float8_e4m3fn weights, got {part.dtype}")
        weight, scale = quantize_fp8(part.to(dst.device), None)
        copy_checked(dst, weight, name)
        first = (dst.data_ptr() - param.data_ptr()) // (param.stride(0) * param.element_size())
        self.weight_scale_inv[first:first + dst.shape[0]] = scale

    def _block_rows(self, param: nn.Parameter) -> int:
        """Weight rows per row of `param`: a block scale's block[0], else 1."""
        return self.fp8_block[0] if self.quantized and param is getattr(self, "weight_scale_inv", None) else 1

    def _rank_part(self, loaded: torch.Tensor, dim: int | None) -> torch.Tensor:
        if dim is None or dim >= loaded.dim():
            return loaded
        size = loaded.shape[dim] // self.tp_size
        return loaded.narrow(dim, self.tp_rank * size, size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "") -> None:
        self._copy(param, param, self._rank_part(loaded, self.shard_dim), name)

    def read_ahead(self, following: "LinearBase") -> None:
        """At decode sizes this projection's kernel reads `following`'s weight into the L2 cache
        while it waits for its input (kernels.small_batch_linear's prefetch). A plain
        reference, not a submodule: the module tree and the state dict stay as they are."""
        object.__setattr__(self, "following", following)

    def _next_weight(self) -> torch.Tensor | None:
        return None if self.following is None or self.following.quantized else self.following.weight

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quantized:
            return kernels.fp8_linear(x, self.weight, self.weight_scale_inv, self.fp8_block, bias)
        return kernels.linear(x, self.weight, bias, self._next_weight())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias, shard_dim=None)


class ColumnParallelLinear(LinearBase):
    leave_room = False  # kernels.norm_linear's hint: set where the decode attention runs next

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias, shard_dim=0)

    def normed_forward(self, x: torch.Tensor, norm: nn.Module, residual: torch.Tensor | None,
                       activation: str | None = None):
        """(this projection of norm(x + residual), x + residual), of norm(x) and x without a
        residual: `norm` (an RMSNorm) fused into the projection's kernel in decode steps of one
        or two sequences (kernels.norm_linear). x and residual must not be read afterwards.
        `activation`: of a gated MLP's gate_up, act(gate) * up in place of the projection.
        FP8 layers run the norm, the projection and the activation one after the other."""
        if self.quantized:
            normed, residual = (norm(x), x) if residual is None else norm(x, residual)
            y = self._matmul(normed, self.bias)
            return (y if activation is None else _GATED[activation](y)), residual
        return kernels.norm_linear(x, residual, norm.weight, norm.eps, self.weight, self.bias, self._next_weight(),
                                   self.leave_room, activation)

    def embedded_forward(self, input_ids: torch.Tensor, embed_weight: torch.Tensor, embed_scale: float | None,
                         norm: nn.Module):
        """normed_forward of embed_weight's rows for input_ids (times embed_scale where given),
        without a residual: the lookup fused into the projection's kernel in decode steps of one
        or two sequences (kernels.embed_norm_linear). For an embedding held whole by this rank."""
        if self.quantized:
            embedded = F.embedding(input_ids, embed_weight)
            return self.normed_forward(embedded if embed_scale is None else embedded * embed_scale, norm, None)
        return kernels.embed_norm_linear(input_ids, embed_weight, embed_scale, norm.weight, norm.eps, self.weight,
                                         self.bias, self.leave_room)


class RowParallelLinear(LinearBase):
    """Splits the input dimension; every rank's partial sums are all-reduced. The bias is added
    once, by rank 0."""
    reduce_results = True  # False: the caller all-reduces (a MoE layer's shared expert, with the experts')

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias, shard_dim=1)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "") -> None:
        self._copy(param, param, self._rank_part(loaded, 1 if param.dim() == 2 else None), name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None
        return self._all_reduced(self._matmul(x, bias))

    def activated_forward(self, x: torch.Tensor, activation: str) -> torch.Tensor:
        """This projection of act(x[..., :K]) * x[..., K:], the gated activation fused into the
        projection's kernel in decode steps of one or two sequences (kernels.act_linear)."""
        bias = self.bias if self.tp_rank == 0 else None
        if self.quantized:
            return self._all_reduced(self._matmul(_GATED[activation](x), bias))
        return self._all_reduced(kernels.act_linear(x, self.weight, bias, self._next_weight(), activation))

    def _all_reduced(self, y: torch.Tensor) -> torch.Tensor:
        return distributed.all_reduce(y) if self.tp_size > 1 and self.reduce_results else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one matrix (gate and up).
    Shard ids name the parts in order: 0, 1, ..."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def shard_offset_and_size(self, shard_id) -> tuple[int, int]:
        sizes = [s // self.tp_size for s in self.output_sizes]
        return sum(sizes[:shard_id]), sizes[shard_id]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "", shard_id=None) -> None:
        if shard_id is None:
            return super().weight_loader(param, loaded, name)
        offset, size = (n // self._block_rows(param) for n in self.shard_offset_and_size(shard_id))
        self._copy(param, param.data.narrow(0, offset, size), self._rank_part(loaded, 0), name)


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections in one matrix; shard ids 'q', 'k', 'v'."""
    leave_room = True  # the decode attention after it starts beside it

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        self.head_dim = head_dim
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], bias)

    def shard_offset_and_size(self, shard_id) -> tuple[int, int]:
        return super().shard_offset_and_size("qkv".index(shard_id))
