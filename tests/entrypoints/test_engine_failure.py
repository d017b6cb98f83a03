"""An engine process that dies, killed or by a step that raises: requests in flight get a 500
(non-streamed) or an error event then [DONE] (streamed); the dead process is reaped, /health
and new requests answer 503 while a new engine process loads, and then the server serves again.
Nothing hangs: every wait is bounded."""
import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from servers import TIMEOUT, FailingEngine, RunningServer, wait_until

# Requests that run for a second or more, so they are still running when the engine dies.
LONG = {"prompt": [3, 4, 5, 6], "max_tokens": 1000, "ignore_eos": True, "temperature": 1.0}
LONG_ARGS = {"max_model_len": 1024, "num_kvcache_blocks": 512}


@pytest.mark.parametrize("failure", ["killed", "raising"])
def test_requests_fail_cleanly_and_the_engine_restarts(chat_checkpoint, failure):
    engine_class = FailingEngine if failure == "raising" else None
    server = RunningServer(chat_checkpoint, LONG_ARGS, engine_class=engine_class).start()
    url, dead = server.url, server.engine.process
    try:
        with httpx.Client(base_url=url, timeout=TIMEOUT) as http, ThreadPoolExecutor(2) as pool:
            streamed = {**LONG, "stream": True, "return_token_ids": True}
            with http.stream("POST", "/v1/completions", json=streamed) as stream:
                lines = stream.iter_lines()
                next(line for line in lines if line.startswith("data: {"))
                waiting = pool.submit(httpx.post, f"{url}/v1/completions", json=LONG, timeout=TIMEOUT)
                wait_until(lambda: len(server.engine.requests) == 2, what="the second request to be in flight")
                if failure == "killed":
                    os.kill(dead.pid, signal.SIGKILL)
                    trigger = None
                else:
                    trigger = pool.submit(httpx.post, f"{url}/v1/completions", timeout=TIMEOUT,
                                          json={**LONG, "prompt": [FailingEngine.TRIGGER, 3]})
                events = [line for line in lines if line.startswith("data: ")]
            error = json.loads(events[-2].removeprefix("data: "))["error"]
            assert events[-1] == "data: [DONE]" and error["type"] == "server_error"
            assert all("error" not in json.loads(e.removeprefix("data: ")) for e in events[:-2])
            for response in (waiting.result(TIMEOUT), *([trigger.result(TIMEOUT)] if trigger else [])):
                assert response.status_code == 500 and response.json()["error"]["code"] == "engine_error"
            # a new engine process loads for seconds: until it is ready, the server says why it is down
            assert http.get("/health").status_code == 503
            refused = http.post("/v1/completions", json=LONG)
            message = refused.json()["error"]["message"]
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert ("exit code -9" if failure == "killed" else "RuntimeError: injected step failure") in message
            wait_until(lambda: not os.path.exists(f"/proc/{dead.pid}"), timeout=30,
                       what="the dead engine process to be reaped")
            wait_until(lambda: http.get("/health").status_code == 200, what="the engine to restart")
            assert server.engine.process.pid != dead.pid and server.engine.restarts == 1
            served = http.post("/v1/completions", json={**LONG, "max_tokens": 4})
            assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 4
    finally:
        server.stop()
