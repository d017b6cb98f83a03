"""benchmarks/bench_serving.py against the tiny server: a handful of requests, a fixed
concurrency and Poisson arrivals, every number of the report filled in."""
from benchmarks.bench_serving import main

SIZES = ["--num-prompts", "6", "--min-input-len", "4", "--max-input-len", "16", "--min-output-len", "4",
         "--max-output-len", "8", "--vocab-size", "320"]


def test_bench_serving_reports_every_request(server, tmp_path):
    result = main(["--base-url", server.url, *SIZES, "--max-concurrency", "2", "--request-rate", "inf,40",
                   "--out", str(tmp_path)])
    from nanovllm.entrypoints.bench import make_workload
    from benchmarks.bench_serving import parse_args
    _, params = make_workload(parse_args(SIZES))
    assert result["model"] == "tiny" and len(result["runs"]) == 2
    for run in result["runs"]:
        assert (run["completed"], run["failed"]) == (6, 0), run["errors"]
        assert run["total_output_tokens"] == sum(p.max_tokens for p in params)
        assert run["output_throughput"] > 0
        assert run["p50_ttft_ms"] <= run["p99_ttft_ms"] <= run["p99_e2el_ms"]
        assert run["p50_tpot_ms"] > 0 and run["p50_itl_ms"] > 0
    assert [run["request_rate"] for run in result["runs"]] == ["inf", 40.0]
    assert (tmp_path / "bench_serving.json").stat().st_size > 0
    assert (tmp_path / "bench_serving.png").stat().st_size > 0
