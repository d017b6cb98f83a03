"""Property tests of the scheduler and block manager on random workloads, with a fake model
that samples random tokens: every request ends with the right number of tokens, nothing is
lost or duplicated, no block leaks and every reference count returns to zero; with each step
recorded at once, and pipelined as generate() runs them (step N + 1 scheduled and launched
before step N's tokens are recorded)."""
import random
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import PLACEHOLDER, Sequence
from nanovllm.sampling_params import SamplingParams

EOS = 0


def make_scheduler(num_blocks, block_size, max_num_seqs, max_num_batched_tokens, prefix_caching, max_model_len):
    config = SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             kvcache_block_size=block_size, enable_prefix_caching=prefix_caching,
                             max_model_len=max_model_len)
    return Scheduler(config, [EOS], num_blocks)


def check_invariants(scheduler: Scheduler) -> None:
    manager = scheduler.block_manager
    holders = {}
    for seq in scheduler.running:
        assert len(seq.block_table) * manager.block_size >= seq.num_computed_tokens
        for block_id in seq.block_table:
            holders[block_id] = holders.get(block_id, 0) + 1
    for seq in scheduler.waiting:
        assert seq.block_table == [] and seq.num_computed_tokens == 0
    for block in manager.blocks:
        assert block.ref_count == holders.get(block.block_id, 0)
        assert (block.ref_count == 0) == (block.block_id in manager.free_block_ids)
        assert PLACEHOLDER not in block.token_ids  # a cached block holds only tokens the host has seen


def check_batch(scheduler: Scheduler, batch) -> None:
    assert len(batch) <= scheduler.max_num_seqs
    assert sum(batch.num_new_tokens) <= scheduler.max_num_batched_tokens
    assert len({seq.request_id for seq in batch.seqs}) == len(batch)
    for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
        assert 1 <= num_new <= seq.num_uncomputed_tokens()
        assert len(seq.block_table) * scheduler.block_manager.block_size >= seq.num_computed_tokens + num_new
        # Only a decode may take its input from a step in flight (on the device).
        chunk = seq.token_ids[seq.num_computed_tokens:seq.num_computed_tokens + num_new]
        assert num_new == 1 or PLACEHOLDER not in chunk


def fake_tokens(batch, rng) -> list[int]:
    return [rng.randrange(1, 50) if rng.random() > 0.03 else EOS for _ in batch.sample_rows]


def run_step(scheduler, batch, tokens) -> list[Sequence]:
    """Launches and records one batch; returns the sequences that finished."""
    scheduler.launched(batch)
    return [seq for seq, _ in scheduler.postprocess(batch, tokens) if seq.is_finished]


workloads = st.fixed_dictionaries({
    "seed": st.integers(0, 10**6),
    "block_size": st.sampled_from([1, 2, 4, 8, 16]),
    "extra_blocks": st.integers(0, 40),
    "max_num_seqs": st.integers(1, 8),
    "max_num_batched_tokens": st.integers(1, 64),
    "prefix_caching": st.booleans(),
    "num_requests": st.integers(1, 12),
    "abort_rate": st.sampled_from([0.0, 0.05, 0.2]),
    "pipelined": st.booleans(),
})


@settings(max_examples=500, deadline=None)
@given(workloads)
def test_random_workloads_finish_without_leaks(w):
    rng = random.Random(w["seed"])
    max_model_len = 48
    num_blocks = -(-max_model_len // w["block_size"]) + w["extra_blocks"]
    scheduler = make_scheduler(num_blocks, w["block_size"], w["max_num_seqs"], w["max_num_batched_tokens"],
                               w["prefix_caching"], max_model_len)
    shared_prefix = [rng.randrange(1, 50) for _ in range(40)]
    seqs = {}
    for request_id in range(w["num_requests"]):
        if rng.random() < 0.4:  # prompts that are prefixes of one another: blocks shared, and duplicated when concurrent
            prompt = shared_prefix[:rng.randint(1, 40)]
        else:
            prompt = shared_prefix[:rng.randrange(0, 20)] + [rng.randrange(1, 50) for _ in range(rng.randint(1, 20))]
        params = SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=rng.random() < 0.5)
        seqs[request_id] = Sequence(request_id, prompt, params)
        scheduler.add(seqs[request_id])
    finished, aborted, steps, in_flight = set(), set(), 0, None
    while not scheduler.is_finished() or in_flight:
        steps += 1
        assert steps < 10_000, "scheduler made no progress"
        batch = scheduler.schedule() if not scheduler.is_finished() else None
        assert batch or in_flight, "an empty step with nothing in flight"
        if batch:
            check_batch(scheduler, batch)
            scheduler.launched(batch)
        previous, in_flight = (in_flight, batch or None) if w["pipelined"] else (batch, None)
        if previous:
            for seq, position in scheduler.postprocess(previous, fake_tokens(previous, rng)):
                # Steps are recorded in order: only later steps' placeholders follow the token.
                assert PLACEHOLDER not in seq.token_ids[:position + 1]
                assert all(t == PLACEHOLDER for t in seq.token_ids[position + 1:])
                if seq.is_finished:
                    assert seq.request_id not in finished
                    finished.add(seq.request_id)
        check_invariants(scheduler)
        if rng.random() < w["abort_rate"] and (scheduler.running or scheduler.waiting):
            victim = rng.choice([*scheduler.running, *scheduler.waiting])
            assert scheduler.abort(victim.request_id) is victim
            aborted.add(victim.request_id)
            check_invariants(scheduler)
    assert finished | aborted == set(seqs) and not finished & aborted
    for request_id in finished:
        seq = seqs[request_id]
        assert PLACEHOLDER not in seq.token_ids
        assert 1 <= seq.num_output_tokens <= seq.params.max_tokens
        if seq.finish_reason == "length":
            assert seq.num_output_tokens == seq.params.max_tokens or len(seq) == max_model_len
        else:
            assert seq.finish_reason == "stop" and not seq.params.ignore_eos and seq.token_ids[-1] == EOS
    manager = scheduler.block_manager
    assert manager.num_free_blocks == num_blocks
    assert all(block.ref_count == 0 for block in manager.blocks)


def test_preemption_keeps_generated_tokens_and_recomputes():
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                               prefix_caching=False, max_model_len=16)
    a = Sequence(0, [1, 2, 3, 4, 5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))
    b = Sequence(1, [9, 8, 7, 6, 5, 4, 3], SamplingParams(max_tokens=8, ignore_eos=True))
    scheduler.add(a)
    scheduler.add(b)
    rng = random.Random(0)
    while scheduler.num_preemptions == 0:
        batch = scheduler.schedule()
        run_step(scheduler, batch, fake_tokens(batch, rng))
    assert b in scheduler.waiting and b.num_output_tokens > 0 and b.num_computed_tokens == 0
    generated = b.token_ids[b.num_prompt_tokens:]
    while not scheduler.is_finished():
        batch = scheduler.schedule()
        run_step(scheduler, batch, fake_tokens(batch, rng))
    assert b.token_ids[b.num_prompt_tokens:][:len(generated)] == generated and b.num_output_tokens == 8


def test_prefix_cache_hit_requires_equal_tokens(monkeypatch):
    """Two different blocks with the same hash (a forced collision) must not be shared."""
    import nanovllm.engine.block_manager as bm
    monkeypatch.setattr(bm, "chain_hash", lambda tokens, prefix: 1234)
    scheduler = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                               prefix_caching=True, max_model_len=16)
    first = Sequence(0, [1, 2, 3, 4, 5], SamplingParams(max_tokens=1))
    scheduler.add(first)
    batch = scheduler.schedule()
    run_step(scheduler, batch, [7])
    second = Sequence(1, [4, 3, 2, 1, 5], SamplingParams(max_tokens=1))
    scheduler.add(second)
    scheduler.schedule()
    assert scheduler.block_manager.prefix_cache_hit_blocks == 0 and second.num_computed_tokens == 0
    third = Sequence(2, [1, 2, 3, 4, 6], SamplingParams(max_tokens=1))
    scheduler.add(third)
    scheduler.schedule()
    assert scheduler.block_manager.prefix_cache_hit_blocks == 1 and third.num_computed_tokens == 4
