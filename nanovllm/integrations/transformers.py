"""Runs nanovllm's fused kernels inside an already-built Hugging Face transformers model.

    report = swap_layers(model)   # a Qwen3, Qwen3-MoE, Qwen2, Llama, Mistral or Gemma ...ForCausalLM
    print(report)
    restore_layers(model)         # back to the transformers code

Only the given instance changes: each swapped module gets its own `forward` in its instance
__dict__, which nn.Module.__call__ finds before the class's, so other models (even of the same
class) keep running the transformers code. Parameters stay the same objects holding the same
values; docs/hf_integration.md explains how gate_proj and up_proj come to share one storage."""
import inspect
import types
import typing
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gemma import modeling_gemma
from transformers.models.llama import modeling_llama
from transformers.models.mistral import modeling_mistral
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3 import modeling_qwen3
from transformers.models.qwen3_moe import modeling_qwen3_moe

from nanovllm.kernels import apply_rotary_emb, backend_for, fused_moe
from nanovllm.kernels import rms_norm as rms_norm_kernel
from nanovllm.layers.custom_mlp import resolve_activation

__all__ = ["SwapReport", "swap_layers", "restore_layers"]

# Class-name prefix -> the transformers module defining that family's layers.
_FAMILIES = {"Qwen3Moe": modeling_qwen3_moe, "Qwen3": modeling_qwen3, "Qwen2": modeling_qwen2, "Llama": modeling_llama,
             "Mistral": modeling_mistral, "Gemma": modeling_gemma}
# Instance attribute marking a swapped module; holds the _Swap that its forward reads.
_STATE = "_nanovllm_swap"


@dataclass(frozen=True)
class SwapReport:
    backend: str            # "triton" or "torch": what the kernels run on for the model's device
    modules: dict[str, str]  # qualified module name -> the kernel that now serves it

    def __str__(self) -> str:
        counts = Counter(self.modules.values())
        kernels_used = ", ".join(f"{count} x {kernel}" for kernel, count in sorted(counts.items()))
        return f"nanovllm swapped {len(self.modules)} modules ({kernels_used}) on the {self.backend} backend"


def swap_layers(model: nn.Module, rms_norm: bool = True, mlp: bool = True, rope: bool = True) -> SwapReport:
    """Routes the model's RMSNorms, gated MLPs (a mixture of experts' expert loop too) and
    rotary embeddings through nanovllm.kernels.
    Everything is checked before anything changes, so a ValueError leaves the model as it was.
    Modules already swapped are left alone, so a second call only adds what the first skipped."""
    prefix, modeling = _family(model)
    plan = []  # (layer class, its new forward, a maker of the per-module state)
    if rms_norm:
        norm_state = _Swap("rms_norm")
        norm_forward = _unit_offset_rms_norm_forward if prefix == "Gemma" else _rms_norm_forward
        plan.append((getattr(modeling, f"{prefix}RMSNorm"), norm_forward, lambda module: norm_state))
    if mlp:
        act_and_mul, kernel = _gated_activation(model.config.hidden_act)
        plan.append((getattr(modeling, f"{prefix}MLP"), _mlp_forward,
                     lambda module: _MergedGateUp(module, act_and_mul, kernel)))
        if hasattr(modeling, f"{prefix}Experts"):
            experts_state = _Experts(resolve_activation(model.config.hidden_act).name)
            plan.append((getattr(modeling, f"{prefix}Experts"), _experts_forward, lambda module: experts_state))
    if rope:
        attention_class = getattr(modeling, f"{prefix}Attention")
        table = _RopeTable(model.model.rotary_emb, model.config.max_position_embeddings,
                           modeling.eager_attention_forward, _cache_parameter(attention_class))
        plan.append((attention_class, _attention_forward, lambda module: table))
    for module in model.modules():
        for layer_class, forward, make_state in plan:
            if isinstance(module, layer_class) and not hasattr(module, _STATE):
                _install(module, forward, make_state(module))
    return _report(model)


def restore_layers(model: nn.Module) -> list[str]:
    """Puts every swapped module of `model` back on its transformers forward and gives merged
    parameters their own storage again. Returns the names restored (none for an unswapped model)."""
    restored = []
    for name, module in model.named_modules():
        if hasattr(module, _STATE):
            getattr(module, _STATE).restore(module)
            del module.forward
            delattr(module, _STATE)
            restored.append(name)
    return restored


def _family(model: nn.Module):
    for prefix, modeling in _FAMILIES.items():
        if isinstance(model, getattr(modeling, f"{prefix}ForCausalLM")):
            return prefix, modeling
    supported = ", ".join(f"{prefix}ForCausalLM" for prefix in _FAMILIES)
    raise ValueError(f"swap_layers supports {supported}; got {type(model).__name__}")


def _gated_activation(hidden_act: str):
    """transformers' gated MLPs apply hidden_act (Gemma's too, whatever hidden_activation says)."""
    return resolve_activation(hidden_act).fused, "silu_and_mul" if hidden_act == "silu" else "gelu_and_mul"


def _install(module: nn.Module, forward, state: "_Swap") -> None:
    setattr(module, _STATE, state)
    module.forward = types.MethodType(forward, module)


def _report(model: nn.Module) -> SwapReport:
    swapped = ((name, getattr(module, _STATE, None)) for name, module in model.named_modules())
    return SwapReport(backend=backend_for(model.device),
                      modules={name: state.kernel for name, state in swapped if state is not None})


def _autograd_needed(module: nn.Module, x: torch.Tensor) -> bool:
    """The kernels have no backward pass, and the merged gate/up matmul would not hand gradients
    to gate_proj and up_proj; so while autograd records, the transformers forward runs instead."""
    return torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in module.parameters()))


class _Swap:
    """What a swapped module's forward needs besides the module, and what restore must undo."""

    def __init__(self, kernel: str):
        self.kernel = kernel

    def restore(self, module: nn.Module) -> None:
        """Nothing beyond dropping the forward, unless a subclass changed the module's storage."""


def _rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    # Under autocast a bf16 activation meets an fp32 weight, which the kernel does not take.
    if hidden_states.dtype != self.weight.dtype or _autograd_needed(self, hidden_states):
        return type(self).forward(self, hidden_states)
    return rms_norm_kernel(hidden_states, self.weight, self.variance_epsilon)


def _unit_offset_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """Gemma's norm scales by 1 + weight, computed in fp32 as transformers does (the kernel takes an fp32 weight)."""
    if hidden_states.dtype != self.weight.dtype or _autograd_needed(self, hidden_states):
        return type(self).forward(self, hidden_states)
    return rms_norm_kernel(hidden_states, 1 + self.weight.float(), self.eps)


class _MergedGateUp(_Swap):
    """gate_proj and up_proj become views of one [2 * intermediate, hidden] tensor (same Parameter
    objects, `.data` re-pointed), so one matmul yields the [.., 2 * intermediate] input of the
    fused act-and-mul with no per-call copy."""

    def __init__(self, mlp: nn.Module, act_and_mul, kernel: str):
        super().__init__(kernel)
        self.act_and_mul = act_and_mul
        self._merge(mlp)

    def _merge(self, mlp: nn.Module) -> None:
        self.weight = _merge_into_views(mlp.gate_proj.weight, mlp.up_proj.weight)
        self.bias = None if mlp.gate_proj.bias is None else _merge_into_views(mlp.gate_proj.bias, mlp.up_proj.bias)

    def gate_up(self, mlp: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        # model.to() / .half() give each parameter fresh storage; merge again once when that happened.
        if not _views_of(self.weight, mlp.gate_proj.weight, mlp.up_proj.weight):
            self._merge(mlp)
        return self.weight, self.bias

    @torch.inference_mode(False)  # see _merge_into_views
    def restore(self, mlp: nn.Module) -> None:
        for param in (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.gate_proj.bias, mlp.up_proj.bias):
            if param is not None:
                param.data = param.data.clone()


# Parameter storage made under inference mode could never be saved for backward again, so the
# merge (also run from a forward inside generate) makes ordinary tensors even there.
@torch.inference_mode(False)
def _merge_into_views(first: nn.Parameter, second: nn.Parameter) -> torch.Tensor:
    merged = torch.cat((first.data, second.data))
    first.data, second.data = merged[: first.shape[0]], merged[first.shape[0]:]
    return merged


def _views_of(merged: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> bool:
    # The _MergedGateUp keeps `merged` alive, so no fresh storage can have taken its address.
    second_start = merged.data_ptr() + first.numel() * merged.element_size()
    return first.data_ptr() == merged.data_ptr() and second.data_ptr() == second_start


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    if _autograd_needed(self, x):
        return type(self).forward(self, x)
    swap = getattr(self, _STATE)
    weight, bias = swap.gate_up(self)
    return self.down_proj(swap.act_and_mul(F.linear(x, weight, bias)))


class _Experts(_Swap):
    """The stacked experts' gate_up_proj [E, 2I, H] (gate above up) and down_proj [E, H, I]
    are already fused_moe's operands: nothing to merge or restore."""

    def __init__(self, activation: str):
        super().__init__("fused_moe")
        self.activation = activation


def _experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts' loop as one grouped GEMM pair; the router's choice stays transformers'."""
    if hidden_states.dtype != self.gate_up_proj.dtype or _autograd_needed(self, hidden_states):
        return type(self).forward(self, hidden_states, top_k_index, top_k_weights)
    return fused_moe(hidden_states, self.gate_up_proj, self.down_proj, top_k_weights.float(), top_k_index.int(),
                     getattr(self, _STATE).activation)


def _cache_parameter(attention_class: type) -> str:
    """The name under which the attention's forward takes the KV cache, read from the parameter
    it types as a Cache: transformers renamed it (past_key_values, then cache), and a swapped
    forward that looked for the wrong name would drop the cache and decode from nothing."""
    for name, parameter in inspect.signature(attention_class.forward, eval_str=True).parameters.items():
        if parameter.annotation is Cache or Cache in typing.get_args(parameter.annotation):
            return name
    raise ValueError(f"rope: {attention_class.__name__}.forward has no parameter typed as a Cache; "
                     "call swap_layers(..., rope=False)")


class _RopeTable(_Swap):
    """cos|sin of every position up to max_position_embeddings, from the model's own rotary
    module (its inv_freq already carries linear/llama3/yarn scaling, and attention_scaling
    multiplies cos and sin as transformers does). One table serves all layers of a model, and
    carries the name of their forward's cache parameter."""

    def __init__(self, rotary: nn.Module, max_positions: int, eager_attention, cache_argument: str):
        if "dynamic" in rotary.rope_type or rotary.rope_type == "longrope":
            raise ValueError(f"rope: rope_type {rotary.rope_type!r} changes its frequencies with the sequence length, "
                             "which a precomputed table cannot follow; call swap_layers(..., rope=False)")
        super().__init__("apply_rotary_emb")
        self.rotary, self.max_positions, self.eager_attention = rotary, max_positions, eager_attention
        self.cache_argument = cache_argument
        self._tables: dict[torch.device, torch.Tensor] = {}

    def on(self, device: torch.device) -> torch.Tensor:
        """The [max_positions, head_dim] fp32 table on `device`, built on first use there."""
        if device not in self._tables:
            inv_freq = self.rotary.inv_freq.to(device=device, dtype=torch.float32)
            positions = torch.arange(self.max_positions, device=device, dtype=torch.float32)
            freqs = torch.outer(positions, inv_freq)
            self._tables[device] = torch.cat((freqs.cos(), freqs.sin()), dim=-1) * self.rotary.attention_scaling
        return self._tables[device]


def _attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
    """The transformers attention of Qwen3/Qwen2/Llama/Mistral/Gemma with the rotation done by the
    kernel, on the [batch * seq, heads, head_dim] layout the projections already produce (no
    transpose copy). The cache arrives in kwargs under the replaced forward's name for it; a Cache
    under any other name (a deprecated one) goes with the call to the transformers forward, which
    knows the name, rather than being dropped."""
    table = getattr(self, _STATE)
    position_ids = kwargs.get("position_ids")
    if (position_ids is None or _autograd_needed(self, hidden_states)
            or any(isinstance(value, Cache) for name, value in kwargs.items() if name != table.cache_argument)):
        return type(self).forward(self, hidden_states, position_embeddings=position_embeddings,
                                  attention_mask=attention_mask, **kwargs)
    cache = kwargs.pop(table.cache_argument, None)
    batch, seq = hidden_states.shape[:-1]
    query = self.q_proj(hidden_states).view(batch, seq, -1, self.head_dim)
    key = self.k_proj(hidden_states).view(batch, seq, -1, self.head_dim)
    value = self.v_proj(hidden_states).view(batch, seq, -1, self.head_dim).transpose(1, 2)
    if hasattr(self, "q_norm"):  # Qwen3 normalises each head before rotating it
        query, key = self.q_norm(query), self.k_norm(key)
    query, key = _rotate(self, position_ids, query, key)
    if cache is not None:
        key, value = cache.update(key, value, self.layer_idx)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, table.eager_attention)
    output, weights = attention(
        self, query, key, value, attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling,
        # Qwen3 sets a window per layer, Mistral one in its config for all
        sliding_window=getattr(self, "sliding_window", getattr(self.config, "sliding_window", None)), **kwargs)
    return self.o_proj(output.reshape(batch, seq, -1).contiguous()), weights


def _rotate(self, position_ids: torch.Tensor, query: torch.Tensor, key: torch.Tensor):
    """[batch, seq, heads, head_dim] in -> rotated [batch, heads, seq, head_dim] views out."""
    batch, seq, _, head_dim = query.shape
    # generate passes [batch, seq], a bare forward [1, seq]; the kernel reads positions densely
    positions = position_ids.expand(batch, seq).reshape(-1).contiguous()
    cos_sin_cache = getattr(self, _STATE).on(query.device)
    query, key = apply_rotary_emb(positions, query.reshape(batch * seq, -1, head_dim),
                                  key.reshape(batch * seq, -1, head_dim), cos_sin_cache)
    return (query.view(batch, seq, -1, head_dim).transpose(1, 2),
            key.view(batch, seq, -1, head_dim).transpose(1, 2))
