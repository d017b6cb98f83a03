"""nanovllm/kernels/launch.py: the direct launch and programmatic dependent launch. The direct
launch's cache key is computed here without a GPU, from the binder Triton generates for a
kernel; launches go to a stand-in kernel and driver."""
import inspect
import math
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from nanovllm import kernels
from nanovllm.kernels import launch
from nanovllm.utils.timing import capture

@triton.jit(do_not_specialize=["n"])
def _probe_kernel(x_ptr, n, m, eps, BLOCK: tl.constexpr):
    pass


def _binder(kernel=_probe_kernel):
    return create_function_from_signature(kernel.signature, kernel.params, make_backend(GPUTarget("cuda", 90, 32)))


def _key(*args, device=0, **kwargs):
    return launch.cache_key(_binder(), device, args, {"BLOCK": 64, "num_warps": 4, **kwargs})[0]


def test_a_pointer_off_16_byte_alignment_gets_its_own_key():
    buffer = torch.zeros(64, dtype=torch.bfloat16)
    aligned = _key(buffer[:16], 7, 32, 1e-6)
    assert _key(buffer[8:24], 7, 32, 1e-6) == aligned  # 16 bytes further: still aligned
    assert _key(buffer[1:17], 7, 32, 1e-6) != aligned
    assert _key(buffer[:16].half(), 7, 32, 1e-6) != aligned


def test_ints_are_keyed_on_divisibility_by_16_equality_to_1_and_width_unless_not_specialized():
    x = torch.zeros(16)
    keys = {m: _key(x, 7, m, 1e-6) for m in (16, 32, 17, 1, 2**31 + 16)}
    assert keys[16] == keys[32]
    assert len({keys[16], keys[17], keys[1], keys[2**31 + 16]}) == 4
    # n is in do_not_specialize: only its width counts
    assert _key(x, 1, 16, 1e-6) == _key(x, 16, 16, 1e-6) == _key(x, 17, 16, 1e-6) != _key(x, 2**31, 16, 1e-6)
    assert _key(x, 7, 16, 1e-6) == _key(x, 7, 16, 0.5)  # floats are never specialized


def test_constexprs_options_and_device_are_in_the_key():
    x = torch.zeros(16)
    key = _key(x, 7, 16, 1e-6)
    assert key != _key(x, 7, 16, 1e-6, BLOCK=128)
    assert key != _key(x, 7, 16, 1e-6, num_warps=8)
    assert key != _key(x, 7, 16, 1e-6, device=1)


def test_the_package_kernels_get_the_launcher_outside_the_interpreter():
    from nanovllm.kernels import activation, kv_cache, norm, rotary, sampling
    assert all(isinstance(kernel, launch.FastLauncher) for kernel in (
        activation._act_and_mul_kernel, activation._add_gelu_kernel, activation._mul_add_kernel,
        norm._rms_norm_kernel, rotary._rotary_kernel, kv_cache._store_kvcache_kernel, sampling._scan_kernel,
        sampling._min_p_draw_kernel, sampling._finalize_kernel))
    interpreted = object()
    assert launch.fast_launch(interpreted) is interpreted


def test_the_installed_triton_launches_as_the_fast_path_expects():
    """The direct launch and the occupancy padding switch off on a Triton whose launch path
    changed; this is where that shows, on every Triton that CI installs."""
    assert launch.changed_internals() == [], f"triton {triton.__version__}"
    assert launch.SUPPORTED


def _run_source_with(monkeypatch, old: str, new: str):
    source = inspect.getsource(JITFunction.run)
    assert old in source
    monkeypatch.setattr(inspect, "getsource", lambda fn: source.replace(old, new))


def test_a_changed_launch_path_is_noticed(monkeypatch):
    _run_source_with(monkeypatch, "kernel.packed_metadata, launch_metadata,",
                     "kernel.packed_metadata, launch_metadata, scratch,")
    assert len(launch.changed_internals()) == 1 and "kernel.run(" in launch.changed_internals()[0]


def test_a_new_option_from_the_knobs_is_noticed(monkeypatch):
    """An option run takes from triton.knobs would be missing from the direct launch's key."""
    _run_source_with(monkeypatch, '        kwargs["debug"]',
                     '        kwargs["sanitize"] = knobs.compilation.sanitize\n        kwargs["debug"]')
    assert launch.changed_internals() == ["run's option sanitize"]


def test_packed_metadata_in_another_layout_is_noticed(monkeypatch):
    backend = SimpleNamespace(pack_metadata=lambda m: (m.num_warps, m.num_ctas, m.shared, 0))
    monkeypatch.setattr(launch, "make_backend", lambda target: backend)
    assert launch.changed_internals() == ["packed_metadata as (num_warps, num_ctas, shared memory bytes)"]


@triton.jit
def _copy_row_kernel(x_ptr, out_ptr, n, row, rows, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    mask = (cols < n) & (row < rows)  # a scalar comparison joined to a block one
    tl.store(out_ptr + cols, tl.load(x_ptr + cols, mask=mask, other=-1.0), mask=mask)


@pytest.mark.triton_interpret
def test_a_mask_with_a_scalar_comparison_loads_and_stores_in_the_interpreter():
    x, out = torch.arange(8.0), torch.zeros(8)
    _copy_row_kernel[(1,)](x, out, 5, 0, 2, BLOCK=8)
    assert out.tolist() == [0, 1, 2, 3, 4, 0, 0, 0]
    _copy_row_kernel[(1,)](x + 1, out, 5, 2, 2, BLOCK=8)  # row out of range: nothing moves
    assert out.tolist() == [0, 1, 2, 3, 4, 0, 0, 0]


class _StandIn:
    """A JITFunction and its compiled kernel as far as FastLauncher uses them: the normal
    launch (kernel[grid]) and the direct one (compiled.run) are recorded."""

    def __init__(self):
        self.pre_run_hooks, self.device_caches = [], {0: (None, None, None, None, _binder())}
        self.normal, self.direct = [], []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.normal.append((grid, args, kwargs)) or self

    def run(self, *args):
        self.direct.append(args)

    function, packed_metadata = "function", (4, 1, 1024)  # num_warps, num_ctas, shared memory bytes


@pytest.fixture
def stand_in(monkeypatch):
    active = SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda device: 1234)
    monkeypatch.setattr(launch, "driver", SimpleNamespace(active=active))
    monkeypatch.setattr(launch, "enabled", True)
    kernel = _StandIn()
    return kernel, launch.FastLauncher(kernel)


def test_a_known_specialization_goes_straight_to_the_compiled_kernel(stand_in):
    kernel, launcher = stand_in
    buffer = torch.zeros(64)
    launcher[(3,)](buffer[:16], 7, 32, 1e-6, BLOCK=64, num_warps=4)
    assert len(kernel.normal) == 1 and not kernel.direct  # the first call compiles through Triton
    x = buffer[4:20]  # 16 bytes on: the same specialization
    launcher[(5, 2)](x, 9, 48, 0.5, BLOCK=64, num_warps=4)
    assert len(kernel.normal) == 1
    (args,) = kernel.direct  # grid padded to 3-D, the current stream, no hooks, the arguments in order
    assert args[:9] == (5, 2, 1, 1234, "function", (4, 1, 1024), None, None, None)
    assert args[9] is x and args[10:] == (9, 48, 0.5, 64)
    launcher[(3,)](buffer[1:17], 7, 32, 1e-6, BLOCK=64, num_warps=4)  # misaligned: a new specialization
    assert len(kernel.normal) == 2 and len(kernel.direct) == 1


def test_min_shared_memory_raises_the_direct_launch_s_shared_memory_only(stand_in, monkeypatch):
    """The padding reaches the compiled kernel's launch, never below its own need, and is not
    passed to Triton's path, which has no such option."""
    kernel, launcher = stand_in
    x = torch.zeros(16)
    launcher[(1,)](x, 7, 32, 1e-6, BLOCK=64, num_warps=4, min_shared_memory=40000)
    assert "min_shared_memory" not in kernel.normal[0][2]
    launcher[(1,)](x, 7, 32, 1e-6, BLOCK=64, num_warps=4, min_shared_memory=40000)
    launcher[(1,)](x, 7, 32, 1e-6, BLOCK=64, num_warps=4, min_shared_memory=512)
    launcher[(1,)](x, 7, 32, 1e-6, BLOCK=64, num_warps=4)
    assert [args[5] for args in kernel.direct] == [(4, 1, 40000), (4, 1, 1024), (4, 1, 1024)]
    monkeypatch.setattr(launch, "enabled", False)
    launcher[(1,)](x, 7, 32, 1e-6, BLOCK=64, num_warps=4, min_shared_memory=40000)
    assert "min_shared_memory" not in kernel.normal[-1][2]


def test_occupancy_cap_pads_to_a_share_of_the_sm(monkeypatch):
    """(programs + 1) paddings overfill an SM's shared memory, `programs` of them do not; none
    on the CPU or without PDL; at most the 48 KB a launch takes without an opt-in."""
    launch.occupancy_cap.cache_clear()
    assert launch.occupancy_cap(-1, 4) == {}
    monkeypatch.setattr(launch, "dependent_launch", lambda device: {"PDL": True, "launch_pdl": True})
    props = SimpleNamespace(shared_memory_per_multiprocessor=233472)  # H100 / H200
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    try:
        padding = launch.occupancy_cap(0, 4)["min_shared_memory"]
        assert 4 * padding <= 233472 < 5 * padding
        assert launch.occupancy_cap(0, 2)["min_shared_memory"] == 48 << 10
        monkeypatch.setattr(launch, "dependent_launch", lambda device: {"PDL": False, "launch_pdl": False})
        assert launch.occupancy_cap(1, 4) == {}
    finally:
        launch.occupancy_cap.cache_clear()


def test_hooks_debug_and_the_switch_keep_triton_s_own_path(stand_in, monkeypatch):
    kernel, launcher = stand_in
    x = torch.zeros(16)
    launcher[(1,)](x, 7, 32, 1e-6, BLOCK=64, num_warps=4)
    hook = lambda metadata: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        launcher[(1,)](x, 7, 32, 1e-6, BLOCK=64, num_warps=4)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    for knob, name, value in ((knobs.runtime, "debug", True), (knobs.compilation, "instrumentation_mode", "consan"),
                              (knobs.compilation, "fpsan_homomorphic_casts", True),  # Triton 3.9
                              (knobs.runtime, "add_stages_inspection_hook", lambda: ("key", "hash"))):
        with monkeypatch.context() as patch:
            patch.setattr(knob, name, value, raising=False)
            launcher[(1,)](x, 7, 32, 1e-6, BLOCK=64, num_warps=4)
    monkeypatch.setattr(launch, "enabled", False)
    launcher[(1,)](x, 7, 32, 1e-6, BLOCK=64, num_warps=4)
    assert len(kernel.normal) == 7 and not kernel.direct
    monkeypatch.setattr(launch, "enabled", True)
    launcher[(1,)](x, 7, 32, 1e-6, BLOCK=64, num_warps=4)
    assert len(kernel.direct) == 1


def _gpu_cases(offset: int) -> dict:
    """Each case makes the same inputs at every call (some ops write theirs), every tensor
    starting `offset` elements into its buffer, and returns the outputs."""

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(math.prod(shape) + offset, dtype=dtype, device="cuda")[offset:].view(shape)

    def seeded(fn):
        return lambda: (torch.manual_seed(0), fn())[1]

    def rotary():
        qkv = randn(3, 32 * 128).view(3, 32, 128)
        q, k = kernels.apply_rotary_emb(torch.arange(3, device="cuda"), qkv[:, :16], qkv[:, 16:24], randn(64, 128))
        return q, k

    def kv_store():
        kv = randn(3, 16, 128)
        k_cache, v_cache = randn(4, 16, 8, 128), randn(4, 16, 8, 128)
        kernels.store_kvcache(kv[:, :8], kv[:, 8:], k_cache, v_cache, torch.tensor([5, -1, 40], device="cuda"))
        return k_cache, v_cache

    cases = {
        "silu_and_mul": lambda: (kernels.silu_and_mul(randn(3, 2048)),),
        "gelu_and_mul": lambda: (kernels.gelu_and_mul(randn(3, 2048), "none"),),
        "fused_add_gelu": lambda: (kernels.fused_add_gelu(randn(3, 1024), randn(1024)),),
        "element_wise_mul_add": lambda: (kernels.element_wise_mul_add(randn(3, 1000), randn(3, 1000), randn(3, 1000)),),
        "rms_norm": lambda: (kernels.rms_norm(randn(3, 1024), randn(1024), 1e-6),),
        "rms_norm q/k view": lambda: (kernels.rms_norm(randn(3, 32, 128)[:, 8:24], randn(128), 1e-6),),
        "fused_add_rms_norm": lambda: kernels.fused_add_rms_norm(randn(3, 1024), randn(3, 1024), randn(1024), 1e-6),
        "apply_rotary_emb": rotary,
        "store_kvcache": kv_store,
        "sample": lambda: kernels.sample(randn(3, 5000), torch.tensor([0.0, 0.7, 1.0], device="cuda"),
                                         torch.arange(3, device="cuda"))[:1],
    }
    return {name: seeded(case) for name, case in cases.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "offset"])
def test_fast_launches_match_triton_s_own_bitwise(offset, monkeypatch):
    for name, case in _gpu_cases(offset).items():
        outputs = []
        for enabled in (False, True, True):  # a specialization's first fast-path call still goes through Triton
            monkeypatch.setattr(launch, "enabled", enabled)
            outputs.append(case())
        for out in outputs[1:]:
            assert all(torch.equal(a, b) for a, b in zip(outputs[0], out)), name


# Programmatic dependent launch (launch.dependent_launch, launch.await_previous_kernel).

def test_dependent_launch_is_off_on_the_cpu_in_the_interpreter_and_when_switched_off(monkeypatch):
    off = {"PDL": False, "launch_pdl": False}
    monkeypatch.setattr(launch, "_dependent_launch", {})
    assert launch.dependent_launch(-1) == off
    monkeypatch.setattr(launch, "INTERPRETER", True)  # CUDA tensors interpreted: no inline PTX
    assert launch.dependent_launch(0) == off  # no GPU is asked
    monkeypatch.setattr(launch, "_dependent_launch", {})
    monkeypatch.setattr(launch, "INTERPRETER", False)
    monkeypatch.setattr(launch, "dependent_launch_enabled", False)
    assert launch.dependent_launch(0) == off


def _dependent_chain(x, weights, ops=kernels):
    """Kernels that each read all of the one before's output, as a decoder layer's do. The
    second norm reads its rows in transposed order, so its first programs need rows that the
    first norm's last programs write: a read before the wait would see the previous replay's.
    The residual is copied first, so that no PyTorch kernel sits between two of the chain."""
    residual = x[:, : x.shape[1] // 2].clone()
    h = ops.rms_norm(x, weights[0], 1e-6)
    h = ops.rms_norm(h.view(64, 64, -1).transpose(0, 1), weights[0], 1e-6)
    h = ops.silu_and_mul(h.reshape(x.shape[0], -1))  # a view: the norm's output is contiguous
    h, residual = ops.fused_add_rms_norm(h, residual, weights[1], 1e-6)
    return ops.fused_add_gelu(h, residual[0], "tanh")


@pytest.mark.gpu
def test_dependent_launches_in_a_graph_see_their_predecessor_s_output(monkeypatch):
    """With PDL a kernel's programs are scheduled while the kernel before it still runs; had one
    read before await_previous_kernel's wait, it would see stale data. 32 MiB calls make that
    window wide. Replays on fresh inputs must equal, bit for bit, the chain without PDL."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9")
    assert launch.dependent_launch(torch.cuda.current_device())["launch_pdl"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen) for n in (4096, 2048)]
    static_x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    graph, static_out = capture(lambda: _dependent_chain(static_x, weights))
    inputs = [torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4)]
    replayed = []
    for x in inputs:
        static_x.copy_(x)
        graph.replay()
        replayed.append(static_out.clone())
    monkeypatch.setattr(launch, "_dependent_launch", {})
    monkeypatch.setattr(launch, "dependent_launch_enabled", False)
    for x, out in zip(inputs, replayed):
        assert torch.equal(out, _dependent_chain(x, weights))
