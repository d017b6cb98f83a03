"""Benchmarks nanovllm's paged attention on one GPU in bf16: prefill against PyTorch SDPA on
dense data, decode against the KV bytes floor and a gather + SDPA path (the small-head rows,
which the CUDA C++ decode kernel serves, also against the Triton kernel and the first against
the read floor of its grid, benchmarks/gather_read.py), small decode
batches through qk_norm_rope_attention's fused kernel against the two kernels it replaces,
split, block-size and tile sweeps, compile time. Every configuration is checked against the PyTorch
reference before it is timed. Writes bench_attention.json and bench_attention.md into --out.

    python -m benchmarks.bench_attention --out DIR
"""
import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

HEADS, HEAD_DIM = (16, 8), 128
PREFILL = dict(name="prefill 8 x 2048", query_lens=[2048] * 8, seq_lens=[2048] * 8)
DECODES = [dict(name="decode 256 x 1024", query_lens=[1] * 256, seq_lens=[1024] * 256),
           dict(name="decode 1 x 32768", query_lens=[1], seq_lens=[32768]),
           # small heads in small blocks (Qwen2.5-0.5B's 14 / 2 heads of 64): short programs, also
           # timed against the read floor of their grid (benchmarks/gather_read.py, its fastest tiles)
           dict(name="decode 256 x 512, 14/2 heads, d64, blocks of 16", query_lens=[1] * 256, seq_lens=[512] * 256,
                heads=(14, 2), head_dim=64, block_size=16, read_floor=dict(block_n=64, early_tiles=2)),
           dict(name="decode 256 x 1024, 14/2 heads, d64, blocks of 16", query_lens=[1] * 256, seq_lens=[1024] * 256,
                heads=(14, 2), head_dim=64, block_size=16)]
# Same shape classes as above with other token counts: must reuse the compiled kernels.
SECOND_CALLS = [dict(name="prefill 7 x 1500", query_lens=[1500] * 7, seq_lens=[1500] * 7),
                dict(name="decode 255 x 1000", query_lens=[1] * 255, seq_lens=[1000] * 255),
                dict(name="decode 1 x 30000", query_lens=[1], seq_lens=[30000])]
BLOCK_SIZES = [16, 32, 64, 128, 256]
# Small decode batches as the engine's CUDA graphs see them: block tables padded to a
# max_model_len of 4096 tokens. Swept over forced split counts to tune split_plan.
SMALL_DECODES = [dict(name="decode 1 x 640 (table for 4096)", query_lens=[1], seq_lens=[640], table_tokens=4096),
                 dict(name="decode 8 x 1000 (table for 4096)", query_lens=[1] * 8, seq_lens=[1000] * 8,
                      table_tokens=4096),
                 dict(name="decode 64 x 1000 (table for 4096)", query_lens=[1] * 64, seq_lens=[1000] * 64,
                      table_tokens=4096),
                 dict(name="decode 1 x 32768", query_lens=[1], seq_lens=[32768], table_tokens=32768)]
SPLITS = [None, 1, 2, 4, 8, 16, 32, 64, 128]
# Decode steps the fused kernel serves (tables as wide as the engine's for a 32k max_model_len).
FUSED_DECODES = [dict(name=f"decode {batch} x {keys}", query_lens=[1] * batch, seq_lens=[keys] * batch,
                      table_tokens=32768) for batch in (1, 4) for keys in (1024, 32768)]
# (block_m, block_n, num_warps, num_stages, tma) tried next to the defaults. Stages count past the
# block-table load, which takes one, so 5 stages give K/V tiles two buffers.
PREFILL_TILES = [(128, 64, 8, 5, False), (128, 64, 8, 6, True), (128, 64, 8, 3, True), (128, 128, 8, 3, True),
                 (256, 32, 16, 5, True), (64, 64, 4, 4, True)]
DECODE_TILES = [(16, 64, 4, 5, False), (16, 64, 4, 5, True), (16, 128, 4, 4, True), (16, 128, 4, 3, False),
                (16, 32, 4, 8, False)]
TOLERANCE = 2e-2  # bf16 output against the fp32 reference, relative Frobenius error


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="directory for bench_attention.{json,md}")
    parser.add_argument("--block-size", type=int, default=128, help="KV block size of the headline runs (the engine default)")
    parser.add_argument("--skip-sweeps", action="store_true", help="only the headline runs and compile times")
    parser.add_argument("--keep-triton-cache", action="store_true",
                        help="reuse ~/.triton/cache (compile times then measure cache loads)")
    return parser.parse_args()


def log(message: str, _start=time.perf_counter()) -> None:
    print(f"[{time.perf_counter() - _start:6.1f}s] {message}", file=sys.stderr, flush=True)


def main():
    args = parse_args()
    if not args.keep_triton_cache:  # before triton is imported: first calls must really compile
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="nanovllm-bench-attention-")
    import torch
    if not torch.cuda.is_available():
        sys.exit("bench_attention.py needs a CUDA GPU")
    bench = Bench(args.block_size)
    results = {"environment": bench.environment()}
    log("compile times")
    results["compile"] = bench.compile_times()
    log("prefill against SDPA")
    results["prefill"] = bench.prefill()
    log("decode")
    results["decode"] = [bench.decode(spec) for spec in DECODES]
    log("fused decode")
    results["fused_decode"] = [bench.fused_decode(spec) for spec in FUSED_DECODES]
    log("split sweep")
    results["split_sweep"] = bench.split_sweep()
    if not args.skip_sweeps:
        log("block-size sweep")
        results["block_size_sweep"] = bench.block_size_sweep()
        log("tile sweep")
        results["tile_sweep"] = bench.tile_sweep()
    log("done")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_attention.json").write_text(json.dumps(results, indent=2))
    markdown = to_markdown(results)
    (args.out / "bench_attention.md").write_text(markdown)
    print(markdown)


class Bench:
    def __init__(self, block_size: int):
        import torch
        import triton
        import triton.testing
        from benchmarks.kernel_cases import relative_error
        from nanovllm.kernels import attention, dispatch, reference
        from nanovllm.utils import timing
        self.torch, self.triton, self.attention, self.reference, self.timing = torch, triton, attention, reference, timing
        self.dispatch = dispatch
        self.relative_error = relative_error
        self.block_size = block_size
        self.device = torch.device("cuda")
        self.gen = torch.Generator(device=self.device).manual_seed(0)
        self.copy_gbps = timing.device_copy_gbs(self.device)

    def time_ms(self, fn, calls_per_graph: int = 10) -> float:
        """Median time of one call, from CUDA-graph replays of `calls_per_graph` calls (L2
        flushed before each replay): no host launch overhead, as in the engine's decode graphs,
        where a small decode batch would otherwise time Python, not the kernel."""
        graph, _ = self.timing.capture(fn, calls_per_graph, warmup=3)
        ms = self.triton.testing.do_bench(graph.replay, warmup=10, rep=100, return_mode="median")
        return ms / calls_per_graph

    def environment(self) -> dict:
        torch = self.torch
        props = torch.cuda.get_device_properties(self.device)
        return {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
                "triton": self.triton.__version__, "copy_bandwidth_GBps": round(self.copy_gbps, 1),
                "headline_block_size": self.block_size}

    # --- workloads ---------------------------------------------------------------------------

    def workload(self, spec: dict, block_size: int | None = None) -> dict:
        """Paged bf16 caches holding every sequence's keys, blocks in random order; heads,
        head dim and block size the spec's where it names them."""
        torch = self.torch
        block_size = block_size or spec.get("block_size", self.block_size)
        num_q_heads, num_kv_heads = spec.get("heads", HEADS)
        head_dim = spec.get("head_dim", HEAD_DIM)
        blocks = [math.ceil(n / block_size) for n in spec["seq_lens"]]
        ids = torch.randperm(sum(blocks), device=self.device, generator=self.gen).to(torch.int32)
        width = max(max(blocks), math.ceil(spec.get("table_tokens", 0) / block_size))
        block_tables = torch.zeros(len(blocks), width, dtype=torch.int32, device=self.device)
        taken = 0
        for i, n in enumerate(blocks):
            block_tables[i, :n] = ids[taken:taken + n]
            taken += n
        cache_shape = (sum(blocks), block_size, num_kv_heads, head_dim)
        k_cache, v_cache = (torch.randn(cache_shape, device=self.device, dtype=torch.bfloat16, generator=self.gen)
                            for _ in range(2))
        cu_seqlens_q = torch.tensor([0, *spec["query_lens"]], device=self.device).cumsum(0).to(torch.int32)
        q = torch.randn(int(cu_seqlens_q[-1]), num_q_heads, head_dim, device=self.device, dtype=torch.bfloat16,
                        generator=self.gen)
        seq_lens = torch.tensor(spec["seq_lens"], dtype=torch.int32, device=self.device)
        return dict(q=q, k_cache=k_cache, v_cache=v_cache, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens,
                    block_tables=block_tables, max_seqlen_q=max(spec["query_lens"]), scale=head_dim ** -0.5)

    def run(self, w: dict, config=None, num_splits=None, cuda_decode=None):
        """cuda_decode None: as the engine's calls, by NANOVLLM_PAGED_DECODE."""
        if cuda_decode is None:
            cuda_decode = self.dispatch.PAGED_DECODE == "cuda"
        return self.attention.paged_attention(**w, config=config, num_splits=num_splits, cuda_decode=cuda_decode)

    def checked(self, name: str, w: dict, config=None, num_splits=None, cuda_decode=None):
        """The kernel's output, after failing loudly if it differs from the reference."""
        out = self.run(w, config, num_splits, cuda_decode)
        ref = self.reference.paged_attention(**w).float()
        err = self.relative_error(out, ref)
        if not (err < TOLERANCE and self.torch.isfinite(out).all()):
            raise SystemExit(f"{name} config={config}: relative error {err:.3e} against the reference "
                             f"(tolerance {TOLERANCE}) -- not timing a wrong kernel")
        return out

    def compiled_variants(self) -> int:
        caches = self.attention._paged_attention_kernel.device_caches.values()
        return sum(len(entry[0]) for entry in caches)

    # --- measurements ------------------------------------------------------------------------

    def compile_times(self) -> list[dict]:
        """Wall time of the first call of each shape class (compiles), then of a call with other
        token counts in the same class (must not compile)."""
        torch = self.torch
        rows = []
        for first, second in zip([PREFILL, *DECODES], SECOND_CALLS):
            for spec, role in ((first, "first call"), (second, "other token count")):
                w = self.workload(spec)
                variants = self.compiled_variants()
                torch.cuda.synchronize()
                start = time.perf_counter()
                self.run(w)
                torch.cuda.synchronize()
                seconds = time.perf_counter() - start
                rows.append({"workload": spec["name"], "call": role, "seconds": round(seconds, 4),
                             "new_variants": self.compiled_variants() - variants})
        recompiled = [r for r in rows if r["call"] == "other token count" and r["new_variants"]]
        if recompiled:
            raise SystemExit(f"a new token count recompiled the kernel: {recompiled}")
        return rows

    def prefill(self) -> dict:
        w = self.workload(PREFILL)
        out = self.checked(PREFILL["name"], w)
        ms = self.time_ms(lambda: self.run(w))
        flops = causal_flops(PREFILL["query_lens"], PREFILL["seq_lens"])
        sdpa = self.sdpa_prefill(w, out)
        best = min(sdpa.values(), key=lambda r: r["ms"])
        return {"workload": PREFILL["name"], "ms": ms, "tflops": flops / ms / 1e9, "sdpa": sdpa,
                "sdpa_best_ms": best["ms"], "speed_vs_sdpa": best["ms"] / ms}

    def sdpa_prefill(self, w: dict, paged_out) -> dict:
        """Every SDPA backend that runs on the same data, dense and unpaged."""
        torch = self.torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        batch, seq = len(PREFILL["seq_lens"]), PREFILL["seq_lens"][0]
        q = w["q"].view(batch, seq, HEADS[0], HEAD_DIM).transpose(1, 2).contiguous()
        k, v = (dense_from_paged(c, w["block_tables"], seq).transpose(1, 2).contiguous()
                for c in (w["k_cache"], w["v_cache"]))
        group = HEADS[0] // HEADS[1]
        k_rep, v_rep = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        expected = paged_out.view(batch, seq, HEADS[0], HEAD_DIM).transpose(1, 2).float()
        flops = causal_flops(PREFILL["query_lens"], PREFILL["seq_lens"])
        results = {}
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
            for gqa in (True, False):  # GQA natively where the backend takes it, else repeated K/V
                def call(backend=backend, gqa=gqa):
                    with sdpa_kernel(backend):
                        if gqa:
                            return torch.nn.functional.scaled_dot_product_attention(
                                q, k, v, is_causal=True, scale=w["scale"], enable_gqa=True)
                        return torch.nn.functional.scaled_dot_product_attention(
                            q, k_rep, v_rep, is_causal=True, scale=w["scale"])
                try:
                    out = call()
                except RuntimeError:
                    continue
                err = self.relative_error(out, expected)
                if err > TOLERANCE:
                    raise SystemExit(f"SDPA {backend.name} disagrees with the paged kernel: {err:.3e}")
                ms = self.time_ms(call)
                results[backend.name] = {"ms": ms, "tflops": flops / ms / 1e9, "gqa": "native" if gqa else "repeated"}
                break
        if not results:
            raise SystemExit("no SDPA backend ran the prefill baseline")
        return results

    def decode(self, spec: dict, block_size: int | None = None, config=None, baseline: bool = True) -> dict:
        w = self.workload(spec, block_size)
        self.checked(spec["name"], w, config)
        ms = self.time_ms(lambda: self.run(w, config))
        _, block_size, num_kv_heads, head_dim = w["k_cache"].shape
        kv_bytes = 2 * sum(spec["seq_lens"]) * num_kv_heads * head_dim * w["k_cache"].element_size()
        row = {"workload": spec["name"], "block_size": block_size, "ms": ms,
               "GBps": kv_bytes / ms / 1e6, "bandwidth_fraction": kv_bytes / ms / 1e6 / self.copy_gbps,
               "floor_ms": kv_bytes / self.copy_gbps / 1e6,
               "splits": self.attention.split_plan(len(spec["seq_lens"]) * num_kv_heads,
                                                    w["block_tables"].shape[1] * w["k_cache"].shape[1],
                                                    (config or self.default_config(w)).block_n, self.device)[0]}
        cuda_kernel = config is None and self.dispatch.PAGED_DECODE == "cuda" and self.attention.cuda_decode_module(
            w["q"], w["k_cache"], w["v_cache"], w["cu_seqlens_q"], w["seq_lens"], w["block_tables"],
            w["max_seqlen_q"], row["splits"], None) is not None
        row["kernel"] = "cuda" if cuda_kernel else "triton"
        if cuda_kernel:  # the Triton kernel it replaces, same call otherwise
            self.checked(spec["name"], w, cuda_decode=False)
            triton_ms = self.time_ms(lambda: self.run(w, cuda_decode=False))
            row |= {"triton_ms": triton_ms, "speed_vs_triton": triton_ms / ms}
        if baseline:
            torch_ms = self.time_ms(lambda: gather_sdpa_decode(w, spec["seq_lens"][0]))
            row |= {"torch_gather_sdpa_ms": torch_ms, "speed_vs_torch": torch_ms / ms}
        if baseline and "read_floor" in spec:
            from benchmarks.gather_read import gather_read
            keys = spec["seq_lens"][0]
            assert all(n == keys for n in spec["seq_lens"]), "the read floor takes sequences of one length"
            def read():
                return gather_read(w["k_cache"], w["v_cache"], w["block_tables"], keys, **spec["read_floor"])
            gathered = (w["k_cache"].float() + w["v_cache"].float())[w["block_tables"].long()].flatten(1, 2)
            expected = gathered[:, :keys].sum(1).flatten(0, 1)
            err = self.relative_error(read(), expected)
            if not err < 1e-4:
                raise SystemExit(f"gather_read: relative error {err:.3e} against the summed keys -- not timing it")
            read_ms = self.time_ms(read)
            row |= {"gather_read_ms": read_ms, "gather_read_fraction": kv_bytes / read_ms / 1e6 / self.copy_gbps}
        return row

    def fused_decode(self, spec: dict) -> dict:
        """kernels.qk_norm_rope_attention's fused decode kernel (with the merge) against
        qk_norm_rope_store then paged attention, Qwen3's q/k norms on: the step's key rotated,
        stored and attended to."""
        torch = self.torch
        from nanovllm.kernels import decode_attention, qk_norm_rope
        w = self.workload(spec)
        heads, kv_heads, head_dim = w["q"].shape[1], w["k_cache"].shape[2], w["q"].shape[2]
        k, v = (torch.randn(len(spec["seq_lens"]), kv_heads, head_dim, device=self.device, dtype=torch.bfloat16,
                            generator=self.gen) for _ in range(2))
        block_size = w["k_cache"].shape[1]
        last = w["seq_lens"].long() - 1
        blocks = w["block_tables"].long().gather(1, (last // block_size)[:, None]).view(-1)
        slots = blocks * block_size + last % block_size
        cos_sin = torch.randn(32768, head_dim, device=self.device, generator=self.gen)
        # unit norm weights: the two kernels rewrite q in place on every timed call, and a norm
        # with weights of 1 leaves its own output as it is
        ones = torch.ones(head_dim, device=self.device, dtype=torch.bfloat16)
        weights = dict(q_weight=ones, k_weight=ones)
        raw_q = w.pop("q")
        rotated_q = raw_q.clone()
        inputs = (k, v, last, cos_sin, w["k_cache"], w["v_cache"], slots)
        metadata = {name: w[name] for name in ("cu_seqlens_q", "seq_lens", "block_tables", "max_seqlen_q", "scale")}
        fused = lambda: decode_attention.qk_norm_rope_attention(raw_q, *inputs, **metadata, **weights)  # noqa: E731

        def two_kernels():
            q = qk_norm_rope.qk_norm_rope_store(rotated_q, *inputs, **weights)
            return self.attention.paged_attention(q, w["k_cache"], w["v_cache"], **metadata)

        expected = self.reference.qk_norm_rope_attention(raw_q.double(), k.double(), v.double(), last,
                                                          cos_sin.double(), w["k_cache"].double(),
                                                          w["v_cache"].double(), slots, **metadata,
                                                          **{n: t.double() for n, t in weights.items()})
        fused_calls, real_decode = [], decode_attention._decode
        decode_attention._decode = lambda *args: fused_calls.append(args) or real_decode(*args)
        try:
            checked_fused = fused()
        finally:
            decode_attention._decode = real_decode
        if not fused_calls:
            raise SystemExit(f"{spec['name']}: qk_norm_rope_attention took the two kernels on this GPU")
        for name, out in (("fused", checked_fused), ("two kernels", two_kernels())):
            err = self.relative_error(out, expected)
            if not err < TOLERANCE:
                raise SystemExit(f"{spec['name']}, {name}: relative error {err:.3e} -- not timing a wrong kernel")
        fused_ms, two_ms = self.time_ms(fused), self.time_ms(two_kernels)
        return {"workload": spec["name"], "fused_ms": fused_ms, "two_kernels_ms": two_ms,
                "speed_vs_two_kernels": two_ms / fused_ms}

    def split_sweep(self) -> list[dict]:
        """Forced split counts (None: split_plan's choice) for small decode batches."""
        rows = []
        for spec in SMALL_DECODES:
            w = self.workload(spec)
            kv_bytes = 2 * sum(spec["seq_lens"]) * HEADS[1] * HEAD_DIM * w["k_cache"].element_size()
            for splits in SPLITS:
                self.checked(spec["name"], w, num_splits=splits)
                ms = self.time_ms(lambda: self.run(w, num_splits=splits))
                rows.append({"workload": spec["name"], "splits": splits or "auto", "ms": ms,
                             "bandwidth_fraction": kv_bytes / ms / 1e6 / self.copy_gbps})
        return rows

    def default_config(self, w: dict):
        _, block_size, num_kv_heads, head_dim = w["k_cache"].shape
        return self.attention.default_config(head_dim, w["q"].shape[1] // num_kv_heads, w["max_seqlen_q"],
                                             w["k_cache"].dtype, self.device, block_size=block_size)

    def block_size_sweep(self) -> list[dict]:
        rows = []
        for block_size in BLOCK_SIZES:
            w = self.workload(PREFILL, block_size)
            self.checked(PREFILL["name"], w)
            ms = self.time_ms(lambda: self.run(w))
            rows.append({"workload": PREFILL["name"], "block_size": block_size, "ms": ms,
                         "tflops": causal_flops(PREFILL["query_lens"], PREFILL["seq_lens"]) / ms / 1e9})
            rows += [self.decode(spec, block_size, baseline=False) for spec in DECODES]
        return rows

    def tile_sweep(self) -> list[dict]:
        TileConfig = self.attention.TileConfig
        rows = []
        w = self.workload(PREFILL)
        for tiles in [tuple(self.default_config(w)), *PREFILL_TILES]:
            config = TileConfig(*tiles)
            self.checked(PREFILL["name"], w, config)
            ms = self.time_ms(lambda: self.run(w, config))
            rows.append({"workload": PREFILL["name"], "tiles": tiles, "ms": ms,
                         "tflops": causal_flops(PREFILL["query_lens"], PREFILL["seq_lens"]) / ms / 1e9})
        decode_default = self.default_config(self.workload(DECODES[1]))
        for tiles in [tuple(decode_default), *DECODE_TILES]:
            for spec in DECODES:
                row = self.decode(spec, config=TileConfig(*tiles), baseline=False)
                rows.append(row | {"tiles": tiles})
        return rows


def dense_from_paged(cache, block_tables, seq_len: int):
    """[batch, seq_len, heads, head_dim] gathered from the paged cache."""
    return cache[block_tables.long()].flatten(1, 2)[:, :seq_len]


def gather_sdpa_decode(w: dict, seq_len: int):
    """What PyTorch alone would do per decode step: gather the blocks, then SDPA."""
    import torch
    k, v = (dense_from_paged(c, w["block_tables"], seq_len).transpose(1, 2) for c in (w["k_cache"], w["v_cache"]))
    out = torch.nn.functional.scaled_dot_product_attention(w["q"].unsqueeze(2), k, v, scale=w["scale"],
                                                           enable_gqa=True)
    return out.squeeze(2)


def causal_flops(query_lens, seq_lens) -> float:
    """2 matmuls x 2 flops per (query, visible key) pair, per query head: the q new rows of a
    sequence of n keys see n - q cached keys each plus 1..q of the new ones."""
    pairs = sum(q * (n - q) + q * (q + 1) // 2 for q, n in zip(query_lens, seq_lens))
    return 4 * pairs * HEADS[0] * HEAD_DIM


def to_markdown(results: dict) -> str:
    env = results["environment"]
    lines = [f"# Paged attention benchmark: {env['device']}", "",
             f"torch {env['torch']}, triton {env['triton']}, {env['sms']} SMs, copy bandwidth "
             f"{env['copy_bandwidth_GBps']} GB/s, headline block size {env['headline_block_size']}, "
             f"bf16, {HEADS[0]} query / {HEADS[1]} KV heads, head dim {HEAD_DIM}.", ""]
    p = results["prefill"]
    lines += ["## Prefill (causal)", "", "| kernel | ms | TFLOP/s |", "|---|---|---|",
              f"| nanovllm paged | {p['ms']:.3f} | {p['tflops']:.0f} |"]
    lines += [f"| SDPA {name} ({r['gqa']} GQA) | {r['ms']:.3f} | {r['tflops']:.0f} |" for name, r in p["sdpa"].items()]
    lines += ["", f"Speed vs fastest SDPA: **{p['speed_vs_sdpa']:.2f}x**", ""]
    lines += ["## Decode", "", "| workload | kernel | splits | ms | floor ms | GB/s | of copy bw | gather+SDPA ms | "
              "speed-up |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {d['workload']} | {d['kernel']} | {d['splits']} | {d['ms']:.4f} | {d['floor_ms']:.4f} | "
              f"{d['GBps']:.0f} | {d['bandwidth_fraction']:.0%} | {d['torch_gather_sdpa_ms']:.4f} | "
              f"{d['speed_vs_torch']:.2f}x |" for d in results["decode"]]
    lines += [f"\n{d['workload']}: the Triton kernel takes {d['triton_ms']:.4f} ms, the CUDA C++ one "
              f"{d['speed_vs_triton']:.2f}x faster." for d in results["decode"] if "triton_ms" in d]
    lines += [f"\nRead floor of {d['workload']} at the kernel's grid (benchmarks/gather_read.py): "
              f"{d['gather_read_ms']:.4f} ms, {d['gather_read_fraction']:.0%} of copy bw; the kernel takes "
              f"{d['ms'] / d['gather_read_ms']:.2f}x that." for d in results["decode"] if "gather_read_ms" in d]
    lines += ["", "## Fused decode (q/k norm, rotary, KV write and attention), against the two kernels", "",
              "| workload | fused ms | two kernels ms | speed-up |", "|---|---|---|---|"]
    lines += [f"| {r['workload']} | {r['fused_ms']:.4f} | {r['two_kernels_ms']:.4f} | "
              f"{r['speed_vs_two_kernels']:.2f}x |" for r in results["fused_decode"]]
    lines += [""]
    lines += ["## Compile time", "", "| workload | call | seconds | new kernel variants |", "|---|---|---|---|"]
    lines += [f"| {r['workload']} | {r['call']} | {r['seconds']:.3f} | {r['new_variants']} |"
              for r in results["compile"]]
    lines += ["", "## Split sweep (small decode batches, graph-padded block tables)", "",
              "| workload | splits | ms | % of copy bw |", "|---|---|---|---|"]
    lines += [f"| {r['workload']} | {r['splits']} | {r['ms']:.4f} | {r['bandwidth_fraction']:.0%} |"
              for r in results["split_sweep"]]
    if "block_size_sweep" in results:
        lines += ["", "## Block-size sweep", "", "| workload | block size | ms | TFLOP/s or % of copy bw |",
                  "|---|---|---|---|"]
        lines += [f"| {r['workload']} | {r['block_size']} | {r['ms']:.4f} | {_metric(r)} |"
                  for r in results["block_size_sweep"]]
        lines += ["", "## Tile sweep (first row of each workload: the default)", "",
                  "| workload | (block_m, block_n, warps, stages, tma) | ms | TFLOP/s or % of copy bw |",
                  "|---|---|---|---|"]
        lines += [f"| {r['workload']} | {tuple(r['tiles'])} | {r['ms']:.4f} | {_metric(r)} |"
                  for r in sorted(results["tile_sweep"], key=lambda r: r["workload"], reverse=True)]
    return "\n".join(lines) + "\n"


def _metric(row: dict) -> str:
    return f"{row['tflops']:.0f} TFLOP/s" if "tflops" in row else f"{row['bandwidth_fraction']:.0%}"


if __name__ == "__main__":
    main()
