"""FP8 weights: a Hugging Face FP8 checkpoint (block scales) loads as it is and, on the CPU,
where the weights are dequantized, answers as transformers does on the dequantized float32
copy; quantization="fp8" quantizes a checkpoint at load with per-row scales and stays close to
the unquantized model; what is not supported is refused before the model is built."""
import json

import pytest
import torch

from checkpoints import build_checkpoint
from fp8_checkpoints import write_fp8_checkpoint
from models.conftest import GreedyReference, engine_logits

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK = (16, 16)


@pytest.fixture(scope="module")
def fp8_pair(tmp_path_factory):
    """(FP8 checkpoint, its dequantized float32 copy) of a tiny Llama with untied head and biases."""
    root = tmp_path_factory.mktemp("fp8")
    src = build_checkpoint(root / "src", arch="llama", tied=False, attention_bias=True)
    write_fp8_checkpoint(src, root / "fp8", root / "dequantized", BLOCK)
    return root / "fp8", root / "dequantized"


def test_fp8_checkpoint_matches_transformers_on_dequantized_copy(fp8_pair, new_llm, greedy, random_ids):
    fp8, dequantized = fp8_pair
    llm = new_llm(fp8)
    qkv = llm.model_runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight_scale_inv.shape == (128 // 16, 64 // 16)
    reference = GreedyReference(dequantized)
    prompts = [random_ids(10, seed) for seed in range(3)]
    outs = llm.generate(prompts, greedy(16), use_tqdm=False)
    assert [o["token_ids"] for o in outs] == [reference(p, 16) for p in prompts]


def test_quantization_fp8_stays_close_to_the_unquantized_model(new_llm, family_checkpoint, random_ids):
    path = family_checkpoint("llama2")
    ids = random_ids(24, 3)
    exact = engine_logits(new_llm(path), ids, [24])
    llm = new_llm(path, quantization="fp8")
    mlp = llm.model_runner.model.model.layers[1].mlp
    assert mlp.down_proj.weight.dtype == torch.float8_e4m3fn and mlp.down_proj.weight_scale_inv.shape == (64, 1)
    quantized = engine_logits(llm, ids, [24])
    error = (quantized - exact).norm() / exact.norm()
    # e4m3 keeps 3 mantissa bits: a rounding error of about 3.6% rms per weight, and as much per
    # projection; eight quantized projections in a row, in a random model that amplifies
    # differences, give about 11%. A wrong scale or row would give errors near 1.
    assert 0 < error < 0.2, error


def test_dummy_weights_quantize_at_load(new_llm, family_checkpoint, greedy):
    outs = new_llm(family_checkpoint("llama2"), load_format="dummy", quantization="fp8").generate(
        [[3, 4, 5]], greedy(4), use_tqdm=False)
    assert len(outs[0]["token_ids"]) == 4


def test_unsupported_quantization_is_refused_before_loading(tmp_path, fp8_pair, new_llm):
    with pytest.raises(ValueError, match="quantization: must be None or 'fp8', got 'int4'"):
        new_llm(fp8_pair[1], quantization="int4")
    config_path = fp8_pair[0] / "config.json"
    config = json.loads(config_path.read_text())
    for field, value, message in [("quant_method", "awq", "quantization_config.quant_method: 'awq' is not supported"),
                                  ("activation_scheme", "static", "quantization_config.activation_scheme: 'static'"),
                                  ("weight_block_size", [64, 16], "k_proj's 32 output features split over "
                                                                  "tensor_parallel_size 1 do not fill whole blocks of 64")]:
        folder = tmp_path / field
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**config, "quantization_config": {
            **config["quantization_config"], field: value}}))
        with pytest.raises(ValueError, match=message):
            new_llm(folder)


@pytest.mark.gpu
def test_fp8_checkpoint_on_gpu_with_cuda_graphs(tmp_path, family_checkpoint, random_ids):
    """The Triton GEMM and activation quantization inside captured decode graphs: the same
    tokens as eager steps, and logits near the dequantized bf16 copy's."""
    from nanovllm import LLM, SamplingParams
    write_fp8_checkpoint(family_checkpoint("llama2"), tmp_path / "fp8", tmp_path / "dequantized", (32, 32))
    engine = dict(device="cuda", dtype="bfloat16", max_model_len=256, kvcache_block_size=16, num_kvcache_blocks=64)
    prompts = [random_ids(10, seed) for seed in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ids = random_ids(40, 9)
    tokens, logits = {}, {}
    for name, path, eager in (("graphs", "fp8", False), ("eager", "fp8", True), ("bf16", "dequantized", True)):
        with LLM(str(tmp_path / path), enforce_eager=eager, **engine) as llm:
            tokens[name] = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
            logits[name] = engine_logits(llm, ids, [40]).float()
    assert tokens["graphs"] == tokens["eager"]
    assert (logits["eager"] - logits["bf16"]).norm() / logits["bf16"].norm() < 0.2
