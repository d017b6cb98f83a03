"""nanovllm: a small LLM inference engine on fused Triton kernels with PyTorch fallbacks.
Importing it never initialises CUDA."""
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams"]
