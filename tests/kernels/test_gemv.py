"""small_batch_linear (nanovllm/kernels/gemv.py) against F.linear in float64, on each of its
paths (one or two rows: a program a few features of all of K; more: one program per feature
tile, or split-K with the last program reducing), kernels.linear's choice between it and
F.linear, and the norm, the embedding lookup and the gated activation fused into the row kernel
(norm_linear, embed_norm_linear, linear_act, act_linear).
Tolerances: kernel_testing.TOLERANCE."""
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import (FP32_INTERPRETER_AND_GPU, TARGETS, TOLERANCE, assert_close, capture_and_replay,
                            poison_allocator, randn, relative_error, require_triton, strided_rows, upcast)

from nanovllm import kernels
from nanovllm.kernels import dispatch, linear_ops, reference, small_batch_linear

# (rows, features N, input K, whether the launch rule splits K on a 132-SM GPU and in the
# interpreter (None: only on the GPU), with a bias)
SHAPES = [(1, 77, 300, True, True), (5, 130, 1000, True, False), (16, 600, 40, False, True),
          (3, 1030, 2047, None, False)]


def _gemv():
    from nanovllm.kernels import gemv  # imports Triton: only where the tests need it
    return gemv


def _device_index(device: str) -> int:
    return torch.cuda.current_device() if device == "cuda" else -1


def _check(x, weight, bias, dtype):
    poison_allocator(64 * weight.shape[0] * 4, x.device.type)  # room for the output and the partials
    out = small_batch_linear(x, weight, bias)
    assert out.is_contiguous()
    assert_close(out, reference.small_batch_linear(*upcast(x, weight), None if bias is None else bias.double()), dtype)


@pytest.mark.parametrize("device,dtype", TARGETS)
@pytest.mark.parametrize("rows,n,k,splits,with_bias", SHAPES)
def test_matches_float64(device, dtype, rows, n, k, splits, with_bias):
    require_triton(device)
    if splits is not None:
        config = _gemv().config_for(n, k, torch.tensor([], dtype=dtype).element_size(), _device_index(device))
        assert (config.splits > 1) == splits, config
    x, weight = randn(rows, k, dtype=dtype, device=device), randn(n, k, dtype=dtype, device=device)
    bias = randn(n, dtype=dtype, device=device) if with_bias else None
    _check(x, weight, bias, dtype)


@pytest.mark.parametrize("device,dtype", TARGETS)
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("n,k,with_bias", [(77, 300, True), (1030, 2047, False), (5, 8000, True)])
def test_few_rows_on_both_kernels(device, dtype, rows, n, k, with_bias, monkeypatch):
    """Up to ROW_MAX_ROWS rows go to the row kernel where a program's rows of the weight fit
    its budget (K = 8000 in fp32 does not: the split-K kernel takes it), and the split-K
    kernel gives the same result within tolerance."""
    require_triton(device)
    gemv = _gemv()
    x, weight = strided_rows(rows, k, dtype, device), randn(n, k, dtype=dtype, device=device)
    bias = randn(n, dtype=dtype, device=device) if with_bias else None
    block = gemv._row_block(x, n, k)
    assert (block is None) == (k * x.element_size() > gemv._ROW_PROGRAM_BYTES)
    _check(x, weight, bias, dtype)
    monkeypatch.setattr(gemv, "row_kernel_enabled", False)
    assert gemv._row_block(x, n, k) is None
    _check(x, weight, bias, dtype)


def test_row_programs_fill_the_gpu_before_growing():
    """A one-row program takes as many weight rows as its budget holds while the launch
    still has PROGRAMS_PER_SM programs an SM (132 SMs below), at least one row."""
    gemv = _gemv()
    assert gemv.row_config(4096, 1024, 2, -1) == (8, 1024)  # 4 SMs in the interpreter: the budget binds
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gemv, "_sm_count", lambda device_index: 132)
        for (n, k), block_n in (((4096, 1024), 8), ((1024, 2048), 2), ((1024, 3072), 2), ((100, 64), 1)):
            assert gemv.row_config.__wrapped__(n, k, 2, 0)[0] == block_n, (n, k)


@pytest.mark.parametrize("device,dtype", TARGETS)
def test_strided_and_offset_operands(device, dtype):
    """Rows further apart than K, leading dimensions, a transposed x (copied), weight rows of
    a wider buffer, a weight one element off its buffer's start, a strided bias."""
    require_triton(device)
    n, k = 130, 300
    weight, bias = randn(n, k, dtype=dtype, device=device), randn(n, dtype=dtype, device=device)
    for x in (strided_rows(3, k, dtype, device), randn(2, 3, k, dtype=dtype, device=device),
              randn(k, 4, dtype=dtype, device=device).t()):
        _check(x, weight, bias, dtype)
    x = randn(4, k, dtype=dtype, device=device)
    _check(x, strided_rows(n, k, dtype, device), bias, dtype)
    _check(x, randn(n * k + 1, dtype=dtype, device=device)[1:].view(n, k), bias, dtype)
    _check(x, weight, randn(n, 2, dtype=dtype, device=device)[:, 1], dtype)
    _check(x, randn(k, n, dtype=dtype, device=device).t(), None, dtype)
    _check(x[0], weight, bias, dtype)  # one row without a row dimension


@pytest.mark.parametrize("device,dtype", FP32_INTERPRETER_AND_GPU)
def test_every_k_block_its_own_split_and_counters_left_at_zero(device, dtype):
    """As many splits as K blocks (the most partials one reduction adds), twice in a row: a
    counter not set back to 0 would leave the second call's outputs unwritten (NaN)."""
    require_triton(device)
    gemv = _gemv()
    rows, n, k = 7, 150, 1000
    config = gemv.config_for(n, k, torch.tensor([], dtype=dtype).element_size(), _device_index(device),
                             programs_per_sm=4096)
    assert config.splits == -(-k // config.block_k) > 2
    x, weight, bias = (randn(rows, k, dtype=dtype, device=device), randn(n, k, dtype=dtype, device=device),
                       randn(n, dtype=dtype, device=device))
    expected = reference.small_batch_linear(*upcast(x, weight, bias))
    for _ in range(2):
        poison_allocator(rows * n * 4 * (config.splits + 1), device)
        out = torch.empty(rows, n, dtype=dtype, device=device)
        gemv.launch(x, weight, bias, out, config)
        assert_close(out, expected, dtype)
    assert not gemv._arrival_counters(torch.device(device)).any()


def test_leave_room_caps_row_grids_that_fit(monkeypatch):
    """norm_linear(leave_room=True) launches a row grid of at most _ROW_PROGRAMS_PER_SM_CAP
    programs an SM with launch.occupancy_cap's keywords; a larger grid, or no leave_room, runs
    as many an SM as fit."""
    gemv, launched = _gemv(), []

    class Spy:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append((grid, kwargs.get("min_shared_memory")))

    monkeypatch.setattr(gemv, "_gemv_row_kernel", Spy())
    monkeypatch.setattr(gemv, "occupancy_cap", lambda device, programs: {"min_shared_memory": programs})
    fits = gemv._ROW_PROGRAMS_PER_SM_CAP * gemv._sm_count(-1)
    x, norm = torch.zeros(1, 64), torch.ones(64)
    assert gemv.row_config(64 * fits, 64, 4, -1)[0] == 64  # a program 64 features
    for n, leave_room in ((64 * fits, True), (64 * fits + 1, True), (64 * fits, False)):
        gemv.norm_linear(x, None, norm, 1e-6, torch.zeros(n, 64), leave_room=leave_room)
    assert launched == [((fits,), gemv._ROW_PROGRAMS_PER_SM_CAP), ((fits + 1,), None), ((fits,), None)]


def test_qkv_leaves_room_for_the_attention(monkeypatch):
    """The qkv projection asks norm_linear to leave room for the decode attention after it;
    the MLP's gate_up does not."""
    from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
    asked = []
    monkeypatch.setattr(kernels, "norm_linear", lambda *args: asked.append(args[7]) or (args[0], args[0]))
    norm = torch.nn.RMSNorm(8, eps=1e-6)
    QKVParallelLinear(8, 4, 2, 1).normed_forward(torch.zeros(1, 8), norm, None)
    MergedColumnParallelLinear(8, [16, 16]).normed_forward(torch.zeros(1, 8), norm, None)
    assert asked == [True, False]


def test_short_programs_run_unpipelined():
    """Up to _UNPIPELINED_TILES weight tiles a program: one stage; longer runs: three."""
    gemv = _gemv()
    seen = set()
    for n, k, per_sm in ((1024, 2048, 64), (4096, 1024, 16), (1024, 2048, 2), (24576, 4096, 2)):
        config = gemv.config_for(n, k, 2, -1, programs_per_sm=per_sm)
        tiles = config.k_per_split // config.block_k
        assert config.num_stages == (1 if tiles <= gemv._UNPIPELINED_TILES else 3), (n, k, config)
        seen.add(config.num_stages)
    assert seen == {1, 3}
    assert gemv.config_for(4096, 1024, 2, -1, num_stages=2).num_stages == 2  # a sweep's choice stands


def test_split_count_is_bounded_by_the_unrolled_reduction():
    """However many programs would fit, a call splits K into at most _MAX_SPLITS runs, the
    partials the last program's unrolled reduction adds."""
    gemv = _gemv()
    config = gemv.config_for(150, 64 * 1000, 4, -1, programs_per_sm=4096)
    assert config.splits == gemv._MAX_SPLITS
    assert config.splits * config.k_per_split >= 64 * 1000


@pytest.mark.parametrize("device,dtype", FP32_INTERPRETER_AND_GPU)
def test_empty_operands(device, dtype):
    require_triton(device)
    weight, bias = randn(5, 8, dtype=dtype, device=device), randn(5, dtype=dtype, device=device)
    assert small_batch_linear(torch.empty(0, 8, dtype=dtype, device=device), weight, bias).shape == (0, 5)
    x = randn(3, 8, dtype=dtype, device=device)
    assert small_batch_linear(x, weight[:0], bias[:0]).shape == (3, 0)
    # K = 0: the product is empty and only the bias is left
    out = small_batch_linear(x[:, :0], weight[:, :0], bias)
    assert torch.equal(out, bias.expand(3, 5))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_qwen3_shapes_in_bf16(rows):
    """The Qwen3-0.6B projections (qkv, o, gate_up, down) and its 151,936-row LM head."""
    for n, k in ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)):
        x = randn(rows, k, dtype=torch.bfloat16, device="cuda")
        weight = randn(n, k, dtype=torch.bfloat16, device="cuda") * k ** -0.5
        _check(x, weight, None, torch.bfloat16)


@pytest.mark.gpu
def test_cuda_graph_capture():
    """Split, unsplit and one-row launches replayed from a graph, twice: the counters are reset
    inside it."""
    for rows, n in ((2, 1024), (2, 151936), (1, 151936)):
        x = randn(rows, 1024, dtype=torch.bfloat16, device="cuda")
        weight, bias = randn(n, 1024, dtype=torch.bfloat16, device="cuda"), randn(n, dtype=torch.bfloat16, device="cuda")
        expected = reference.small_batch_linear(*upcast(x, weight, bias))
        graph_out = capture_and_replay(lambda: small_batch_linear(x, weight, bias))
        assert_close(graph_out, expected, torch.bfloat16)
    assert not _gemv()._arrival_counters(torch.device("cuda")).any()


@pytest.mark.gpu
def test_prefetch_leaves_the_result_unchanged():
    """Reading the next projection's weight into L2 on the way: bit for bit the result without,
    eager and replayed from a graph, split and unsplit, with a next weight smaller than the
    grid (one line a program) and larger."""
    gemv = _gemv()
    for rows, n in ((3, 1024), (3, 4096), (1, 1024)):
        x = randn(rows, 1024, dtype=torch.bfloat16, device="cuda")
        weight = randn(n, 1024, dtype=torch.bfloat16, device="cuda")
        for following in (randn(7, dtype=torch.bfloat16, device="cuda"), randn(6144, 1024, dtype=torch.bfloat16,
                                                                                device="cuda")):
            assert gemv._prefetch_run(following, 64)[1] > 0
            expected = small_batch_linear(x, weight)
            assert torch.equal(small_batch_linear(x, weight, prefetch=following), expected)
            assert torch.equal(capture_and_replay(lambda: small_batch_linear(x, weight, prefetch=following)), expected)


def test_prefetch_shares_lines_among_programs_up_to_a_bound(monkeypatch):
    gemv = _gemv()
    monkeypatch.setattr(gemv, "INTERPRETER", False)
    assert gemv._prefetch_run(torch.empty(1000, dtype=torch.bfloat16), 4) == (16, 4)  # 2000 bytes: 16 lines
    assert gemv._prefetch_run(torch.empty(3 * 128, dtype=torch.uint8), 2) == (3, 2)
    assert gemv._prefetch_run(None, 4) == (0, 0)
    assert gemv._prefetch_run(torch.empty(0), 4) == (0, 0)
    large = torch.empty(1 << 20, dtype=torch.bfloat16)  # 2 MB over 2 programs: shares past _MAX_PREFETCH_LINES
    assert gemv._prefetch_run(large, 2) == (0, 0)
    assert gemv._prefetch_run(large, 64)[0] == (2 << 20) // 128
    too_large = torch.empty(gemv._MAX_PREFETCH_BYTES + 128, dtype=torch.uint8)  # more than the L2 can keep aside
    assert gemv._prefetch_run(too_large, 1 << 20) == (0, 0)
    monkeypatch.setattr(gemv, "prefetch_enabled", False)
    assert gemv._prefetch_run(torch.empty(1000, dtype=torch.bfloat16), 4) == (0, 0)
    monkeypatch.setattr(gemv, "prefetch_enabled", True)
    monkeypatch.setattr(gemv, "INTERPRETER", True)  # no inline PTX there
    assert gemv._prefetch_run(torch.empty(1000, dtype=torch.bfloat16), 4) == (0, 0)


def test_decoder_projections_read_ahead_in_decode_order():
    """Each projection's following one is the next a decode step runs; the chain adds no
    parameters or submodules."""
    from nanovllm.models import model_config_from_dir
    from nanovllm.models.qwen3 import Qwen3ForCausalLM
    config = model_config_from_dir(str(Path(kernels.__file__).parents[1] / "configs" / "qwen3-tiny"))
    model = Qwen3ForCausalLM(config)
    order = [p for layer in model.model.layers for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                          layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    assert [p.following for p in order] == order[1:] + [None]
    assert len(dict(model.named_parameters())) == len(list(model.parameters()))
    assert not any("following" in name for name, _ in model.named_modules())
    assert not any("following" in name for name in model.state_dict())


def test_the_boundary_and_the_kernel_agree_on_the_row_limits():
    assert kernels.GEMV_MAX_ROWS == _gemv().MAX_ROWS
    assert kernels.GEMV_ROW_MAX_ROWS == _gemv().ROW_MAX_ROWS


def test_linear_keeps_f_linear_on_the_cpu():
    """Where no GEMV runs, kernels.linear is F.linear itself, bit for bit."""
    x, weight, bias = torch.randn(3, 20), torch.randn(7, 20), torch.randn(7)
    assert torch.equal(kernels.linear(x, weight, bias), F.linear(x, weight, bias))
    assert torch.equal(kernels.linear(x, weight), F.linear(x, weight))


@pytest.mark.gpu
def test_linear_routes_small_batches_to_the_gemv(monkeypatch):
    calls = []

    def recording(x, weight, bias=None, prefetch=None):
        calls.append(x.shape[0])
        return small_batch_linear(x, weight, bias, prefetch)

    monkeypatch.setattr(linear_ops, "small_batch_linear", recording)
    monkeypatch.setattr(dispatch, "gemv_enabled", True)
    weight = randn(64, 32, dtype=torch.bfloat16, device="cuda")
    for rows in (1, 16, 17):
        kernels.linear(randn(rows, 32, dtype=torch.bfloat16, device="cuda"), weight)
    assert calls == [1, 16]
    monkeypatch.setattr(dispatch, "gemv_enabled", False)
    kernels.linear(randn(1, 32, dtype=torch.bfloat16, device="cuda"), weight)
    assert calls == [1, 16]


@pytest.mark.parametrize("call,name", [
    (lambda: small_batch_linear(torch.arange(8).view(1, 8), torch.randn(3, 8)), "x"),
    (lambda: small_batch_linear(torch.randn(1, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)), "x"),
    (lambda: small_batch_linear(torch.randn(17, 8), torch.randn(3, 8)), "x"),
    (lambda: small_batch_linear(torch.randn(3, 6, 8), torch.randn(3, 8)), "x"),
    (lambda: small_batch_linear(torch.randn(1, 8), torch.randn(3, 7)), "weight"),
    (lambda: small_batch_linear(torch.randn(1, 8), torch.randn(3, 8, dtype=torch.float16)), "weight"),
    (lambda: small_batch_linear(torch.randn(1, 8), torch.randn(8)), "weight"),
    (lambda: small_batch_linear(torch.randn(1, 8), torch.randn(3, 8), torch.randn(4)), "bias"),
    (lambda: small_batch_linear(torch.randn(1, 8), torch.randn(3, 8), torch.randn(3, dtype=torch.float16)), "bias"),
    (lambda: small_batch_linear(torch.randn(1, 8), torch.randn(3, 8), prefetch=torch.randn(4, 6).t()), "prefetch"),
    (lambda: small_batch_linear(torch.randn(1, 8), torch.randn(3, 8), prefetch=torch.randn(4, device="meta")),
     "prefetch"),
])
def test_bad_arguments_name_the_argument(call, name):
    with pytest.raises(ValueError, match=rf"^{name}:"):
        call()


# --- the norm and the activation before a one-row projection: norm_linear, act_linear ------------
def _norm_linear_case(n, k, dtype, device, with_residual, fp32_norm, rows=1):
    x = randn(rows, k, dtype=dtype, device=device)
    residual = randn(rows, k, dtype=dtype, device=device) if with_residual else None
    norm_weight = torch.rand(k, device=device, dtype=torch.float32 if fp32_norm else dtype) + 0.5
    weight = randn(n, k, dtype=dtype, device=device) * k ** -0.5
    return x, residual, norm_weight, weight, randn(n, dtype=dtype, device=device)


@pytest.mark.parametrize("device,dtype", TARGETS)
@pytest.mark.parametrize("rows,n,k", [(1, 77, 300), (1, 1030, 1000), (2, 77, 300)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_linear_in_the_row_kernel(device, dtype, rows, n, k, with_residual):
    """One launch: the residual add, RMSNorm (weight in x's dtype and in fp32, as Gemma's) and
    the projection; the sum comes back as the new residual and x is left as it was."""
    require_triton(device)
    for fp32_norm in (False, True):
        x, residual, norm_weight, weight, bias = _norm_linear_case(n, k, dtype, device, with_residual, fp32_norm,
                                                                   rows)
        x_before = x.clone()
        out, new_residual = _gemv().norm_linear(x, residual, norm_weight, 1e-6, weight, bias)
        expected, expected_residual = reference.norm_linear(
            x.double(), None if residual is None else residual.double(), norm_weight.double(), 1e-6,
            weight.double(), bias.double())
        assert_close(out, expected, dtype)
        assert_close(new_residual, expected_residual, dtype)
        assert torch.equal(x, x_before)
        if residual is None:
            assert new_residual is x


def _embed_case(vocab, n, k, dtype, device):
    table = randn(vocab, k, dtype=dtype, device=device)
    norm_weight = torch.rand(k, device=device, dtype=dtype) + 0.5
    weight = randn(n, k, dtype=dtype, device=device) * k ** -0.5
    return table, norm_weight, weight, randn(n, dtype=dtype, device=device)


@pytest.mark.parametrize("device,dtype", TARGETS)
@pytest.mark.parametrize("ids", [[40], [0, 40], [7, 7]])
@pytest.mark.parametrize("embed_scale", [None, 17.875])
def test_embed_norm_linear_in_the_row_kernel(device, dtype, ids, embed_scale):
    """One launch: each id's embedding row (scaled and rounded, as Gemma's), its RMSNorm and
    the projection; the looked-up rows come back as the residual, rounded exactly as the
    unfused lookup and scaling round them."""
    require_triton(device)
    n, k = 130, 300
    table, norm_weight, weight, bias = _embed_case(41, n, k, dtype, device)
    input_ids = torch.tensor(ids, device=device)
    out, embedded = _gemv().embed_norm_linear(input_ids, table, embed_scale, norm_weight, 1e-6, weight, bias)
    expected, expected_embedded = reference.embed_norm_linear(input_ids, table.double(), embed_scale,
                                                              norm_weight.double(), 1e-6, weight.double(), bias.double())
    assert_close(out, expected, dtype)
    assert_close(embedded, expected_embedded, dtype)
    if device == "cuda" or dtype == torch.float32:  # the interpreter rounds to bf16 its own way
        unfused = F.embedding(input_ids, table)
        assert torch.equal(embedded, unfused if embed_scale is None else unfused * embed_scale)


@pytest.mark.parametrize("device,dtype", FP32_INTERPRETER_AND_GPU)
def test_embed_norm_linear_declines_and_falls_back(device, dtype):
    """Three ids or none: the kernel declines and the boundary looks the rows up, then runs
    norm_linear; the result is the reference's either way."""
    require_triton(device)
    table, norm_weight, weight, bias = _embed_case(41, 40, 96, dtype, device)
    for ids in ([3, 40, 0], []):
        input_ids = torch.tensor(ids, dtype=torch.long, device=device)
        assert _gemv().embed_norm_linear(input_ids, table, 2.0, norm_weight, 1e-6, weight, bias) is None
        out, embedded = kernels.embed_norm_linear(input_ids, table, 2.0, norm_weight, 1e-6, weight, bias)
        expected, expected_embedded = reference.embed_norm_linear(input_ids, table.double(), 2.0, norm_weight.double(),
                                                                  1e-6, weight.double(), bias.double())
        assert out.shape == (len(ids), 40) and embedded.shape == (len(ids), 96)
        if ids:
            assert_close(out, expected, dtype)
            assert_close(embedded, expected_embedded, dtype)


@pytest.mark.parametrize("call,name", [
    (lambda: kernels.embed_norm_linear(torch.tensor([1], dtype=torch.int32), torch.randn(9, 8), None, torch.ones(8),
                                       1e-6, torch.randn(3, 8)), "input_ids"),
    (lambda: kernels.embed_norm_linear(torch.tensor([[1]]), torch.randn(9, 8), None, torch.ones(8), 1e-6,
                                       torch.randn(3, 8)), "input_ids"),
    (lambda: kernels.embed_norm_linear(torch.tensor([1]), torch.randn(9), None, torch.ones(9), 1e-6,
                                       torch.randn(3, 9)), "embed_weight"),
    (lambda: kernels.embed_norm_linear(torch.tensor([1]), torch.randn(9, 8), torch.tensor(2.0), torch.ones(8), 1e-6,
                                       torch.randn(3, 8)), "embed_scale"),
    (lambda: kernels.embed_norm_linear(torch.tensor([1]), torch.randn(9, 8), None, torch.ones(7), 1e-6,
                                       torch.randn(3, 8)), "norm_weight"),
    (lambda: kernels.embed_norm_linear(torch.tensor([1]), torch.randn(9, 8), None, torch.ones(8), 1e-6,
                                       torch.randn(3, 7)), "weight"),
    (lambda: kernels.embed_norm_linear(torch.tensor([1]), torch.randn(9, 8), None, torch.ones(8), 1e-6,
                                       torch.randn(3, 8), torch.randn(4)), "bias"),
])
def test_embed_norm_linear_bad_arguments_name_the_argument(call, name):
    with pytest.raises(ValueError, match=rf"^{name}:"):
        call()


@pytest.mark.parametrize("device,dtype", FP32_INTERPRETER_AND_GPU)
def test_fused_prologues_take_strided_and_empty_operands(device, dtype):
    """A transposed weight, a strided bias and norm weight (copied), a row of a wider buffer,
    with and without the gated epilogue; no features or no rows: an empty result, from the
    unfused path."""
    require_triton(device)
    gemv = _gemv()
    k, n = 96, 40
    x, residual = strided_rows(1, k, dtype, device), randn(1, k, dtype=dtype, device=device)
    norm_weight = torch.rand(k, dtype=dtype, device=device) + 0.5
    weight, bias = randn(k, n, dtype=dtype, device=device).t(), randn(2 * n, dtype=dtype, device=device)[::2]
    norm_weight = (torch.rand(2 * k, dtype=dtype, device=device) + 0.5)[::2]  # a strided norm weight too
    out, _ = gemv.norm_linear(x, residual, norm_weight, 1e-6, weight, bias)
    expected, _ = reference.norm_linear(x.double(), residual.double(), norm_weight.double(), 1e-6, weight.double(),
                                        bias.double())
    assert_close(out, expected, dtype)
    gated = strided_rows(1, 2 * k, dtype, device)
    assert_close(gemv.act_linear(gated, weight, bias),
                 reference.act_linear(gated.double(), weight.double(), bias.double()), dtype)
    gate_up = randn(k, 2 * n, dtype=dtype, device=device).t()  # a gated weight, transposed
    gate_up_bias = randn(4 * n, dtype=dtype, device=device)[::2]
    projected, _ = reference.norm_linear(x.double(), residual.double(), norm_weight.double(), 1e-6,
                                         gate_up.double(), gate_up_bias.double())
    out, _ = gemv.norm_linear(x, residual, norm_weight, 1e-6, gate_up, gate_up_bias, activation="silu")
    assert_close(out, reference.silu_and_mul(projected.to(dtype).double()), dtype)
    projected = reference.small_batch_linear(x.double(), gate_up.double(), gate_up_bias.double())
    assert_close(gemv.linear_act(x, gate_up, gate_up_bias), reference.silu_and_mul(projected.to(dtype).double()),
                 dtype)
    assert gemv.norm_linear(x, residual, norm_weight, 1e-6, weight[:0], bias[:0]) is None
    assert gemv.linear_act(x[:0], gate_up, gate_up_bias) is None
    assert gemv.act_linear(gated[:0], weight, bias) is None
    empty, _ = kernels.norm_linear(x[:0], None, norm_weight, 1e-6, weight, bias)
    assert empty.shape == (0, n)


@pytest.mark.parametrize("device,dtype", TARGETS)
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("rows", [1, 2])
def test_act_linear_in_the_row_kernel(device, dtype, activation, rows):
    require_triton(device)
    n, k = 130, 1000
    x = randn(rows, 2 * k, dtype=dtype, device=device)
    weight, bias = randn(n, k, dtype=dtype, device=device) * k ** -0.5, randn(n, dtype=dtype, device=device)
    out = _gemv().act_linear(x, weight, bias, None, activation)
    assert_close(out, reference.act_linear(x.double(), weight.double(), bias.double(), None, activation), dtype)


@pytest.mark.parametrize("device,dtype", TARGETS)
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("rows,n,k", [(1, 77, 300), (1, 301, 300), (2, 531, 256)])
def test_gated_epilogue_in_the_row_kernel(device, dtype, activation, rows, n, k):
    """gate_up [2N, K] with its activation: after a norm (norm_linear(activation=...), with and
    without a residual) and on its own input (linear_act); N not a multiple of a program's
    features, and a bias whose up half differs from its gate half. Tolerance TOLERANCE[dtype],
    but 2e-2 for bf16 on the interpreter, which rounds to bf16 by truncation, three times here
    (gate, up, the output)."""
    require_triton(device)
    gemv = _gemv()
    tolerance = 2e-2 if device == "cpu" and dtype == torch.bfloat16 else TOLERANCE[dtype]

    def assert_gated_close(out, expected):
        assert out.dtype == dtype and out.shape == expected.shape
        assert relative_error(out, expected) <= tolerance

    def gated(projected):  # float64, gate and up rounded to dtype as the kernel (and the unfused path) store them
        return reference.linear_act(projected.to(dtype).double(), torch.eye(2 * n, dtype=torch.float64,
                                                                                device=device), None, None, activation)

    for with_residual in (False, True):
        x, residual, norm_weight, weight, bias = _norm_linear_case(2 * n, k, dtype, device, with_residual, False,
                                                                   rows)
        out, new_residual = gemv.norm_linear(x, residual, norm_weight, 1e-6, weight, bias, activation=activation)
        projected, expected_residual = reference.norm_linear(
            x.double(), None if residual is None else residual.double(), norm_weight.double(), 1e-6,
            weight.double(), bias.double())
        assert out.shape == (rows, n)
        assert_gated_close(out, gated(projected))
        assert_close(new_residual, expected_residual, dtype)
    out = gemv.linear_act(x, weight, bias, None, activation)
    assert_gated_close(out, gated(reference.small_batch_linear(x.double(), weight.double(), bias.double())))


def test_the_gated_epilogue_needs_two_weight_rows_a_program(monkeypatch):
    """A program holds a feature's gate and up rows: where two weight rows exceed a program's
    budget, the kernel declines; where the launch rule gives one row a program (few features
    on many SMs), it takes two."""
    gemv = _gemv()
    assert gemv._gated_block((1, 64), 2) == (2, 64) and gemv._gated_block((8, 64), 2) == (8, 64)
    monkeypatch.setattr(gemv, "row_config", lambda n, k, element_size, device_index:
                        (1, gemv._ROW_PROGRAM_BYTES // element_size))
    x, _, norm_weight, weight, bias = _norm_linear_case(8, 16, torch.float32, "cpu", False, False)
    assert gemv.norm_linear(x, None, norm_weight, 1e-6, weight, bias, activation="silu") is None
    assert gemv.linear_act(x, weight, bias) is None


def test_the_row_kernel_declines_what_it_does_not_serve():
    """More than ROW_MAX_ROWS rows, or a weight row over a program's budget: None, and the
    boundary runs the unfused kernels instead."""
    gemv = _gemv()
    x, residual, norm_weight, weight, bias = _norm_linear_case(5, 8, torch.float32, "cpu", True, False)
    too_many = gemv.ROW_MAX_ROWS + 1
    assert gemv.norm_linear(x.expand(too_many, 8), None, norm_weight, 1e-6, weight, bias) is None
    assert gemv.act_linear(torch.randn(too_many, 16), weight, bias) is None
    long_row = torch.randn(1, 2 * (gemv._ROW_PROGRAM_BYTES // 4 + 1))
    assert gemv.act_linear(long_row, torch.randn(3, long_row.shape[1] // 2)) is None


@pytest.mark.triton_interpret
def test_fused_prologues_bound_the_input_their_programs_re_read(monkeypatch):
    """Every program of a fused call reads the whole input row: past _MAX_PROLOGUE_BYTES
    between them the separate kernel is cheaper, and the call declines."""
    require_triton("cpu")
    gemv = _gemv()
    x, residual, norm_weight, weight, bias = _norm_linear_case(64, 256, torch.float32, "cpu", True, False)
    programs = -(-64 // gemv.row_config(64, 256, 4, -1)[0])
    monkeypatch.setattr(gemv, "_MAX_PROLOGUE_BYTES", programs * 256 * 4 * 2)  # the sum's two rows, just fit
    assert gemv.norm_linear(x, residual, norm_weight, 1e-6, weight, bias) is not None
    assert gemv.act_linear(torch.randn(1, 512), weight, bias) is not None
    monkeypatch.setattr(gemv, "_MAX_PROLOGUE_BYTES", programs * 256 * 4 * 2 - 1)
    assert gemv.norm_linear(x, residual, norm_weight, 1e-6, weight, bias) is None
    assert gemv.act_linear(torch.randn(1, 512), weight, bias) is None
    assert gemv.norm_linear(x, None, norm_weight, 1e-6, weight, bias) is not None  # one row without a residual


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
def test_unfused_path_matches_the_reference(activation):
    """On the CPU (and for several rows anywhere) the boundary runs the norm or activation
    kernel and then linear()."""
    x, residual, norm_weight, weight, bias = _norm_linear_case(9, 16, torch.float32, "cpu", True, True)
    x = x.expand(3, 16).contiguous()
    residual = residual.expand(3, 16).contiguous()
    expected = reference.norm_linear(x.double(), residual.double(), norm_weight.double(), 1e-6, weight.double(),
                                     bias.double())
    out, new_residual = kernels.norm_linear(x.clone(), residual.clone(), norm_weight, 1e-6, weight, bias)
    assert_close(out, expected[0], torch.float32)
    assert_close(new_residual, expected[1], torch.float32)
    gate_up, gate_up_bias = weight[:8], bias[:8]
    expected = reference.norm_linear(x.double(), residual.double(), norm_weight.double(), 1e-6, gate_up.double(),
                                     gate_up_bias.double(), activation=activation)
    out, new_residual = kernels.norm_linear(x.clone(), residual.clone(), norm_weight, 1e-6, gate_up, gate_up_bias,
                                            activation=activation)
    assert out.shape == (3, 4)
    assert_close(out, expected[0], torch.float32)
    assert_close(new_residual, expected[1], torch.float32)
    gated = torch.randn(3, 32)
    assert_close(kernels.act_linear(gated, weight, bias, activation=activation),
                 reference.act_linear(gated.double(), weight.double(), bias.double(), None, activation), torch.float32)


@pytest.mark.gpu
def test_norm_and_act_linear_in_a_cuda_graph():
    """The decoder's batch-1 path through the boundary, replayed from a graph: qkv, down on its
    gated input, gate_up with its activation."""
    x, residual, norm_weight, weight, bias = _norm_linear_case(4096, 1024, torch.bfloat16, "cuda", True, False)
    expected = reference.norm_linear(x.double(), residual.double(), norm_weight.double(), 1e-6, weight.double(),
                                     bias.double())
    out = capture_and_replay(lambda: kernels.norm_linear(x, residual, norm_weight, 1e-6, weight, bias)[0])
    assert_close(out, expected[0], torch.bfloat16)
    gated, down = randn(1, 6144, dtype=torch.bfloat16, device="cuda"), randn(1024, 3072, dtype=torch.bfloat16,
                                                                              device="cuda") * 3072 ** -0.5
    out = capture_and_replay(lambda: kernels.act_linear(gated, down))
    assert_close(out, reference.act_linear(gated.double(), down.double()), torch.bfloat16)
    gate_up = randn(6144, 1024, dtype=torch.bfloat16, device="cuda") * 1024 ** -0.5
    out = capture_and_replay(lambda: kernels.norm_linear(x, residual, norm_weight, 1e-6, gate_up, activation="silu")[0])
    expected = reference.norm_linear(x.double(), residual.double(), norm_weight.double(), 1e-6, gate_up.double(),
                                     activation="silu")
    assert_close(out, expected[0], torch.bfloat16)


@pytest.mark.parametrize("call,name", [
    (lambda: kernels.norm_linear(torch.randn(1, 8), None, torch.randn(7), 1e-6, torch.randn(3, 8)), "norm_weight"),
    (lambda: kernels.norm_linear(torch.randn(1, 8), torch.randn(1, 7), torch.randn(8), 1e-6, torch.randn(3, 8)),
     "residual"),
    (lambda: kernels.norm_linear(torch.randn(1, 8), None, torch.randn(8), 1e-6, torch.randn(3, 7)), "weight"),
    (lambda: kernels.act_linear(torch.randn(1, 8), torch.randn(3, 8)), "weight"),
    (lambda: kernels.act_linear(torch.randn(1, 7), torch.randn(3, 3)), "x"),
    (lambda: kernels.act_linear(torch.randn(1, 8), torch.randn(3, 4), activation="relu"), "activation"),
    (lambda: kernels.linear_act(torch.randn(1, 8), torch.randn(3, 8)), "weight"),
    (lambda: kernels.linear_act(torch.randn(1, 8), torch.randn(4, 8), activation="relu"), "activation"),
    (lambda: kernels.linear_act(torch.randn(1, 8), torch.randn(4, 7)), "weight"),
    (lambda: kernels.norm_linear(torch.randn(1, 8), None, torch.randn(8), 1e-6, torch.randn(3, 8),
                                 activation="silu"), "weight"),
    (lambda: kernels.norm_linear(torch.randn(1, 8), None, torch.randn(8), 1e-6, torch.randn(4, 8),
                                 activation="tanh"), "activation"),
    (lambda: kernels.norm_linear(torch.randn(3, 8), torch.randn(3, 8), torch.randn(8), 1e-6, torch.randn(5, 8),
                                 torch.randn(4)), "bias"),
    (lambda: kernels.act_linear(torch.randn(3, 8), torch.randn(5, 4), torch.randn(5, dtype=torch.float16)), "bias"),
    (lambda: kernels.norm_linear(torch.randn(3, 8), None, torch.randn(8), 1e-6, torch.randn(5, 8),
                                 prefetch=torch.randn(4, 6).t()), "prefetch"),
])
def test_fused_boundaries_name_the_bad_argument(call, name):
    with pytest.raises(ValueError, match=rf"^{name}:"):
        call()


def test_fused_boundaries_check_before_the_norm_consumes_its_inputs():
    """A bad bias is reported before fused_add_rms_norm rewrites x and residual in place."""
    x, residual = torch.randn(3, 8), torch.randn(3, 8)
    x_before, residual_before = x.clone(), residual.clone()
    with pytest.raises(ValueError, match="^bias:"):
        kernels.norm_linear(x, residual, torch.randn(8), 1e-6, torch.randn(5, 8), torch.randn(4))
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)
