"""Llama 2, 3, 3.1 and 3.2: the plain decoder. Optional q/k/v/o biases (attention_bias) and
MLP biases (mlp_bias), head_dim from the config when it has one, rope scaling (llama3, linear,
dynamic) in the rotary table, tied embeddings where the config says so (3.2 1B and 3B)."""
from nanovllm.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """Every option from the config: nothing to add to the plain decoder."""
