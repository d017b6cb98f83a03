"""Log-probabilities through the server: completions' legacy format and chat's, streamed and
not, against the engine's own values (LLM.generate with the same SamplingParams); and the
engine process's messages carry them only for requests that asked."""
import itertools

import pytest

from servers import MODEL_NAME

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Tell me about the river."}]
# fp32: the server's engine and the in-process one compute the same logits, up to float32
# rounding where their batches or caches differ.
ATOL = 2e-5


def engine_logprobs(llm, prompt, max_tokens: int, num: int) -> dict:
    from nanovllm import SamplingParams
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=num),
                        use_tqdm=False)[0]


def concatenated(chunks, field: str) -> list:
    return list(itertools.chain.from_iterable(getattr(c.choices[0].logprobs, field) for c in chunks
                                              if c.choices and c.choices[0].logprobs is not None))


def shape(item) -> tuple:
    return item.token, item.bytes, [(t.token, t.bytes) for t in item.top_logprobs]


def values(items) -> list[float]:
    return [v for item in items for v in (item.logprob, *(t.logprob for t in item.top_logprobs))]


def test_completion_logprobs_legacy_format(client, llm):
    expected = engine_logprobs(llm, PROMPT, 12, 3)
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3,
                  extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = client.completions.create(**kwargs).choices[0]
    assert choice.model_extra["token_ids"] == expected["token_ids"]
    logprobs, name = choice.logprobs, llm.tokenizer.decode
    assert logprobs.tokens == [name([t]) for t in expected["token_ids"]]
    assert logprobs.token_logprobs == pytest.approx([e[t] for t, e in zip(expected["token_ids"],
                                                                         expected["logprobs"])], abs=ATOL)
    assert len(logprobs.top_logprobs) == 12
    for top, token, entry in zip(logprobs.top_logprobs, logprobs.tokens, expected["logprobs"]):
        named = {}  # byte pieces share the string U+FFFD: the sampled token's value, else the most likely's
        for token_id, value in entry.items():
            named.setdefault(name([token_id]), value)
        assert top == pytest.approx(named, abs=ATOL) and token in top
    assert logprobs.text_offset == list(itertools.accumulate(map(len, logprobs.tokens), initial=0))[:-1]

    chunks = list(client.completions.create(stream=True, **kwargs))  # a prompt of less than a block: no cache hit
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert concatenated(chunks, field) == getattr(logprobs, field), field


def test_completion_logprobs_zero_and_none(client):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0)
    only_sampled = client.completions.create(logprobs=0, **kwargs).choices[0].logprobs
    assert [list(top) for top in only_sampled.top_logprobs] == [[token] for token in only_sampled.tokens]
    assert client.completions.create(**kwargs).choices[0].logprobs is None


def test_chat_logprobs(client, llm, server):
    import httpx
    prompt = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    expected = engine_logprobs(llm, prompt, 10, 2)
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2,
                  extra_body={"ignore_eos": True})
    content = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    assert len(content) == 10
    for item, token_id, entry in zip(content, expected["token_ids"], expected["logprobs"]):
        assert item.token == llm.tokenizer.decode([token_id]) and item.bytes == list(item.token.encode())
        assert item.logprob == pytest.approx(entry[token_id], abs=ATOL)
        ranked = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:2]
        assert [(t.token, t.bytes) for t in item.top_logprobs] == [
            (llm.tokenizer.decode([i]), list(llm.tokenizer.decode([i]).encode())) for i, _ in ranked]
        assert [t.logprob for t in item.top_logprobs] == pytest.approx([v for _, v in ranked], abs=ATOL)

    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].choices[0].logprobs is None  # the role chunk
    streamed = concatenated(chunks, "content")
    # the chat prompt fills a cache block: the second request prefills from the cache, and its
    # float32 logits may differ in the last bits
    assert [shape(item) for item in streamed] == [shape(item) for item in content]
    assert values(streamed) == pytest.approx(values(content), abs=ATOL)
    plain = client.chat.completions.create(**{**kwargs, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_engine_messages_carry_logprobs_only_for_requests_that_asked(llm):
    from nanovllm import SamplingParams
    from nanovllm.entrypoints.engine_loop import EngineLoop
    loop = EngineLoop(llm, sock=None)
    params = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=n) for n in (1, None)]
    for request_id, sp in enumerate(params):
        loop._apply(("add", request_id, [3, 4, 5, 6], sp), [], [])
    tokens, logprobs = [], []
    while not llm.is_finished():
        outputs, step_logprobs = loop._step()
        tokens += outputs
        logprobs += step_logprobs
    asked = [token for request_id, token, _ in tokens if request_id == 0]
    assert len(asked) == 4 and len(tokens) == 8
    assert [request_id for request_id, _ in logprobs] == [0] * 4
    assert all(token in entry and len(entry) in (1, 2) for token, (_, entry) in zip(asked, logprobs))
