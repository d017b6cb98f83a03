"""Clients that leave: streams closed a few chunks in and non-streamed requests dropped midway,
over a hundred times. Each engine request is aborted and the KV cache ends empty."""
import asyncio
import random

import httpx
import pytest

from servers import RunningServer, wait_until

DROPS = 60  # of each kind
CONCURRENCY = 16
# Far more than any request gets before its client leaves (prompt + output fill the server's
# max_model_len): requests that were not aborted would hold blocks for seconds after the last
# client left, and a non-streamed one cannot finish before its client's timeout.
MAX_TOKENS = 1016


@pytest.fixture(scope="module")
def server(chat_checkpoint):
    running = RunningServer(chat_checkpoint, {"max_model_len": 1024, "num_kvcache_blocks": 512}).start()
    yield running
    running.stop()


def body(rng: random.Random, **more) -> dict:
    return {"prompt": [rng.randrange(2, 300) for _ in range(8)], "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "temperature": 1.0, **more}


async def drop_stream(http: httpx.AsyncClient, rng: random.Random, n: int) -> int:
    """Closes a stream of n choices once it has 1-3 data chunks; returns the choices dropped."""
    chunks = rng.randint(1, 3)
    request = body(rng, stream=True, n=n, return_token_ids=True)  # token ids: a chunk for every token
    async with http.stream("POST", "/v1/completions", json=request) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            chunks -= line.startswith("data: {")
            if chunks == 0:
                return n
    raise AssertionError("the stream ended before the client left")


async def drop_request(http: httpx.AsyncClient, rng: random.Random) -> int:
    # Only the wait for the response is short: a connect slowed by a loaded machine is not the client leaving.
    timeout = httpx.Timeout(60, read=rng.uniform(0.1, 0.25))
    try:
        await http.post("/v1/completions", json=body(rng), timeout=timeout)
    except httpx.ReadTimeout:
        return 1
    raise AssertionError("the request finished before the client left")


def test_disconnects_abort_requests_and_free_their_blocks(server):
    before = server.metrics()

    async def main():
        rng, gate = random.Random(0), asyncio.Semaphore(CONCURRENCY)

        async def bounded(make):
            async with gate:
                return await make()

        async with httpx.AsyncClient(base_url=server.url, timeout=60,
                                     limits=httpx.Limits(max_connections=CONCURRENCY * 2)) as http:
            jobs = [lambda n=1 + (i % 4 == 0): drop_stream(http, rng, n) for i in range(DROPS)]
            jobs += [lambda: drop_request(http, rng) for _ in range(DROPS)]
            rng.shuffle(jobs)
            return sum(await asyncio.gather(*(bounded(job) for job in jobs)))

    dropped = asyncio.run(main())

    def idle():
        stats = server.metrics()
        return (stats["nanovllm:num_requests_running"] == stats["nanovllm:num_requests_waiting"] == 0
                and stats["nanovllm:kv_cache_usage_perc"] == 0 and stats)

    after = wait_until(idle, timeout=2, what="the engine to drop every request")
    assert server.engine.requests == {} and server.engine.num_waiting == 0
    aborted = after["nanovllm:request_success_total{abort}"] - before.get("nanovllm:request_success_total{abort}", 0)
    assert aborted == dropped >= 2 * DROPS
