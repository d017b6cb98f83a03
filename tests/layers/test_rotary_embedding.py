"""The rotary table's inverse frequencies against transformers' own rope initialisation, for
every scaling type the engine implements, at the published Llama 3.1 and Llama 2 shapes."""
import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from nanovllm.layers.rotary_embedding import ROPE_SCALING_PARAMETERS, inverse_frequencies

SCALINGS = {
    "linear": dict(factor=4.0),
    "dynamic": dict(factor=2.0),
    "llama3": dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192),
}


@pytest.mark.parametrize("rope_type", SCALINGS)
@pytest.mark.parametrize("head_dim,theta,max_positions", [(128, 500_000.0, 131072), (64, 10_000.0, 4096)])
def test_inverse_frequencies_match_transformers(rope_type, head_dim, theta, max_positions):
    assert set(SCALINGS[rope_type]) == set(ROPE_SCALING_PARAMETERS[rope_type])
    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=max_positions,
                         rope_parameters={"rope_type": rope_type, "rope_theta": theta, **SCALINGS[rope_type]})
    # dynamic: the frequencies transformers uses for a sequence of max_position_embeddings
    # tokens, the longest the engine runs (for shorter ones it uses the same)
    expected, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=max_positions)
    actual = inverse_frequencies(head_dim, theta, {"rope_type": rope_type, **SCALINGS[rope_type]})
    assert attention_scaling == 1.0
    torch.testing.assert_close(actual.float(), expected, rtol=1e-6, atol=0)
    if rope_type != "dynamic":  # the scaling changes the table
        assert not torch.allclose(actual, inverse_frequencies(head_dim, theta))
