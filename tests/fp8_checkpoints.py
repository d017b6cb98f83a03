"""FP8 checkpoints in Hugging Face's layout (quantization_config with quant_method "fp8",
float8_e4m3fn weights, fp32 `weight_scale_inv` block multipliers), written from a tiny
checkpoint, and the float32 copy of what they dequantize to for the transformers reference."""
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from checkpoints import copy_checkpoint

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, multipliers): each block's largest magnitude maps to 448, e4m3's largest."""
    rows, cols = weight.shape
    scales = torch.empty(-(-rows // block[0]), -(-cols // block[1]))
    quantized = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            tile = (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
            scales[i, j] = weight[tile].abs().max() / 448.0
            quantized[tile] = (weight[tile] / scales[i, j]).to(torch.float8_e4m3fn)
    return quantized, scales


def dequantize_blocks(quantized: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    out = quantized.float()
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            out[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] *= scales[i, j]
    return out


def write_fp8_checkpoint(src: Path, fp8_dir: Path, dequantized_dir: Path, block: tuple[int, int]) -> None:
    """fp8_dir: src with every attention and MLP projection in FP8; dequantized_dir: src with
    those weights replaced by their dequantized values."""
    tensors = load_file(Path(src) / "model.safetensors")
    fp8, dequantized = dict(tensors), dict(tensors)
    for name, weight in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS:
            quantized, scales = quantize_blocks(weight, block)
            fp8[name], fp8[name + "_scale_inv"] = quantized, scales
            dequantized[name] = dequantize_blocks(quantized, scales, block)
    for folder, weights in ((fp8_dir, fp8), (dequantized_dir, dequantized)):
        copy_checkpoint(src, folder)
        save_file(weights, Path(folder) / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((Path(fp8_dir) / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (Path(fp8_dir) / "config.json").write_text(json.dumps(config, indent=2))
