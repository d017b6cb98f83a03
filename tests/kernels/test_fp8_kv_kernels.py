"""Float8 (e4m3) KV caches: the stores write value / scale saturated to +-448, and every attention
path reads the cache upcast and times its scale. Stores are compared to the reference's to the
bit; attention with the float64 reference over the dequantised caches (test_attention's
tolerances, as the upcast itself is exact). fp32 through Triton's interpreter, bf16/fp16 on a
GPU, where the CUDA C++ decode kernel is also checked against the Triton one."""
import pytest
import torch
from kernel_testing import TARGETS, capture_and_replay, require_triton
from test_attention import Case, assert_close, cuda_decode_module, expected, make_case
from test_decode_attention import _decode_step

from nanovllm import kernels
from nanovllm.kernels import reference

try:
    from nanovllm.kernels import attention, decode_attention
except ImportError:  # no Triton here: only the reference can run
    attention = decode_attention = None

FP8 = torch.float8_e4m3fn
interpret = pytest.mark.triton_interpret
gpu = pytest.mark.gpu
INTERPRETER_FP32_AND_GPU = [
    pytest.param("cpu", torch.float32, marks=interpret, id="interpreter-float32"),
    *(pytest.param("cuda", dtype, marks=gpu, id=f"cuda-{str(dtype)[6:]}") for dtype in (torch.bfloat16, torch.float16)),
]
# Keys and values are N(0, 1): a key scale of 1/64 stores them as values up to about +-256,
# and some past 448 / 64 saturate; 3.0 puts most values in e4m3's subnormal range.
SCALES = [(1 / 64, 3.0), (1.0, 1.0)]


def fp8_case(case: Case, k_scale: float, v_scale: float) -> tuple[Case, Case]:
    """(case over float8 caches, the same case over their dequantised float64 values)."""
    caches = [reference.to_cache(c, s, FP8) for c, s in ((case.k_cache, k_scale), (case.v_cache, v_scale))]
    quantised = Case(case.q, *caches, *(getattr(case, f) for f in (
        "cu_seqlens_q", "seq_lens", "block_tables", "max_seqlen_q", "scale", "causal", "sliding_window")))
    dequantised = Case(case.q, caches[0].double() * k_scale, caches[1].double() * v_scale,
                       *(getattr(case, f) for f in ("cu_seqlens_q", "seq_lens", "block_tables", "max_seqlen_q",
                                                    "scale", "causal", "sliding_window")))
    return quantised, dequantised


def check_attention(case: Case, k_scale: float, v_scale: float, **launcher_kwargs) -> torch.Tensor:
    quantised, dequantised = fp8_case(case, k_scale, v_scale)
    kwargs = quantised.kwargs() | dict(k_scale=k_scale, v_scale=v_scale)
    if launcher_kwargs:
        out = attention.paged_attention(quantised.q, quantised.k_cache, quantised.v_cache, **kwargs, **launcher_kwargs)
    else:
        out = kernels.paged_attention(quantised.q, quantised.k_cache, quantised.v_cache, **kwargs)
    assert_close(out, expected(dequantised), case.q.dtype)
    return out


# --- the reference: the definition the kernels are held to ------------------------------------

def test_reference_store_divides_saturates_and_rounds_to_nearest():
    key = torch.tensor([[[1.0, -1000.0, 3.3e-3, 0.0]]])
    value = torch.tensor([[[448.0, 449.0, -0.1, 17.0]]])
    k_cache, v_cache = (torch.full((2, 4, 1, 4), float("nan"), dtype=FP8) for _ in range(2))
    kernels.store_kvcache(key, value, k_cache, v_cache, torch.tensor([5]), k_scale=0.5, v_scale=2.0)
    # 2, -2000 saturated, 6.6e-3 to the nearest subnormal (3 * 2^-9), 0
    assert k_cache[1, 1, 0].float().tolist() == [2.0, -448.0, 3 / 512, 0.0]
    # 224, 224.5 to 224 (steps of 16 there), -0.05 to 13 * 2^-8, 8.5 to the even 8
    assert v_cache[1, 1, 0].float().tolist() == [224.0, 224.0, -13 / 256, 8.0]
    assert k_cache.float().isnan().sum() == 2 * 4 * 4 - 4  # the other slots untouched


@pytest.mark.parametrize("decode", [True, False])
def test_reference_attention_reads_the_scaled_cache(decode):
    """Both reference paths (batched decode, per-sequence) equal float64 attention over the
    dequantised caches."""
    shape = [(1, n) for n in (40, 1, 17)] if decode else [(3, 40), (1, 1), (17, 17)]
    case = make_case(shape, (4, 2), 32, 16)
    case.block_tables[case.block_tables >= case.k_cache.shape[0]] = -1  # the engine's padding
    quantised, dequantised = fp8_case(case, 1 / 64, 3.0)
    out = reference.paged_attention(quantised.q, quantised.k_cache, quantised.v_cache, **quantised.kwargs(),
                                    k_scale=1 / 64, v_scale=3.0)
    assert_close(out, expected(dequantised), torch.float32)


@pytest.mark.parametrize("field,kwargs,cache_dtype", [
    ("k_scale", dict(k_scale=0.5), torch.float32), ("v_scale", dict(v_scale=0.0), FP8),
    ("k_scale", dict(k_scale=float("inf")), FP8), ("v_cache", {}, None)])
def test_bad_scales_and_caches_name_their_field(field, kwargs, cache_dtype):
    case = make_case([(1, 5)])
    k_cache = case.k_cache.to(cache_dtype or FP8)
    v_cache = case.v_cache.to(cache_dtype or torch.bfloat16)
    with pytest.raises(ValueError, match=f"^{field}: "):
        kernels.paged_attention(case.q, k_cache, v_cache, **case.kwargs(), **kwargs)
    with pytest.raises(ValueError, match=f"^{field}: "):
        kernels.store_kvcache(case.q[:, :2], case.q[:, :2], k_cache, v_cache, torch.tensor([0]), **kwargs)


# --- stores -----------------------------------------------------------------------------------

def _store_inputs(tokens, kv_heads, head_dim, dtype, device):
    """Key and value as views into a packed qkv row (non-contiguous), values up to +-1000."""
    qkv = torch.randn(tokens, (2 + 2 * kv_heads) * head_dim, device=device) * 300
    _, key, value = qkv.to(dtype).view(tokens, -1, head_dim).split([2, kv_heads, kv_heads], dim=1)
    return key, value


@pytest.mark.parametrize("device,dtype", TARGETS)
@pytest.mark.parametrize("tokens,kv_heads,head_dim,block_size", [(9, 3, 96, 4), (6, 1, 64, 256)])
@pytest.mark.parametrize("k_scale,v_scale", SCALES)
def test_store_kvcache_matches_the_reference_bit_for_bit(device, dtype, tokens, kv_heads, head_dim, block_size,
                                                         k_scale, v_scale):
    require_triton(device)
    key, value = _store_inputs(tokens, kv_heads, head_dim, dtype, device)
    num_blocks = tokens + 2
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), device=device).to(FP8)
    v_cache = k_cache.clone()
    slots = torch.randperm(num_blocks * block_size, device=device)[:tokens]
    slots[1::3] = -1
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.store_kvcache(key, value, want_k, want_v, slots, k_scale, v_scale)
    kernels.store_kvcache(key, value, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)
    for cache, want in ((k_cache, want_k), (v_cache, want_v)):
        assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))
    assert k_cache.float().abs().nan_to_num().max() == 448  # some values saturated


def assert_fp8_equal(cache: torch.Tensor, want: torch.Tensor, device: str) -> None:
    """To the bit, except on a GPU a few elements one e4m3 step apart: the fused kernel's
    fp32 norm and rotation may round a key to another bf16 neighbour than the reference."""
    same = cache.view(torch.uint8) == want.view(torch.uint8)
    if device == "cpu":
        assert same.all()
        return
    assert same.float().mean() > 0.999
    got, ref = cache[~same].float(), want[~same].float()
    assert ((got - ref).abs() <= ref.abs() / 8 + 2 ** -9).all()


@pytest.mark.parametrize("device,dtype", INTERPRETER_FP32_AND_GPU)
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qwen3", "llama"])
def test_qk_norm_rope_store_matches_the_reference(device, dtype, qk_norm):
    require_triton(device)
    case, (q, k, v, positions, cos_sin), slot_mapping, weights = _decode_step(
        [300, 0, 17, 1, 65], (6, 3), 96, 16, dtype, device, qk_norm=qk_norm)
    quantised, _ = fp8_case(case, 0.02, 0.5)
    want_q, want_k, want_v = q.clone(), quantised.k_cache.clone(), quantised.v_cache.clone()
    reference.qk_norm_rope_store(want_q, k, v, positions, cos_sin, want_k, want_v, slot_mapping, *weights.values(),
                                 k_scale=0.02, v_scale=0.5)
    kernels.qk_norm_rope_store(q, k, v, positions, cos_sin, quantised.k_cache, quantised.v_cache, slot_mapping,
                               *weights.values(), k_scale=0.02, v_scale=0.5)
    assert_fp8_equal(quantised.k_cache, want_k, device)
    assert_fp8_equal(quantised.v_cache, want_v, device)


# --- attention --------------------------------------------------------------------------------

@interpret
@pytest.mark.parametrize("heads,head_dim,block_size,num_splits,k_scale,v_scale", [
    ((8, 2), 64, 64, None, 1 / 64, 3.0), ((5, 1), 80, 16, 3, 1 / 64, 3.0), ((4, 4), 32, 128, 1, 1.0, 1.0)])
def test_paged_attention_interpreted(heads, head_dim, block_size, num_splits, k_scale, v_scale):
    """Mixed batches (prefill over a cache, decode, fresh prompts), the TMA key tiles of blocks of
    64, a padded head dim, a forced split; the caches' unused slots hold NaN."""
    require_triton("cpu")
    case = make_case([(1, 300), (5, 18), (17, 97), (1, 1), (9, 9)], heads, head_dim, block_size)
    check_attention(case, k_scale, v_scale, num_splits=num_splits)


@interpret
def test_bf16_queries_take_fp16_products_interpreted():
    """bf16 queries over a float8 cache: the products in fp16 (exact for the upcast tiles),
    huge query values saturated rather than infinite."""
    require_triton("cpu")
    case = make_case([(1, 130), (3, 40)], (8, 2), 64, 16, torch.bfloat16)
    check_attention(case, 1 / 64, 3.0, num_splits=2)
    case.q[0, 0, :4] = 1e6
    quantised, _ = fp8_case(case, 1 / 64, 3.0)
    out = kernels.paged_attention(quantised.q, quantised.k_cache, quantised.v_cache, **quantised.kwargs(),
                                  k_scale=1 / 64, v_scale=3.0)
    assert torch.isfinite(out).all()


@interpret
@pytest.mark.parametrize("num_seqs,num_splits", [(5, None), (2, None), (3, 4)])
def test_decode_attention_interpreted(num_seqs, num_splits):
    """Decode steps: kv heads packed into one row (5 sequences of 2 heads of 64 on 4 SMs), split
    by the launcher's plan, and a forced split."""
    case = make_case([(1, n) for n in (130, 64, 1, 70, 200)[:num_seqs]], (14, 2), 64, 64, sliding_window=None)
    check_attention(case, 0.1, 1 / 3, num_splits=num_splits)


@interpret
def test_sliding_window_interpreted():
    case = make_case([(1, 300), (7, 90)], (8, 2), 64, 16, sliding_window=37)
    check_attention(case, 0.25, 2.0, num_splits=2)


@pytest.mark.parametrize("device,dtype", INTERPRETER_FP32_AND_GPU)
def test_fused_decode_writes_and_reads_fp8(device, dtype):
    """qk_norm_rope_attention's one-kernel decode: the step's key and value stored as the
    reference stores them, and the output that of float64 attention over the cache it left
    (the step's own key scored as the cache holds it)."""
    require_triton(device)
    case, (q, k, v, positions, cos_sin), slot_mapping, weights = _decode_step(
        [300, 0, 17, 1, 65], (16, 8), 128, 16, dtype, device)
    quantised, _ = fp8_case(case, 0.05, 0.3)
    want_k, want_v = quantised.k_cache.clone(), quantised.v_cache.clone()
    reference.qk_norm_rope_store(q.clone(), k, v, positions, cos_sin, want_k, want_v, slot_mapping,
                                 *weights.values(), k_scale=0.05, v_scale=0.3)
    q_in = q.clone()
    kwargs = {n: val for n, val in quantised.kwargs().items() if n != "causal"} | weights
    out = decode_attention.qk_norm_rope_attention(q_in, k, v, positions, cos_sin, quantised.k_cache,
                                                  quantised.v_cache, slot_mapping, **kwargs, k_scale=0.05,
                                                  v_scale=0.3, num_splits=3)
    assert_fp8_equal(quantised.k_cache, want_k, device)
    assert_fp8_equal(quantised.v_cache, want_v, device)
    rotated = q.clone()
    reference.qk_norm_rope_store(rotated, k, v, positions, cos_sin, want_k.clone(), want_v.clone(), slot_mapping,
                                 *weights.values(), k_scale=0.05, v_scale=0.3)
    dequantised = Case(rotated, quantised.k_cache.double() * 0.05, quantised.v_cache.double() * 0.3,
                       *(getattr(case, f) for f in ("cu_seqlens_q", "seq_lens", "block_tables", "max_seqlen_q",
                                                    "scale", "causal", "sliding_window")))
    assert_close(out, expected(dequantised), dtype)


# --- GPU --------------------------------------------------------------------------------------

@gpu
@pytest.mark.parametrize("heads,head_dim,block_size", [((8, 2), 128, 128), ((14, 2), 64, 16), ((5, 1), 80, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_attention_gpu(heads, head_dim, block_size, dtype):
    case = make_case([(1, 1328), (5, 18), (129, 463), (1, 1), (64, 64)], heads, head_dim, block_size, dtype, "cuda")
    for num_splits in (None, 1, 4):
        check_attention(case, 1 / 64, 3.0, num_splits=num_splits)
    decode = make_case([(1, n) for n in (1, 0, 129, 4097, 512, 33)] * 30, heads, head_dim, block_size, dtype, "cuda")
    check_attention(decode, 0.1, 0.5)


@gpu
@pytest.mark.parametrize("heads,block_size,dtype", [((14, 2), 16, torch.bfloat16), ((16, 1), 64, torch.bfloat16),
                                                    ((4, 4), 32, torch.float16), ((32, 8), 128, torch.bfloat16)])
def test_cuda_decode_matches_triton_gpu(heads, block_size, dtype):
    """The CUDA C++ kernel over a float8 cache: sequences shorter than a chunk, of whole chunks,
    longer than one warp's 32 block ids, empty, and without a query row; with and without PDL.
    Against the float64 reference and Triton's unsplit decode of the same cache."""
    paged_decode, ext = cuda_decode_module(required=True)
    shape = [(1, n) for n in (1, 0, 15, 16, 17, 129, 4097, 512, 33, 300)] + [(0, 40), (1, 9000)]
    quantised, dequantised = fp8_case(make_case(shape, heads, 64, block_size, dtype, "cuda", spare_columns=3),
                                      1 / 64, 3.0)
    assert paged_decode.supports(quantised.q, quantised.k_cache, quantised.v_cache, quantised.cu_seqlens_q,
                                 quantised.seq_lens, quantised.block_tables)
    want = expected(dequantised)
    triton_out = attention.paged_attention(quantised.q, quantised.k_cache, quantised.v_cache, **quantised.kwargs(),
                                           k_scale=1 / 64, v_scale=3.0, num_splits=1)
    assert_close(triton_out, want, dtype)
    for pdl in (False, True):
        out = paged_decode.paged_decode(ext, quantised.q, quantised.k_cache, quantised.v_cache,
                                        quantised.cu_seqlens_q, quantised.seq_lens, quantised.block_tables,
                                        quantised.scale, 1 / 64, 3.0, pdl)
        assert_close(out, want, dtype)
        rows = quantised.cu_seqlens_q[-1]
        assert_close(out[:rows], triton_out[:rows].double(), dtype)
        assert (out[1] == 0).all()


@gpu
def test_cuda_decode_serves_fp8_through_paged_attention_gpu(monkeypatch):
    paged_decode, _ = cuda_decode_module(required=True)
    served = []
    kernel = paged_decode.paged_decode
    monkeypatch.setattr(paged_decode, "paged_decode", lambda *a, **kw: served.append(1) or kernel(*a, **kw))
    case = make_case([(1, n) for n in (1, 129, 4097, 512, 33, 300, 200)] * 40, (14, 2), 64, 64, torch.bfloat16,
                     "cuda")
    quantised, dequantised = fp8_case(case, 0.1, 0.5)
    out = capture_and_replay(lambda: attention.paged_attention(
        quantised.q, quantised.k_cache, quantised.v_cache, **quantised.kwargs(), k_scale=0.1, v_scale=0.5,
        cuda_decode=True))
    assert served
    assert_close(out, expected(dequantised), torch.bfloat16)
