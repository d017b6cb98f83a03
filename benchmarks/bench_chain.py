"""The cost of a kernel boundary in a chain of dependent kernels, as a batch-1 decode step
runs them: each kernel's programs read the whole vector the kernel before wrote (as a GEMV
reads its input row), add it up, and write their share of the next vector. No weights, no
arithmetic to speak of: what is left is the launch, the wait for the previous kernel to end,
one round trip for the input, the store and the end. Times a CUDA graph of `--links` such
kernels, with and without programmatic dependent launch (launch.py), for several grid sizes,
and divides by the links. A decode step's dependent kernels cost at least this much each
(docs/performance.md#decode-latency).

    python -m benchmarks.bench_chain --out DIR
"""
import argparse
import json
import statistics
from pathlib import Path

import torch
import triton
import triton.language as tl

from nanovllm.kernels.launch import await_previous_kernel, dependent_launch
from nanovllm.utils import timing

WIDTH = 1024  # Qwen3-0.6B's hidden size: the vector each link reads


@triton.jit
def _link_kernel(src_ptr, dst_ptr, WIDTH: tl.constexpr, SHARE: tl.constexpr, PDL: tl.constexpr):
    await_previous_kernel(PDL)
    total = tl.sum(tl.load(src_ptr + tl.arange(0, WIDTH)).to(tl.float32), axis=0)
    offs = tl.program_id(0) * SHARE + tl.arange(0, SHARE)
    # (total mod 7) + the index keeps every value small and exact in fp32, and makes each
    # output depend on the whole input
    tl.store(dst_ptr + offs, (total - 7.0 * tl.floor(total / 7.0) + offs).to(dst_ptr.dtype.element_ty),
             mask=offs < WIDTH)


def link(src: torch.Tensor, dst: torch.Tensor, programs: int, pdl: bool) -> None:
    """dst[i] = (sum(src) mod 7) + i, src and dst WIDTH long, by about `programs` programs (each
    a power-of-two share of dst)."""
    share = triton.next_power_of_2(triton.cdiv(WIDTH, programs))
    options = dependent_launch(src.get_device()) if pdl else {"PDL": False, "launch_pdl": False}
    _link_kernel[(triton.cdiv(WIDTH, share),)](src, dst, WIDTH=WIDTH, SHARE=share, num_warps=4, **options)


def chain(buffers: list[torch.Tensor], links: int, programs: int, pdl: bool) -> None:
    for i in range(links):
        link(buffers[i % 2], buffers[(i + 1) % 2], programs, pdl)


def time_link_us(links: int, programs: int, pdl: bool, replays: int) -> float:
    buffers = [torch.zeros(WIDTH, device="cuda") for _ in range(2)]
    graph, _ = timing.capture(lambda: chain(buffers, links, programs, pdl))
    return statistics.median(timing.time_events(graph.replay) for _ in range(replays)) * 1e3 / links


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--links", type=int, default=200)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--programs", type=int, nargs="+", default=[8, 128, 256, 1024])
    args = parser.parse_args()
    rows = [{"programs": programs, "pdl": pdl, "us_per_link": time_link_us(args.links, programs, pdl, args.replays)}
            for programs in args.programs for pdl in (True, False)]
    for row in rows:
        print(f"{row['programs']:5d} programs, PDL {'on ' if row['pdl'] else 'off'}: {row['us_per_link']:.2f} us a link")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "links": args.links, "width": WIDTH, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_chain.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
