"""The CUDA C++ sampler (sampling.cu): kernels/sampling.py's launches and buffers with CUDA
kernels in place of the Triton ones. Selected with NANOVLLM_SAMPLER=cuda."""
import torch

from nanovllm.kernels import cuda, sampling

_DECLARATIONS = """
#include <optional>
#include <torch/extension.h>
void scan(torch::Tensor logits, int64_t noise_block, torch::Tensor temperatures, torch::Tensor seeds,
          std::optional<torch::Tensor> top_ks, std::optional<torch::Tensor> top_ps,
          std::optional<torch::Tensor> min_ps, torch::Tensor best, torch::Tensor index, torch::Tensor maxima,
          torch::Tensor sums, torch::Tensor group_max, int64_t num_groups, bool logprobs, bool groups);
void min_p_draw(torch::Tensor logits, int64_t noise_block, torch::Tensor temperatures, torch::Tensor seeds,
                std::optional<torch::Tensor> top_ks, std::optional<torch::Tensor> top_ps, torch::Tensor min_ps,
                torch::Tensor best, torch::Tensor index, torch::Tensor maxima);
void finalize(torch::Tensor logits, int64_t noise_block, torch::Tensor temperatures, torch::Tensor seeds,
              std::optional<torch::Tensor> top_ks, std::optional<torch::Tensor> top_ps,
              std::optional<torch::Tensor> min_ps, torch::Tensor best, torch::Tensor index, torch::Tensor maxima,
              torch::Tensor sums, torch::Tensor group_max, int64_t num_groups, int64_t k_pad, torch::Tensor tokens,
              std::optional<torch::Tensor> logprobs);
"""


def module():
    return cuda.load("nanovllm_sampling", "sampling.cu", _DECLARATIONS, ("scan", "min_p_draw", "finalize"))


def _as(x, dtype):
    return None if x is None else x.to(dtype).contiguous()


class CudaLaunches(sampling.SampleLaunches):
    """The kernels take float32 temperatures / top_ps / min_ps and int64 seeds / top_ks."""

    def __init__(self, ext):
        self.ext = ext

    @staticmethod
    def _row_args(temperatures, seeds, filters):
        top_ks, top_ps, min_ps = filters
        return (_as(temperatures, torch.float32), _as(seeds, torch.int64), _as(top_ks, torch.int64),
                _as(top_ps, torch.float32), _as(min_ps, torch.float32))

    def scan(self, logits, temperatures, seeds, filters, buffers, logprobs: bool, groups: bool):
        self.ext.scan(logits, sampling.noise_block(logits.shape[1]), *self._row_args(temperatures, seeds, filters),
                      buffers["best"], buffers["index"], buffers["max"], buffers["sum"], buffers["group_max"],
                      buffers["groups"], logprobs, groups)

    def min_p_draw(self, logits, temperatures, seeds, filters, buffers):
        self.ext.min_p_draw(logits, sampling.noise_block(logits.shape[1]),
                            *self._row_args(temperatures, seeds, filters), buffers["best"], buffers["index"],
                            buffers["max"])

    def finalize(self, logits, temperatures, seeds, filters, buffers, tokens, logprobs, k_pad: int):
        self.ext.finalize(logits, sampling.noise_block(logits.shape[1]), *self._row_args(temperatures, seeds, filters),
                          buffers["best"], buffers["index"], buffers["max"], buffers["sum"], buffers["group_max"],
                          buffers["groups"], k_pad, tokens, logprobs)


def sampler():
    """kernels.sample's implementation on the CUDA kernels, or None where they cannot be built."""
    ext = module()
    if ext is None:
        return None
    launches = CudaLaunches(ext)

    def sample(logits, temperatures, seeds, top_ks=None, top_ps=None, min_ps=None, max_top_k=None, logprobs=False):
        if logits.dtype == torch.float64:  # the kernels read 16- and 32-bit floats
            logits = logits.float()
        return sampling.sample(logits, temperatures, seeds, top_ks, top_ps, min_ps, max_top_k, logprobs, launches)
    return sample
