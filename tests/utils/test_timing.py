"""nanovllm/utils/timing.py: benchmark_kernel's copies of the arguments (same layout, new
memory, aliasing kept); on a GPU, outputs that do not land on the previous call's memory, and
graph capture and the copy rate."""
import pytest
import torch

from nanovllm import kernels
from nanovllm.utils.timing import benchmark_kernel, capture, clone_arguments, device_copy_gbs


def test_views_of_one_buffer_stay_views_of_one_copy():
    packed = torch.randn(5, 7, 6)
    q, k, v = packed.split([3, 2, 2], dim=1)
    other = torch.randn(4, 3).t()
    (q2, k2, v2, other2, eps), kwargs = clone_arguments([q, k, v, other, 1e-6], {"w": other})
    assert eps == 1e-6
    storage = q2.untyped_storage().data_ptr()
    assert storage != packed.untyped_storage().data_ptr()
    assert k2.untyped_storage().data_ptr() == storage == v2.untyped_storage().data_ptr()
    for original, copy in ((q, q2), (k, k2), (v, v2), (other, other2), (other, kwargs["w"])):
        assert (copy.stride(), copy.storage_offset(), copy.dtype) == (original.stride(), original.storage_offset(),
                                                                     original.dtype)
        assert torch.equal(copy, original)
    assert kwargs["w"].untyped_storage().data_ptr() == other2.untyped_storage().data_ptr()


def test_a_copy_is_independent_of_its_original():
    x = torch.randn(9, 5)
    (copy,), _ = clone_arguments([x[:, 1:]])
    copy.fill_(float("nan"))
    assert not x.isnan().any()


def test_empty_tensors_on_two_devices_get_copies_of_their_own():
    (meta, cpu), _ = clone_arguments([torch.empty(0, device="meta"), torch.empty(0)])
    assert (meta.device.type, cpu.device.type) == ("meta", "cpu")


def test_cpu_timing_runs_warmup_and_timed_calls_on_the_arguments():
    calls = []
    ms = benchmark_kernel(lambda x: calls.append(x), torch.randn(64), warmup=2, iters=3)
    assert len(calls) == 5 and ms >= 0


@pytest.mark.gpu
def test_outputs_rotate_like_the_inputs():
    """A freed output's memory is what the next allocation gets: were results dropped, every
    timed call would write to the same (cached) addresses."""
    seen = []

    def fresh_output(x):
        out = x * 2
        seen.append(out.data_ptr())
        return out

    benchmark_kernel(fresh_output, torch.randn(1 << 20, device="cuda"), warmup=1, iters=2)
    # 4 MiB inputs: 32 copies, and the warm-up calls each once before anything is timed
    assert len(set(seen[:32])) == 32, "consecutive calls wrote to the same memory"


def test_benchmark_kernel_stays_importable_from_the_kernels_package():
    assert kernels.benchmark_kernel is benchmark_kernel
    assert "benchmark_kernel" not in kernels.__all__


def test_cpu_copy_rate_counts_read_and_written_bytes(monkeypatch):
    """Each copy takes 2 ms by the stubbed clock: 2 x 8 MiB moved in 2 ms."""
    clock = iter(range(0, 1000, 2))
    monkeypatch.setattr("nanovllm.utils.timing.time.perf_counter", lambda: next(clock) / 1e3)
    assert device_copy_gbs("cpu", 8 << 20) == pytest.approx(2 * (8 << 20) / 2e-3 / 1e9)


@pytest.mark.gpu
def test_a_captured_graph_replays_on_new_inputs():
    static_x = torch.zeros(1000, device="cuda")
    graph, out = capture(lambda: static_x * 2 + 1, calls=2)
    static_x.copy_(torch.arange(1000.0, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.arange(1000.0, device="cuda") * 2 + 1)
