"""Bad requests over raw HTTP: each gets a 4xx in OpenAI's error shape naming the field, and the
server keeps serving. Also the API key, the queue limit and a checkpoint without a chat template."""
import json

import httpx
import pytest

from servers import MODEL_NAME, TIMEOUT, RunningServer, wait_until

COMPLETION = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}


def post(server, path, body=None, **kwargs):
    return httpx.post(f"{server.url}{path}", json=body, timeout=TIMEOUT, **kwargs)


def assert_error(response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error
    if status == 400 and param:
        assert error["message"].startswith(param), error  # the message names the field too
    return error


@pytest.fixture(autouse=True)
def still_serving(server):
    """After every bad request the server still answers a good one."""
    yield
    assert httpx.get(f"{server.url}/health").status_code == 200
    response = post(server, "/v1/completions", COMPLETION)
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b"", b'"a string"'])
def test_malformed_bodies(server, body):
    response = httpx.post(f"{server.url}/v1/completions", content=body, timeout=TIMEOUT,
                          headers={"content-type": "application/json"})
    assert 400 <= response.status_code < 500 and response.status_code != 422
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"max_tokens": 4}, "prompt"),
    ("/v1/chat/completions", {"max_tokens": 4}, "messages"),
    ("/v1/completions", {**COMPLETION, "prompt": 12}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": [1.5, 2]}, "prompt"),
    ("/v1/completions", {**COMPLETION, "temperature": "hot"}, "temperature"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 2.5}, "max_tokens"),
    ("/v1/completions", {**COMPLETION, "stream": "sometimes"}, "stream"),
    ("/v1/completions", {**COMPLETION, "stop": 5}, "stop"),
    ("/v1/completions", {**COMPLETION, "seed": "x"}, "seed"),
    ("/v1/completions", {**COMPLETION, "n": 1.5}, "n"),
    ("/v1/completions", {**COMPLETION, "stop_token_ids": "3"}, "stop_token_ids"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"content": "no role"}]}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": "Hello"}, "messages"),
])
def test_missing_and_wrongly_typed_fields(server, path, body, param):
    assert_error(post(server, path, body), 400, param)


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.5), ("temperature", float("inf")), ("top_p", 0), ("top_p", 1.5), ("top_k", 0),
    ("top_k", -2), ("min_p", -0.1), ("min_p", 1.5), ("max_tokens", 0), ("max_tokens", -3), ("n", 0),
    ("n", 10_000), ("stop", [""]), ("stop_token_ids", [-1]), ("logprobs", 21), ("logprobs", -1),
    ("echo", True),
    ("presence_penalty", 0.5), ("best_of", 3),
])
def test_out_of_range_sampling_values(server, field, value):
    # json.dumps writes inf as Infinity, which httpx's encoder refuses to send.
    response = httpx.post(f"{server.url}/v1/completions", content=json.dumps({**COMPLETION, field: value}),
                          headers={"content-type": "application/json"}, timeout=TIMEOUT)
    assert_error(response, 400, field)


@pytest.mark.parametrize("field, value", [
    ("max_completion_tokens", 0), ("top_logprobs", 3), ("temperature", -1),
    ("tools", [{"type": "function", "function": {"name": "f"}}]), ("response_format", {"type": "json_object"}),
])
def test_chat_out_of_range_values(server, field, value):
    assert_error(post(server, "/v1/chat/completions", {**CHAT, field: value}), 400, field)


def test_top_logprobs_need_logprobs_and_stay_within_20(server):
    for body in ({**CHAT, "top_logprobs": 2}, {**CHAT, "logprobs": False, "top_logprobs": 0}):
        error = assert_error(post(server, "/v1/chat/completions", body), 400, "top_logprobs")
        assert "logprobs: true" in error["message"]
    error = assert_error(post(server, "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}), 400,
                         "top_logprobs")
    assert "[0, 20]" in error["message"]


def test_unknown_model_is_a_404(server):
    error = assert_error(post(server, "/v1/completions", {**COMPLETION, "model": "gpt-9"}), 404, "model")
    assert error["code"] == "model_not_found"


def test_prompts_without_room_for_output(server):
    """max_model_len is 256: a 256-token prompt leaves no room; a longer max_tokens is
    clamped to the room left."""
    error = assert_error(post(server, "/v1/completions", {**COMPLETION, "prompt": [5] * 256}), 400, "prompt")
    assert error["code"] == "context_length_exceeded"
    long_chat = {**CHAT, "messages": [{"role": "user", "content": "fox " * 300}]}
    assert_error(post(server, "/v1/chat/completions", long_chat), 400, "messages")
    out = post(server, "/v1/completions", {**COMPLETION, "prompt": [5] * 250, "max_tokens": 100, "ignore_eos": True})
    assert out.status_code == 200, out.text
    assert out.json()["usage"]["completion_tokens"] == 6 and out.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
    ("/v1/completions", {**COMPLETION, "prompt": []}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": ""}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": [3, 100_000]}, "prompt"),
    ("/v1/completions", {**COMPLETION, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages"),
])
def test_empty_and_invalid_prompts(server, path, body, param):
    assert_error(post(server, path, body), 400, param)


def test_a_bad_prompt_among_several_leaves_nothing_running(server):
    assert_error(post(server, "/v1/completions", {**COMPLETION, "prompt": [[3, 4], [3, 100_000]], "n": 2}),
                 400, "prompt")
    assert server.engine.requests == {} and server.engine.num_waiting == 0


def test_unknown_fields_are_ignored_and_nulls_are_defaults(server):
    response = post(server, "/v1/completions", {**COMPLETION, "frobnicate": True, "user": "someone", "n": None,
                                                "stream": None, "stop": None, "temperature": None})
    assert response.status_code == 200 and len(response.json()["choices"]) == 1


def test_unknown_paths_and_methods_answer_in_the_error_shape(server):
    assert_error(httpx.get(f"{server.url}/v1/nothing"), 404)
    assert_error(httpx.get(f"{server.url}/v1/completions"), 405)


@pytest.fixture(scope="module")
def guarded_server(plain_checkpoint):
    """A checkpoint without a chat template, an API key, one sequence at a time and a queue of one;
    sequences up to 1024 tokens, so one can run for a while."""
    running = RunningServer(plain_checkpoint, {"max_num_seqs": 1, "max_model_len": 1024}, api_key="secret",
                            max_queue=1).start()
    yield running
    running.stop()


AUTH = {"Authorization": "Bearer secret"}


@pytest.mark.usefixtures("guarded_server")
class TestGuardedServer:
    @pytest.fixture(autouse=True)
    def still_serving(self, guarded_server):  # replaces the module's: this server wants a key
        yield
        wait_until(lambda: guarded_server.engine.num_waiting == 0, what="closed streams to be aborted")
        assert post(guarded_server, "/v1/completions", COMPLETION, headers=AUTH).status_code == 200

    def test_api_key(self, guarded_server):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "secret"}):
            assert assert_error(post(guarded_server, "/v1/completions", COMPLETION, headers=headers), 401)["code"] \
                == "invalid_api_key"
        assert httpx.get(f"{guarded_server.url}/v1/models", headers=AUTH).status_code == 200
        assert httpx.get(f"{guarded_server.url}/v1/models").status_code == 401
        assert httpx.get(f"{guarded_server.url}/health").status_code == 200  # open, for probes

    def test_chat_without_a_chat_template(self, guarded_server):
        error = assert_error(post(guarded_server, "/v1/chat/completions", CHAT, headers=AUTH), 400, "messages")
        assert "chat template" in error["message"]

    def test_429_when_the_queue_is_full(self, guarded_server):
        """max_num_seqs=1: the first request runs, the second waits, the third is refused."""
        long = {**COMPLETION, "max_tokens": 1000, "ignore_eos": True, "stream": True, "return_token_ids": True}
        with httpx.Client(base_url=guarded_server.url, headers=AUTH, timeout=TIMEOUT) as http:
            with http.stream("POST", "/v1/completions", json=long) as running:
                lines = running.iter_lines()  # kept: a closed iterator closes the connection
                next(line for line in lines if line.startswith("data: {"))
                with http.stream("POST", "/v1/completions", json=long) as waiting:
                    assert waiting.status_code == 200
                    refused = http.post("/v1/completions", json=COMPLETION)
                    error = assert_error(refused, 429)
                    assert refused.headers["retry-after"] == "1" and error["code"] == "queue_full"
