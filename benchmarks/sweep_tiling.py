"""Sweeps the launch rule of the elementwise and norm kernels (nanovllm/kernels/tiling.py:
rows a program takes, warps it runs with) to show how to choose them: against torch.compile
at decode sizes (1, 64, 256 rows), and against the device's copy rate at 4096 rows.

For each (op, shape, rows), bf16, CUDA-graph replay timing (nanovllm.utils.timing.benchmark_kernel):
  default      the launch rule as it is
  w1 .. w16    fixed num_warps, default rows per program
  r0.5 r2 r4   (256 and 4096 rows) rows per program times 0.5 / 2 / 4, warps by the default
               rule on the bigger tile; and the same with fixed warps 4 and 8 (r2w4, ...)
  c2 c4        (activation ops, 256 and 4096 rows) column tile (_MAX_BLOCK_C) times 2 / 4:
               element_wise_mul_add runs contiguous inputs as one long row, so only the
               column tile grows its tiles
  compile      torch.compile(dynamic=False) of the eager expression of benchmarks/kernel_cases.py
A variant is a monkeypatch of the launcher module's `rows_per_program` / `num_warps` /
`_MAX_BLOCK_C`, restored afterwards. Its output is checked against the default variant's
first; a mismatch is flagged BAD and not timed. A variant whose (rows, warps, column tile)
the launcher actually used equals an earlier one's is not timed again.
qk_norm_rope_store's rows are tokens: a variant scales the tokens a program takes.

From the repository root, on a GPU (a few minutes):

    python -m benchmarks.sweep_tiling --out out/sweep_tiling

Writes DIR/sweep_tiling.json (every variant) and DIR/sweep_tiling.md. Without a GPU, a smoke
run of the logic through Triton's interpreter (rows 1 and 7, no compile, wall clock):

    TRITON_INTERPRET=1 python -m benchmarks.sweep_tiling --smoke --out /tmp/sweep_tiling"""
import argparse
import contextlib
import importlib
import json
import platform
import time
from pathlib import Path

import torch

from benchmarks.bench_kernels import raise_recompile_limit
from benchmarks.kernel_cases import OPS
from nanovllm.kernels import backend_for, tiling
from nanovllm.utils.timing import benchmark_kernel, clone_arguments, device_copy_gbs

# (op, launcher module, [(width, strided)]): the kernel benchmark's timed shapes (Qwen3-0.6B and
# a 4096-wide model); "strided" rms_norm is the per-head q norm on a slice of the qkv output.
SWEEP = [
    ("silu_and_mul", "activation", [(2 * 3072, False)]),
    ("fused_add_gelu", "activation", [(4096, False)]),
    ("element_wise_mul_add", "activation", [(4096, False)]),
    ("rms_norm", "norm", [(1024, False), (4096, False), (2048, True)]),
    ("fused_add_rms_norm", "norm", [(1024, False), (4096, False)]),
    ("apply_rotary_emb", "rotary", [(2048, True)]),
    ("store_kvcache", "kv_cache", [(2048, True)]),
    ("qk_norm_rope_store", "qk_norm_rope", [(2048, True)]),
]
BF16_TOL = dict(rtol=2e-2, atol=2e-2)  # a few bf16 ulps: warps change the reduction order


@contextlib.contextmanager
def launch_rule(module, rows: float | None = None, warps: int | None = None, cols: int | None = None):
    """Overrides the module's launch rule for the duration; yields a dict that receives what
    the launcher used: R (rows a program), W (warps), C (row elements), tile (elements)."""
    saved = {n: getattr(module, n) for n in ("rows_per_program", "num_warps", "_MAX_BLOCK_C") if hasattr(module, n)}
    used = {}

    def rows_per_program(n_rows, row_elements, *rest):
        r = saved["rows_per_program"](n_rows, row_elements, *rest)
        if rows is not None:  # capped like the rule: more rows than there are would be masked
            r = min(max(1, int(r * rows)), tiling.next_power_of_2(n_rows))
        used.update(R=r, C=row_elements)
        return r

    def num_warps(tile, programs, *rest):
        w = warps if warps is not None else saved["num_warps"](tile, programs, *rest)
        used.update(W=w, tile=tile)
        return w

    try:
        module.num_warps = num_warps
        if "rows_per_program" in saved:
            module.rows_per_program = rows_per_program
        if cols is not None:
            module._MAX_BLOCK_C = saved["_MAX_BLOCK_C"] * cols
        yield used
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def variants(module, rows: int, tile_rows, warps_grid):
    """(label, tiling kwargs) to try for one case, the default first."""
    out = [("default", {})] + [(f"w{w}", dict(warps=w)) for w in warps_grid]
    if rows in tile_rows and hasattr(module, "rows_per_program"):
        for m in (0.5, 2, 4):
            out += [(f"r{m:g}", dict(rows=m))] + [(f"r{m:g}w{w}", dict(rows=m, warps=w)) for w in (4, 8)]
    if rows in tile_rows and hasattr(module, "_MAX_BLOCK_C"):
        out += [(f"c{m}", dict(cols=m)) for m in (2, 4)]
    return out


def outputs_of(op, inputs):
    """The op's output tensors from one call on fresh copies of the inputs."""
    seen, _ = clone_arguments(inputs)
    return [t.float() for t in op.outputs(op.fused(*seen), seen)]


def matches(got, want, exact: bool) -> bool:
    if exact:
        return all(torch.equal(g, w) for g, w in zip(got, want))
    return all(torch.allclose(g, w, equal_nan=True, **BF16_TOL) for g, w in zip(got, want))


def sweep_case(op, module, case, rows, opts):
    """Every variant of one (op, shape, rows); -> list of variant records."""
    pristine, _ = clone_arguments(case.args)  # on the CPU benchmark_kernel runs in-place ops on the inputs themselves
    timed = lambda: benchmark_kernel(op.fused, *case.args, warmup=opts.warmup, iters=opts.iters) * 1e3
    records, seen_configs, want = [], {}, None
    for label, kwargs in variants(module, rows, opts.tile_rows, opts.warps):
        rec = dict(variant=label)
        try:
            with launch_rule(module, **kwargs) as used:
                got = outputs_of(op, pristine)
                rec["config"] = config = dict(used)
                key = tuple(sorted(config.items()))
                if want is None:
                    want = got
                rec["ok"] = matches(got, want, op.exact)
                if not rec["ok"]:
                    rec["max_abs_diff"] = max((g - w).abs().max().item() for g, w in zip(got, want))
                elif key in seen_configs:
                    rec["same_as"] = seen_configs[key]
                else:
                    seen_configs[key] = label
                    rec["us"] = timed()
        except Exception as exc:  # a variant that does not compile or launch: reported, sweep goes on
            rec.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:200]}")
            if want is None:
                raise
        records.append(rec)
    return records


def compile_us(op, case, opts):
    """torch.compile of the eager expression, specialised to this case's shapes and layouts."""
    try:
        return benchmark_kernel(torch.compile(op.eager, dynamic=False), *case.args, warmup=opts.warmup,
                                iters=opts.iters) * 1e3
    except Exception as exc:  # the baseline is a reference point: its failure must not end the sweep
        print(f"  torch.compile failed: {type(exc).__name__}: {str(exc)[:150]}")
        return None


def _cfg(v) -> str:
    c = v.get("config", {})
    return f"R{c.get('R', '-')} W{c.get('W', '-')}" + (f" C{c['C']}" if v["variant"].startswith("c") else "")


def summarize(rec, copy_rows) -> str:
    """Adds the summary fields to rec; -> its line of the printed table."""
    timed = [v for v in rec["variants"] if "us" in v]
    default = rec["variants"][0]
    best = min(timed, key=lambda v: v["us"])
    pct = lambda us: 100 * rec["bytes_moved"] / (us * 1e-6) / 1e9 / rec["copy_gbs"]
    rec.update(default_us=default.get("us"), best=best["variant"], best_us=best["us"], best_config=best.get("config"),
               bad=[v["variant"] for v in rec["variants"] if not v.get("ok")],
               pct_of_copy=dict(default=pct(default["us"]), best=pct(best["us"])))
    row = (f"{rec['op'][:20]:20s} {rec['width']:5d}{'s' if rec['strided'] else ' '} {rec['rows']:5d} | "
           f"{_cfg(default):12s} {default['us']:7.2f} | {best['variant']:7s} {_cfg(best):12s} {best['us']:7.2f} | ")
    row += f"{rec['compile_us']:7.2f}" if rec.get("compile_us") else f"{'-':>7s}"
    if rec["rows"] == copy_rows:
        row += f" | {rec['pct_of_copy']['default']:3.0f}% -> {rec['pct_of_copy']['best']:3.0f}%"
    return row + (f"  BAD: {','.join(rec['bad'])}" if rec["bad"] else "")


HEADER = (f"{'op':20s} {'width':6s} {'rows':>5s} | {'default':12s} {'us':>7s} | {'best':7s} {'config':12s} "
          f"{'us':>7s} | {'compile':>7s} | % of copy (at the largest rows)")


def _us(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def markdown(results) -> str:
    lines = [f"# Tiling sweep\n\n{results['environment']}; copy bandwidth {results['copy_gbs']:.0f} GB/s; "
             f"{results['seconds']:.0f}s\n", "R = rows a program, W = warps, C = row elements of a tile. "
             "Times in us (CUDA-graph replay medians).\n",
             "| op | shape | rows | default | us | best | config | us | compile us | % copy default | % copy best | BAD |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    shape = lambda r: f"{r['op']} | {r['width']}{' strided' if r['strided'] else ''} | {r['rows']}"
    for r in results["cases"]:
        best = dict(variant=r["best"], config=r["best_config"])
        lines.append(f"| {shape(r)} | {_cfg(r['variants'][0])} | {_us(r['default_us'])} | {r['best']} | {_cfg(best)} | "
                     f"{_us(r['best_us'])} | {_us(r['compile_us'])} | {r['pct_of_copy']['default']:.0f}% | "
                     f"{r['pct_of_copy']['best']:.0f}% | {', '.join(r['bad'])} |")
    lines += ["\n## Every variant (us; = X: same config as X, not timed again; BAD: mismatch; ERR: failed)\n", "| op | shape | rows | variants |",
              "|---|---|---|---|"]
    for r in results["cases"]:
        cells = [f"{v['variant']} {_cfg(v)} " + (_us(v["us"]) if "us" in v else f"= {v['same_as']}" if "same_as" in v
                 else "ERR" if "error" in v else "BAD") for v in r["variants"]]
        lines.append(f"| {shape(r)} | {' · '.join(cells)} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="sweep_results", help="folder for sweep_tiling.json and sweep_tiling.md")
    parser.add_argument("--smoke", action="store_true", help="CPU + TRITON_INTERPRET=1: rows 1 and 7, no compile")
    parser.add_argument("--ops", nargs="*", help="only these ops (default: all)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=50)
    opts = parser.parse_args()
    if unknown := set(opts.ops or ()) - {name for name, _, _ in SWEEP}:
        parser.error(f"unknown op(s) {sorted(unknown)}")
    device = torch.device("cpu" if opts.smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1)")
    if backend_for(device) != "triton":
        parser.error(f"the Triton kernels do not run on {device} here (set TRITON_INTERPRET=1 for --smoke)")
    rows_grid, opts.tile_rows, opts.warps = ((1, 7), (7,), (4,)) if opts.smoke else ((1, 64, 256, 4096), (256, 4096),
                                                                                     (1, 2, 4, 8, 16))
    if opts.smoke:
        opts.warmup, opts.iters, opts.no_compile = 1, 3, True
    raise_recompile_limit()  # every case compiles on its own (dynamic=False)
    started = time.perf_counter()
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"{platform.processor() or 'cpu'} (interpreter)"
    # CPU smoke run: a 64 MiB copy, a rough figure only for the arithmetic
    copy_gbs = device_copy_gbs(device) if device.type == "cuda" else device_copy_gbs(device, 64 << 20)
    results = dict(environment=f"{name}; torch {torch.__version__}", copy_gbs=copy_gbs, cases=[])
    ops = {op.name: op for op in OPS}
    print(f"{results['environment']}; copy {results['copy_gbs']:.0f} GB/s\n{HEADER}")
    for op_name, module_name, shapes in SWEEP:
        if opts.ops and op_name not in opts.ops:
            continue
        op, module = ops[op_name], importlib.import_module(f"nanovllm.kernels.{module_name}")
        for width, strided in shapes:
            for rows in rows_grid:
                torch.manual_seed(0)
                case = op.make(rows, width, torch.bfloat16, device, strided)
                rec = dict(op=op_name, width=width, strided=strided, rows=rows, bytes_moved=case.bytes_moved,
                           copy_gbs=results["copy_gbs"], variants=sweep_case(op, module, case, rows, opts),
                           compile_us=None if opts.no_compile else compile_us(op, case, opts))
                print(summarize(rec, rows_grid[-1]), flush=True)
                results["cases"].append(rec)
    results["seconds"] = time.perf_counter() - started
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep_tiling.json").write_text(json.dumps(results, indent=1))
    (out / "sweep_tiling.md").write_text(markdown(results))
    bad = sum(len(r["bad"]) for r in results["cases"])
    print(f"{len(results['cases'])} cases, {bad} BAD variant(s), {results['seconds']:.0f}s; results in {out}/")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
