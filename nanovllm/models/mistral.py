"""Mistral: Llama's layout with a sliding attention window (sliding_window keys, ending at the
query's own position; null in the config: plain causal attention). transformers' Mistral
config defaults the window to 4096 when a config.json leaves the field out."""
from nanovllm.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    hf_defaults = {"sliding_window": 4096}
