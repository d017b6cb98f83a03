"""Bad requests over raw HTTP: each gets a 4xx in OpenAI's error shape naming the field, and the
server keeps serving; hostile ones (integers past int64, lone surrogates, huge bodies) too. A
long prompt is tokenized while /health still answers. Also the API key, the documentation pages,
the queue limit and a checkpoint without a chat template."""
import json
import threading
from concurrent.futures import ThreadPoolExecutor

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
    ("best_of", 3), ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
    ("logit_bias", {"5": 101}), ("logit_bias", {"100000": 1}), ("logit_bias", {"x": 1}), ("min_tokens", -1),
    ("bad_words", "fox"),
])
def test_out_of_range_sampling_values(server, field, value):
    # json.dumps writes inf as Infinity, which httpx's encoder refuses to send.
    response = httpx.post(f"{server.url}/v1/completions", content=json.dumps({**COMPLETION, field: value}),
                          headers={"content-type": "application/json"}, timeout=TIMEOUT)
    assert_error(response, 400, field)


@pytest.mark.parametrize("field, value", [
    ("max_completion_tokens", 0), ("top_logprobs", 3), ("temperature", -1),
    ("tools", [{"type": "function", "function": {"name": "f g"}}]), ("response_format", {"type": "json_schema"}),
])
def test_chat_out_of_range_values(server, field, value):
    assert_error(post(server, "/v1/chat/completions", {**CHAT, field: value}), 400, field)


def test_top_k_past_int64_is_a_400_and_the_engine_keeps_running(server):
    """The value would overflow the engine's int64 top-k tensor and end its process."""
    response = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "top_k": 9223372036854775808})
    assert_error(response, 400, "top_k")
    # within int64 but past the vocabulary: no top-k
    assert post(server, "/v1/completions", {**COMPLETION, "top_k": 2**62}).status_code == 200


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {**CHAT, "tool_choice": "auto"}, "tool_choice"),
    ("/v1/completions", {**COMPLETION, "suffix": "end"}, "suffix"),
    ("/v1/chat/completions", {**CHAT, "echo": True}, "echo"),  # completions only
    ("/v1/completions", {**COMPLETION, "use_beam_search": True}, "use_beam_search"),
])
def test_unimplemented_fields_are_refused_unless_they_ask_for_nothing(server, path, body, param):
    assert_error(post(server, path, body), 400, param)
    off = {"suffix": "", "echo": False, "use_beam_search": False, "tool_choice": "none", "tools": []}
    assert post(server, path, {**body, **off}).status_code == 200


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", '{"prompt": "ab\\ud800", "max_tokens": 1}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "ab\\ud800"], "max_tokens": 1}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "ab\\ud800"}]}', "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
     "messages"),
    ("/tokenize", '{"prompt": "ab\\ud800"}', "prompt"),
    ("/v1/completions", '{"prompt": "hi", "stop": ["\\ud800"]}', "stop"),
])
def test_lone_surrogates_are_a_400_naming_the_field(server, path, body, param):
    """JSON's \\uXXXX escapes can carry half a UTF-16 pair, which no tokenizer can encode."""
    response = httpx.post(f"{server.url}{path}", content=body, headers={"content-type": "application/json"},
                          timeout=TIMEOUT)
    assert "surrogate" in assert_error(response, 400, param)["message"]


def test_errors_repeat_bounded_input(server):
    error = assert_error(post(server, "/v1/completions", {**COMPLETION, "model": "m" * 1_000_000}), 404, "model")
    assert len(error["message"]) < 300 and error["message"].endswith("this server serves 'tiny'")
    error = assert_error(post(server, "/v1/completions", {**COMPLETION, "stop_token_ids": [3] * 100_000 + [-1]}),
                         400, "stop_token_ids")
    assert len(error["message"]) < 300


def test_bodies_past_the_size_limit_are_a_413(server):
    """Also a chunked body, which declares no length."""
    body = json.dumps({**COMPLETION, "prompt": "fox " * 1_100_000}).encode()  # 4.4 MB
    assert_error(httpx.post(f"{server.url}/v1/completions", content=body, timeout=TIMEOUT,
                            headers={"content-type": "application/json"}), 413)
    chunked = httpx.post(f"{server.url}/tokenize", content=(body[i:i + 65536] for i in range(0, len(body), 65536)),
                         headers={"content-type": "application/json"}, timeout=TIMEOUT)
    assert "content-length" not in chunked.request.headers
    assert_error(chunked, 413)


def test_a_long_prompt_is_tokenized_off_the_event_loop(server, monkeypatch):
    """/health answers while a 2 MB prompt (under the size limit) is being tokenized: its
    tokenization is held until /health has answered."""
    tokenizer = server.app.state.server.tokenizer
    encode, tokenizing, release = tokenizer.encode, threading.Event(), threading.Event()

    def held_encode(text, *args, **kwargs):
        if len(text) > 1_000_000:
            tokenizing.set()
            release.wait(TIMEOUT)
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", held_encode)
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(post, server, "/v1/completions", {**COMPLETION, "prompt": "fox " * 500_000})
        assert tokenizing.wait(TIMEOUT)
        try:
            health = httpx.get(f"{server.url}/health", timeout=10)
        finally:
            release.set()
        assert health.status_code == 200 and not long.done()
        assert assert_error(long.result(TIMEOUT), 400, "prompt")["code"] == "context_length_exceeded"


HUGE = 2**63
SURROGATE = '"ab\\ud800"'


@pytest.mark.parametrize("path, body", [
    # integers past int64, negative or fractional where counts and token ids belong
    *[("/v1/completions", {**COMPLETION, field: value}) for field in ("top_k", "n", "max_tokens", "seed", "logprobs",
                                                                        "best_of") for value in (HUGE, -HUGE - 1)],
    *[("/v1/completions", {**COMPLETION, field: value}) for field, value in (
        ("top_k", -2), ("n", -1), ("max_tokens", -1), ("logprobs", -1), ("top_k", 1.5), ("n", 1.5),
        ("max_tokens", 1.5), ("seed", 1.5), ("logprobs", 1.5), ("seed", "1e3"))],
    *[("/v1/completions", {**COMPLETION, "stop_token_ids": ids}) for ids in ([HUGE], [-1], [320], [1.5])],
    *[("/v1/completions", {**COMPLETION, "prompt": prompt}) for prompt in ([HUGE], [-HUGE], [[3], [2**64]], [320],
                                                                           [-1], [0.5], {"a": 1}, [None], True)],
    *[("/v1/chat/completions", {**CHAT, field: value}) for field, value in (
        ("max_completion_tokens", HUGE), ("top_logprobs", HUGE), ("n", -1), ("messages", "hi"),
        ("messages", [{"role": None}]), ("messages", [{"role": "user", "content": 5}]))],
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": HUGE}),
    ("/detokenize", {"tokens": [HUGE]}), ("/detokenize", {"tokens": [-1]}), ("/detokenize", {"tokens": "3"}),
    ("/tokenize", {"prompt": 5}), ("/tokenize", {}),
    # floats that are not numbers, and text that is not text
    ("/v1/completions", '{"prompt": "hi", "temperature": NaN}'),
    ("/v1/completions", '{"prompt": "hi", "top_p": Infinity}'),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 1e999}'),
    ("/v1/completions", '{"prompt": "hi", "top_k": ' + "9" * 5000 + "}"),
    *[(path, body.replace('"hi"', SURROGATE)) for path, body in (
        ("/v1/completions", '{"prompt": "hi"}'), ("/v1/completions", '{"prompt": "x", "model": "hi"}'),
        ("/v1/chat/completions", '{"messages": [{"role": "hi", "content": "x"}]}'), ("/tokenize", '{"prompt": "hi"}'),
        ("/tokenize", '{"messages": [{"role": "user", "content": "hi"}]}'))],
    # names and bodies of any size or shape
    ("/v1/completions", {**COMPLETION, "model": "m" * 1_000_000}),
    ("/v1/chat/completions", {**CHAT, "model": ["tiny"]}),
    ("/v1/completions", b"{"), ("/v1/completions", b"\xff\xfe{}"), ("/v1/completions", b"null"),
    ("/v1/completions", b'{"prompt": "hi"' + b" " * 5_000_000 + b"}"),
])
def test_hostile_requests_are_4xx_and_the_server_keeps_serving(server, path, body):
    """The module's still_serving fixture then checks /health and a normal request."""
    content = body.encode() if isinstance(body, str) else body if isinstance(body, bytes) else json.dumps(body)
    response = httpx.post(f"{server.url}{path}", content=content, headers={"content-type": "application/json"},
                          timeout=TIMEOUT)
    assert 400 <= response.status_code < 500, response.text[:300]
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


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


def test_no_documentation_pages_unless_asked_for(server):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert_error(httpx.get(f"{server.url}{path}"), 404)


@pytest.fixture(scope="module")
def guarded_server(plain_checkpoint):
    """A checkpoint without a chat template, an API key, the documentation pages, one sequence at
    a time and a queue of one; sequences up to 1024 tokens, so one can run for a while."""
    running = RunningServer(plain_checkpoint, {"max_num_seqs": 1, "max_model_len": 1024}, api_key="secret",
                            max_queue=1, enable_docs=True).start()
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
        for path in ("/health", "/metrics"):  # open, for probes and scrapers
            assert httpx.get(f"{guarded_server.url}{path}").status_code == 200
        for method, path, body in (("POST", "/tokenize", {"prompt": "Hi"}), ("POST", "/detokenize", {"tokens": [3]}),
                                   ("GET", "/docs", None), ("GET", "/openapi.json", None), ("GET", "/version", None)):
            assert assert_error(httpx.request(method, f"{guarded_server.url}{path}", json=body), 401)["code"] \
                == "invalid_api_key"
            assert httpx.request(method, f"{guarded_server.url}{path}", json=body, headers=AUTH).status_code == 200

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
