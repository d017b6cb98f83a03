"""Failures and teardown of a tensor-parallel engine (tensor_parallel_size=2 on CPU processes):
a rank that raises or is killed makes the user's call raise, never hang, and close() leaves no
process behind; two engines run one after the other in one process; the worker ranks end with
the engine's process, whether it exits without close() or is killed."""
import gc
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from parallel_testing import ENGINE, TIMEOUT_S, alive, call_with_timeout, child_pids
from nanovllm import LLM, SamplingParams
from nanovllm.engine import llm_engine
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.worker import WorkerError

PROMPTS = [[5, 17, 3, 99, 42] * 4, [200, 201, 7]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


class RaisingRank(ModelRunner):
    """Rank 1 raises in its third step."""

    def run_step(self, step, seqs=None):
        self.steps = getattr(self, "steps", 0) + 1
        if self.rank == 1 and self.steps == 3:
            raise RuntimeError("injected failure on rank 1")
        super().run_step(step, seqs)


class KilledRank(ModelRunner):
    """Rank 1 is killed in its third step."""

    def run_step(self, step, seqs=None):
        self.steps = getattr(self, "steps", 0) + 1
        if self.rank == 1 and self.steps == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        super().run_step(step, seqs)


class RaisingAtStart(ModelRunner):
    """Rank 1 raises while it builds its shard."""

    def _build(self):
        if self.rank == 1:
            raise RuntimeError("injected failure at start")
        super()._build()


def tokens(llm) -> list[list[int]]:
    return [o["token_ids"] for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def expected(checkpoint):
    return tokens(LLM(str(checkpoint), **ENGINE))


@pytest.mark.parametrize("runner, message", [(RaisingRank, "RuntimeError: injected failure on rank 1"),
                                             (KilledRank, "tensor-parallel rank 1 exited with code -9")],
                         ids=["raises", "killed"])
def test_failed_rank_raises_in_the_users_call(checkpoint, monkeypatch, runner, message):
    monkeypatch.setattr(llm_engine, "ModelRunner", runner)  # rank 0's class: its ranks build the same
    llm = LLM(str(checkpoint), tensor_parallel_size=2, **ENGINE)
    pids = [process.pid for process in llm.model_runner.workers.processes]
    error = call_with_timeout(llm.generate, PROMPTS, PARAMS, False)
    assert isinstance(error, WorkerError) and message in str(error)
    assert call_with_timeout(llm.generate, PROMPTS, PARAMS, False) is error  # the engine stays failed
    llm.close()
    assert not any(alive(pid) for pid in pids) and not child_pids()


def test_failed_start_raises_and_leaves_nothing(checkpoint, monkeypatch):
    monkeypatch.setattr(llm_engine, "ModelRunner", RaisingAtStart)
    error = call_with_timeout(LLM, str(checkpoint), **ENGINE, tensor_parallel_size=2)
    assert isinstance(error, WorkerError) and "RuntimeError: injected failure at start" in str(error)
    assert not child_pids()


def test_too_small_cache_on_every_rank_is_a_value_error(checkpoint):
    """Every rank raises it: rank 0's own error, naming the argument, is the one raised."""
    error = call_with_timeout(LLM, str(checkpoint), **{**ENGINE, "num_kvcache_blocks": 2}, tensor_parallel_size=2)
    assert isinstance(error, ValueError) and "num_kvcache_blocks" in str(error)
    assert not child_pids()


def test_engines_one_after_another(checkpoint, expected):
    with LLM(str(checkpoint), tensor_parallel_size=2, **ENGINE) as llm:
        assert tokens(llm) == expected
    with pytest.raises(RuntimeError, match="closed"):
        tokens(llm)
    llm = LLM(str(checkpoint), tensor_parallel_size=2, **ENGINE)
    assert tokens(llm) == expected
    pids = [process.pid for process in llm.model_runner.workers.processes]
    del llm  # no close(): collecting the engine stops its ranks
    gc.collect()
    assert not any(alive(pid) for pid in pids) and not child_pids()
    assert tokens(LLM(str(checkpoint), **ENGINE)) == expected  # the process is single-rank again


ENGINE_PROCESS = """
import json, os, signal, sys, torch
from nanovllm import LLM
torch.set_num_threads(1)
llm = LLM(sys.argv[1], tensor_parallel_size=2, **json.loads(sys.argv[2]))
print(json.dumps([process.pid for process in llm.model_runner.workers.processes]), flush=True)
if sys.argv[3] == "killed":
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("end", ["exits", "killed"])
def test_ranks_end_with_the_engines_process(checkpoint, end):
    """Exiting without close() runs it; a killed engine process leaves its ranks reading EOF."""
    done = subprocess.run([sys.executable, "-c", ENGINE_PROCESS, str(checkpoint), json.dumps(ENGINE), end],
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == (0 if end == "exits" else -signal.SIGKILL), done.stderr
    pids = json.loads(done.stdout.splitlines()[-1])
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(pid) for pid in pids)


def test_abort_that_does_not_return_is_left_to_its_thread(monkeypatch):
    """NCCL's abort after a lost rank may never return (its cleanup waits for the lost peer):
    destroy(abort=True) waits ABORT_WAIT_S for it, and a new group in this process is refused,
    with a clear error, until it has returned."""
    import threading

    import torch.distributed as dist

    from nanovllm import distributed
    release = threading.Event()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda: "nccl")
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", lambda: release.wait(TIMEOUT_S))
    monkeypatch.setattr(distributed, "ABORT_WAIT_S", 0.2)
    started = time.monotonic()
    distributed.destroy(abort=True)
    assert 0.2 <= time.monotonic() - started < 5 and distributed.rank_and_size() == (0, 1)
    with pytest.raises(RuntimeError, match="start another tensor-parallel engine in a new process"):
        distributed.init(0, 2, torch.device("cpu"))
    distributed.destroy(abort=True)  # a second teardown does not abort again
    release.set()
    distributed._abandoned.join(TIMEOUT_S)
    assert not distributed.abort_pending()
