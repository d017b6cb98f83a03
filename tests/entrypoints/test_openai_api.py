"""The server through the official openai client: completions and chat, streamed and not,
n > 1, stop strings, usage, seeds, equality with LLM.generate(), non-ASCII text, concurrency."""
import asyncio

import httpx
import pytest

from servers import MODEL_NAME, TIMEOUT

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about the river."}]


def greedy_reference(llm, prompt, max_tokens):
    from nanovllm import SamplingParams
    return llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)[0]


def stream_text(stream) -> tuple[dict[int, str], dict[int, str], list]:
    """Streamed chunks -> text and finish_reason by choice index, and the chunks themselves."""
    texts, reasons, chunks = {}, {}, list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta.content if hasattr(choice, "delta") else choice.text
            texts[choice.index] = texts.get(choice.index, "") + (delta or "")
            if choice.finish_reason is not None:
                assert choice.index not in reasons, "a choice got two finish reasons"
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, chunks


def test_models_list(client, chat_checkpoint):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].model_extra["max_model_len"] == 256


def test_greedy_completion_equals_llm_generate(client, llm):
    expected = greedy_reference(llm, PROMPT, 24)
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = out.choices[0]
    assert choice.model_extra["token_ids"] == expected["token_ids"]
    assert choice.text == expected["text"] and choice.finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(llm.tokenizer.encode(PROMPT)), 24)


def test_left_out_sampling_fields_take_the_checkpoints_defaults(client, llm):
    """generation_config.json of the test checkpoint says temperature 0: greedy."""
    expected = greedy_reference(llm, PROMPT, 16)
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, extra_body={"ignore_eos": True})
    assert out.choices[0].text == expected["text"]


def test_streamed_completion_equals_the_non_streamed_one(client):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=40, temperature=1.0, seed=7,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs).choices[0]
    texts, reasons, chunks = stream_text(client.completions.create(stream=True, **kwargs))
    assert texts == {0: full.text} and reasons == {0: "length"} and len(chunks) > 5


def test_chat_streamed_and_not(client, llm):
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    prompt = llm.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    expected = greedy_reference(llm, llm.tokenizer.encode(prompt, add_special_tokens=False), 30)
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == expected["text"]
    assert full.usage.completion_tokens == 30
    texts, reasons, chunks = stream_text(client.chat.completions.create(stream=True, **kwargs))
    assert texts == {0: expected["text"]} and reasons == {0: "length"}
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:])


def test_non_ascii_output_streams_whole_characters(client, llm):
    """The byte-level tiny model writes characters of several bytes now and then: take a
    prompt whose greedy output has one."""
    def non_ascii(text):
        return any(ord(c) > 127 and c != "\ufffd" for c in text)

    prompt, expected = next((p, text) for p in (PROMPT, "Hi", "The weather was cold", "Numbers such as", "She")
                            if non_ascii(text := greedy_reference(llm, p, 64)["text"]))
    texts, _, chunks = stream_text(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=64,
                                                             temperature=0, stream=True,
                                                             extra_body={"ignore_eos": True}))
    assert texts[0] == expected
    assert all(not (c.choices[0].text or "").endswith("\ufffd") for c in chunks[:-1])


def test_n_choices(client):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=1.0, n=3, seed=11,
                  extra_body={"ignore_eos": True})
    out = client.completions.create(**kwargs)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in out.choices)
    assert len({c.text for c in out.choices}) == 3  # seed, seed + 1, seed + 2
    assert out.usage.completion_tokens == 36
    texts, reasons, _ = stream_text(client.completions.create(stream=True, **kwargs))
    assert texts == {c.index: c.text for c in out.choices} and reasons == {0: "length", 1: "length", 2: "length"}


@pytest.mark.parametrize("prompts", [[PROMPT, "Hi there"], [[3, 4, 5, 6], [5, 6, 7, 8]]])
def test_several_prompts_in_one_completion_request(client, llm, prompts):
    out = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=8, temperature=0, n=2,
                                    extra_body={"ignore_eos": True})
    texts = [c.text for c in sorted(out.choices, key=lambda c: c.index)]
    expected = [greedy_reference(llm, p, 8)["text"] for p in prompts]
    assert texts == [expected[0], expected[0], expected[1], expected[1]]
    assert out.usage.prompt_tokens == sum(len(llm.tokenizer.encode(p) if isinstance(p, str) else p) for p in prompts)


def test_seeded_sampling_is_reproducible(client):
    def sample(seed):
        return client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=20, temperature=1.0,
                                         seed=seed, extra_body={"ignore_eos": True}).choices[0].text

    assert sample(3) == sample(3)
    assert sample(3) != sample(4)


def test_stop_string_across_chunk_boundaries(client):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=48, temperature=0, extra_body={"ignore_eos": True})
    chunks = [c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices[0].text]
    text = "".join(chunks)
    # A stop string made of the end of one chunk and the start of the next, first seen there.
    stop, offset = None, 0
    for left, right in zip(chunks, chunks[1:]):
        offset += len(left)
        candidate = left[-2:] + right[:2]
        if len(candidate) == 4 and text.find(candidate) == offset - 2:
            stop = candidate
            break
    assert stop is not None, chunks
    expected = text[:offset - 2]
    full = client.completions.create(stop=[stop, "\x00never"], **kwargs).choices[0]
    assert (full.text, full.finish_reason) == (expected, "stop")
    texts, reasons, _ = stream_text(client.completions.create(stop=stop, stream=True, **kwargs))
    assert texts == {0: expected} and reasons == {0: "stop"}


def test_include_usage(client):
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=9, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 9
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_is_framed_as_server_sent_events(server):
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=TIMEOUT,
                      json={"prompt": [3, 4, 5], "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                            "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        body = response.read().decode()
    events = body.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])


def test_32_concurrent_streams_complete_with_correct_usage(server):
    import openai

    async def one(client, i):
        stream = await client.completions.create(model=MODEL_NAME, prompt=f"{PROMPT} {i}", max_tokens=8 + i % 5,
                                                 temperature=1.0, seed=i, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True, "return_token_ids": True})
        tokens, usage, reasons = [], None, []
        async for chunk in stream:
            for choice in chunk.choices:
                tokens += choice.model_extra["token_ids"]
                reasons += [choice.finish_reason] if choice.finish_reason else []
            usage = chunk.usage or usage
        return i, tokens, usage, reasons

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
        async with client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    for i, tokens, usage, reasons in asyncio.run(main()):
        assert len(tokens) == usage.completion_tokens == 8 + i % 5
        assert reasons == ["length"]


def test_tokenize_and_detokenize(server, llm):
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}).json()
    assert ids["tokens"] == llm.tokenizer.encode(PROMPT) and ids["count"] == len(ids["tokens"])
    assert ids["max_model_len"] == 256
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES}).json()
    prompt = llm.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == llm.tokenizer.encode(prompt, add_special_tokens=False)
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": ids["tokens"]}).json() == {"prompt": PROMPT}


def test_health_version_and_metrics(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert "version" in httpx.get(f"{server.url}/version").json()
    before = server.metrics()
    httpx.post(f"{server.url}/v1/completions", timeout=TIMEOUT,
               json={"prompt": [3, 4, 5], "max_tokens": 5, "ignore_eos": True, "temperature": 0})
    after = server.metrics()
    grew = {name: after[f"nanovllm:{name}"] - before.get(f"nanovllm:{name}", 0) for name in (
        "prompt_tokens_total", "generation_tokens_total", "request_success_total{length}",
        "time_to_first_token_seconds_count", "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count")}
    assert grew == {"prompt_tokens_total": 3, "generation_tokens_total": 5, "request_success_total{length}": 1,
                    "time_to_first_token_seconds_count": 1, "inter_token_latency_seconds_count": 4,
                    "e2e_request_latency_seconds_count": 1}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_hit_blocks_total", "num_preemptions_total"):
        assert f"nanovllm:{name}" in after
