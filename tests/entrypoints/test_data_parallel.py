"""A server of two engine replicas (--data-parallel-size 2): greedy outputs equal LLM.generate()'s,
concurrent requests spread over both, an HTTP request's choices share a replica, a client that
leaves frees its replica's blocks, a killed replica fails its requests and the server's health
until it is restarted, and no process outlives the server. The balancing rule itself is checked
without processes; on two GPUs, each replica starts on its own GPU."""
import asyncio
import contextlib
import json
import os
import signal
from pathlib import Path

import httpx
import pytest

import torch

from distributed.parallel_testing import child_pids
from servers import ENGINE_ARGS, MODEL_NAME, TIMEOUT, RunningServer, wait_until

# Long enough that the requests run for a second or more, so they are in flight when checked.
LONG_ARGS = {"data_parallel_size": 2, "max_model_len": 1024, "num_kvcache_blocks": 512}
LONG = {"prompt": [3, 4, 5, 6], "max_tokens": 1016, "ignore_eos": True, "temperature": 1.0, "stream": True,
        "return_token_ids": True}


def start_server(checkpoint) -> tuple[RunningServer, set[int]]:
    server = RunningServer(checkpoint, LONG_ARGS).start()
    return server, {process.pid for process in server.engine.processes}


def stop_server(server: RunningServer, pids: set[int]) -> None:
    server.stop()
    assert not pids & child_pids(), "a replica outlived the server"


@pytest.fixture(scope="module")
def server(chat_checkpoint):
    running, pids = start_server(chat_checkpoint)
    assert len(pids) == 2
    yield running
    stop_server(running, pids)


def idle(server: RunningServer):
    stats = server.metrics()
    return (stats["nanovllm:num_requests_running"] == stats["nanovllm:num_requests_waiting"] == 0
            and stats["nanovllm:kv_cache_usage_perc"] == 0 and stats)


@contextlib.contextmanager
def streaming(http: httpx.Client, **more):
    """A streamed completion's lines, once its first data chunk has arrived; leaving closes it."""
    with http.stream("POST", "/v1/completions", json={**LONG, **more}) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        yield lines


PROMPTS = ["The quick brown fox", "A river runs", "Once upon a time", "Seven", "hello hello", "x y z"]


def async_client(server: RunningServer):
    import openai  # as in conftest's client: only the tests that talk to a server need it
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


def greedy_outputs(server: RunningServer, prompts: list[str]) -> list:
    """The prompts' temperature-0 completions of 20 tokens, sent at once."""
    async def main():
        async with async_client(server) as client:
            return await asyncio.gather(*(client.completions.create(
                model=MODEL_NAME, prompt=p, max_tokens=20, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True}) for p in prompts))

    return asyncio.run(main())


def test_greedy_completions_equal_llm_generate(server, llm):
    from nanovllm import SamplingParams
    expected = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    outputs = greedy_outputs(server, PROMPTS)
    assert [o.choices[0].model_extra["token_ids"] for o in outputs] == [e["token_ids"] for e in expected]
    assert [o.choices[0].text for o in outputs] == [e["text"] for e in expected]


def test_concurrent_streams_spread_over_both_replicas(server, monkeypatch):
    served = [0, 0]
    for index, replica in enumerate(server.engine.replicas):
        def counted(*args, add=replica.add, index=index):
            served[index] += 1
            return add(*args)
        monkeypatch.setattr(replica, "add", counted)
    before = server.metrics()

    async def one(client, i):
        prompt = [3 + i, 4, 5 + i]
        stream = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=1.0,
                                                 seed=i, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True, "return_token_ids": True})
        tokens, usage = [], None
        async for chunk in stream:
            for choice in chunk.choices:
                tokens += choice.model_extra["token_ids"]
            usage = chunk.usage or usage
        return prompt, tokens, usage

    async def main():
        async with async_client(server) as client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    for prompt, tokens, usage in asyncio.run(main()):
        assert len(tokens) == usage.completion_tokens == 24 and usage.prompt_tokens == len(prompt)
    assert sum(served) == 16 and min(served) > 0, served
    after = wait_until(lambda: idle(server), timeout=5, what="both replicas to be idle")
    assert after["nanovllm:generation_tokens_total"] - before.get("nanovllm:generation_tokens_total", 0) == 16 * 24


def test_choices_share_a_replica_and_a_client_that_leaves_frees_its_blocks(server):
    """Request A runs on replica 0, then B's two choices on replica 1 (fewest in flight). B's
    client leaves: its aborts reach replica 1, which ends empty, while A runs to its end."""
    first, second = server.engine.replicas
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http, streaming(http) as a_lines:
        assert (len(first.requests), len(second.requests)) == (1, 0)
        with streaming(http, n=2):
            assert (len(first.requests), len(second.requests)) == (1, 2)
            assert [s.replica for s in second.requests.values()] == [1, 1]
        wait_until(lambda: not second.requests and second.stats["kv_blocks_used"] == 0,
                   timeout=5, what="replica 1 to drop the choices")
        assert len(first.requests) == 1 and first.stats["kv_blocks_used"] > 0
        events = [line for line in a_lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and '"finish_reason":"length"' in events[-2]
    wait_until(lambda: idle(server), timeout=5, what="the KV cache to be empty")


def test_a_killed_replica_fails_its_requests_and_the_servers_health_until_it_restarts(chat_checkpoint):
    server, pids = start_server(chat_checkpoint)
    try:
        first, second = server.engine.replicas
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http, streaming(http) as a_lines:
            with streaming(http) as b_lines:
                assert (len(first.requests), len(second.requests)) == (1, 1)
                os.kill(second.process.pid, signal.SIGKILL)
                events = [line for line in b_lines if line.startswith("data: ")]
            error = json.loads(events[-2].removeprefix("data: "))["error"]
            assert events[-1] == "data: [DONE]" and error["type"] == "server_error"
            assert "exit code -9" in error["message"]
            assert http.get("/health").status_code == 503
            refused = http.post("/v1/completions", json={**LONG, "stream": False})
            assert refused.status_code == 503 and "exit code -9" in refused.json()["error"]["message"]
            # the other replica's request runs to its end
            events = [line for line in a_lines if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]" and '"finish_reason":"length"' in events[-2]
            # then the killed replica is back, in a new process
            wait_until(lambda: http.get("/health").status_code == 200, what="the replica to restart")
            assert second.restarts == 1 and second.process.pid not in pids
            assert http.post("/v1/completions", json={**LONG, "stream": False, "max_tokens": 4}).status_code == 200
    finally:
        stop_server(server, pids)


# --- the dispatch rule, without processes ------------------------------------------------------
class Sent(list):
    """Stands in for a replica's socket: the messages sent to it."""

    def __call__(self, message):
        self.append(message)


def engine_without_processes(replicas: int):
    from nanovllm.entrypoints.engine_loop import DataParallelEngine
    engine = DataParallelEngine("unused", {"data_parallel_size": replicas}, metrics=None)
    for replica in engine.replicas:
        replica._send = Sent()
    return engine


def test_each_http_request_goes_whole_to_the_least_loaded_replica():
    engine = engine_without_processes(3)
    events = [asyncio.Event() for _ in range(5)]
    # event 0 is a request of two choices, the others of one each
    states = [engine.add([1, 2], None, e) for e in (events[0], events[0], *events[1:])]
    assert [s.replica for s in states] == [0, 0, 1, 2, 1, 2]
    assert [s.request_id for s in states] == [0, 1, 0, 0, 1, 1]  # ids count per replica
    engine.abort([states[0], states[1], states[3]])
    assert [r._send[-1] for r in engine.replicas] == [("abort", [0, 1]), ("add", 1, [1, 2], None),
                                                      ("abort", [0])]
    assert engine.add([1], None, asyncio.Event()).replica == 0  # now the emptiest
    assert engine.num_waiting == 4


def test_a_request_weighs_its_prompt_and_max_tokens():
    """One long request on replica 0 outweighs two short ones on replica 1, which takes the next."""
    from nanovllm import SamplingParams
    engine = engine_without_processes(2)
    long, short = SamplingParams(max_tokens=1000), SamplingParams(max_tokens=10)
    states = [engine.add([1] * 100, long, asyncio.Event())] + [engine.add([1] * 10, short, asyncio.Event())
                                                               for _ in range(2)]
    assert [s.replica for s in states] == [0, 1, 1]


def test_stats_sum_the_replicas():
    engine = engine_without_processes(2)
    for used, replica in ((3, engine.replicas[0]), (5, engine.replicas[1])):
        replica.stats = {"num_running": used, "num_waiting": 1, "kv_blocks_used": used, "kv_blocks_total": 10,
                         "kv_block_size": 16, "prefix_cache_hit_blocks": used, "num_preemptions": 1}
    assert engine.stats == {"num_running": 8, "num_waiting": 2, "kv_blocks_used": 8, "kv_blocks_total": 20,
                            "kv_block_size": 16, "prefix_cache_hit_blocks": 8, "num_preemptions": 2}


def test_settings_are_checked_before_any_replica_starts(chat_checkpoint):
    from nanovllm.entrypoints.engine_loop import DataParallelEngine
    engine = DataParallelEngine(str(chat_checkpoint), {"data_parallel_size": 2, "max_model_len": 0}, metrics=None)
    told = []
    engine.on_fatal = told.append
    asyncio.run(engine.start())
    assert told == ["the engine failed to start: ValueError: max_model_len: must be at least 1, got 0"]
    assert engine.error == told[0] and not engine.ready and engine.processes == [None, None]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_each_replica_starts_on_its_own_gpu(chat_checkpoint):
    from nanovllm import LLM, SamplingParams
    engine_args = {"device": "cuda", "enforce_eager": False}
    with LLM(str(chat_checkpoint), **{**ENGINE_ARGS, **engine_args}) as llm:
        expected = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                                use_tqdm=False)
    server = RunningServer(chat_checkpoint, {**engine_args, "data_parallel_size": 2}).start()
    pids = [process.pid for process in server.engine.processes]
    try:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(torch.cuda.device_count()))))
        environments = [Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") for pid in pids]
        assert [next(v for v in env if v.startswith(b"CUDA_VISIBLE_DEVICES=")).split(b"=")[1].decode()
                for env in environments] == visible.split(",")[:2]
        outputs = greedy_outputs(server, PROMPTS)
        assert [o.choices[0].model_extra["token_ids"] for o in outputs] == [e["token_ids"] for e in expected]
    finally:
        stop_server(server, set(pids))
