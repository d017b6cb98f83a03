"""benchmarks/bench_latency.py: its decode driver on a tiny CPU engine (sequences seated with
their context cached, steps pipelined as in LLM.generate, everything freed after) and its
cutting of a profiler trace into decode steps."""
import pytest

from benchmarks import bench_latency
from nanovllm import LLM
from nanovllm.engine.sequence import PLACEHOLDER


@pytest.fixture(scope="module")
def llm():
    return LLM(bench_latency.model_dir("qwen3-tiny"), load_format="dummy", device="cpu", max_model_len=512,
               max_num_seqs=4, kvcache_block_size=16, enable_prefix_caching=False)


def test_seated_sequences_decode_one_token_a_step(llm):
    manager = llm.scheduler.block_manager
    free = manager.num_free_blocks
    seqs = bench_latency.seat(llm, 3, 40, max_tokens=100)
    assert manager.num_free_blocks == free - 3 * 3  # 40 tokens: 3 blocks of 16 each
    arrivals, waits = bench_latency.run_steps(llm, 5)
    assert len(arrivals) == 5 and arrivals == sorted(arrivals)
    assert len(waits) == 5 and all(w >= 0 for w in waits)
    for seq in seqs:
        assert len(seq.token_ids) == 45 and seq.num_computed_tokens == 44 and PLACEHOLDER not in seq.token_ids
        llm.abort(seq.request_id)
    assert manager.num_free_blocks == free and not llm.scheduler.running


def test_decode_case_times_the_steps_and_frees_its_blocks(llm):
    free = llm.scheduler.block_manager.num_free_blocks
    case = bench_latency.decode_case(llm, 2, 100, warmup=1, steps=3, step_room=8)
    assert case["step_ms"] > 0 and case["step_ms_median"] > 0 and case["mean_keys"] == 100 + 1 + 2
    assert 0 <= case["wait_ms"] <= case["step_ms_median"] * 3
    assert llm.scheduler.block_manager.num_free_blocks == free and not llm.scheduler.running
    assert "skipped" in bench_latency.decode_case(llm, 4, 510, warmup=1, steps=3, step_room=8)  # > max_model_len
    floor = bench_latency.add_floor(case, weights=1000, kv_per_key=10, copy_gbs=1.0)
    assert floor["kv_bytes"] == 2 * 103 * 10
    assert floor["floor_ms"] == pytest.approx((1000 + 2060) / 1e9 * 1e3)


def _event(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_a_trace_is_cut_where_the_tokens_go_out():
    """Two steps framed by three kernels publishing tokens; in the first, kernel b starts
    before a ends (programmatic dependent launch) and a 5 us gap precedes c."""
    out = bench_latency.TOKENS_OUT
    trace = {"traceEvents": [
        _event("kernel", out, 0, 1),
        _event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 3, 1),
        _event("kernel", "a", 4, 10),
        _event("kernel", "b", 12, 4),
        _event("cpu_op", "aten::linear", 0, 100),  # host events are not GPU activity
        _event("kernel", "c", 21, 2),
        _event("kernel", out, 23, 1),
        _event("kernel", "a", 24, 10),
        _event("kernel", out, 34, 2),
    ]}
    first, second = bench_latency.decode_steps(bench_latency.gpu_activity(trace))
    assert (first["step_us"], first["kernels"], first["kernel_us"]) == (23, 4, 17)
    assert first["busy_us"] == 1 + 12 + 2 + 1  # the copy, a and b together, c, the tokens' kernel
    assert first["gap_us"] == 23 - 16 and first["gaps"] == 2
    assert first["largest_gaps"][0] == {"us": 5, "after": "b", "before": "c"}
    assert first["largest_gaps"][1]["after"] == "(previous step)"
    assert first["kernel_us_by_name"] == {"a": 10, "b": 4, "c": 2, out: 1}
    assert (second["step_us"], second["kernels"], second["gap_us"]) == (12, 2, 0)
