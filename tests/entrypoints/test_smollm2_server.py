"""SmolLM2-135M-Instruct (tests/smollm2.py) served over HTTP: a chat completion through the
official openai client answers as LLM.generate() does on the chat template's rendering, and
ends where the model writes its end-of-turn token."""
import pytest

from servers import ENGINE_ARGS, MODEL_NAME, TIMEOUT, RunningServer, wait_until

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def server(smollm2_checkpoint):
    running = RunningServer(smollm2_checkpoint).start()
    yield running
    running.stop()


def test_chat_completion_equals_llm_generate(smollm2_checkpoint, server):
    import openai
    from nanovllm import LLM, SamplingParams
    llm = LLM(str(smollm2_checkpoint), **ENGINE_ARGS)
    prompt = llm.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    expected = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)[0]
    # Guards the prompt: the answer ends with <|im_end|> before MAX_TOKENS.
    assert expected["finish_reason"] == "stop" and expected["text"].strip()

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    choice = out.choices[0]
    assert (choice.message.content, choice.finish_reason) == (expected["text"], "stop")
    assert out.usage.completion_tokens == len(expected["token_ids"])
    assert out.usage.prompt_tokens == len(llm.tokenizer.encode(prompt, add_special_tokens=False))


def test_gguf_file_served_answers_as_its_checkpoint_folder(server):
    """`nanovllm serve SmolLM2.gguf`: the chat template, tokenizer and end-of-turn token come
    from the file, and the answer is the dequantized checkpoint folder's."""
    import openai
    import smollm2
    gguf_server = RunningServer(smollm2.gguf_file()).start(wait_ready=False)
    try:
        # Reading the file's 49152-token vocabulary takes the tokenizer and the engine a while each.
        wait_until(lambda: gguf_server.app.state.server.ready or gguf_server.engine.error, timeout=3 * TIMEOUT,
                   what="the engine to load the GGUF file")
        assert gguf_server.engine.error is None, gguf_server.engine.error
        answers = []
        for running in (server, gguf_server):
            client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
            out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                 temperature=0)
            answers.append((out.choices[0].message.content, out.choices[0].finish_reason, out.usage))
        assert answers[1] == answers[0] and answers[0][1] == "stop"
    finally:
        gguf_server.stop()
