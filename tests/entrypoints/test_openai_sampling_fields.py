"""Penalties, biases, bans, echo, skip_special_tokens and include_stop_str_in_output through the
official openai client: the server's outputs equal LLM.generate() with the same SamplingParams."""
import openai
import pytest

from servers import MODEL_NAME

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Tell me about the river."}]
FIELDS = dict(presence_penalty=0.7, frequency_penalty=-0.4, extra=dict(repetition_penalty=1.6, min_tokens=5,
                                                                       bad_words=["the"], ignore_eos=True))


def generate(llm, prompt_ids, max_tokens, **fields):
    from nanovllm import SamplingParams
    return llm.generate([prompt_ids], SamplingParams(temperature=0.0, max_tokens=max_tokens, **fields),
                        use_tqdm=False)[0]


def test_completion_penalties_and_bans_equal_llm_generate(client, llm):
    extra = FIELDS["extra"]
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0,
                                    presence_penalty=FIELDS["presence_penalty"],
                                    frequency_penalty=FIELDS["frequency_penalty"], logit_bias={"42": 3},
                                    extra_body={**extra, "return_token_ids": True})
    expected = generate(llm, llm.tokenizer.encode(PROMPT), 16, presence_penalty=0.7, frequency_penalty=-0.4,
                        logit_bias={42: 3}, **extra)
    assert out.choices[0].model_extra["token_ids"] == expected["token_ids"]
    assert expected["token_ids"] != generate(llm, llm.tokenizer.encode(PROMPT), 16, ignore_eos=True)["token_ids"]


def test_chat_penalties_equal_llm_generate(client, llm):
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=12, temperature=0,
                                         frequency_penalty=1.5, extra_body={"ignore_eos": True,
                                                                            "return_token_ids": True})
    text = llm.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt = llm.tokenizer.encode(text, add_special_tokens=False)
    expected = generate(llm, prompt, 12, frequency_penalty=1.5, ignore_eos=True)
    assert out.choices[0].model_extra["token_ids"] == expected["token_ids"]


def test_a_logit_bias_of_100_forces_its_token(client):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0.8, seed=3,
                                    logit_bias={"42": 100}, extra_body={"return_token_ids": True})
    assert out.choices[0].model_extra["token_ids"] == [42] * 4


def test_special_tokens_show_only_when_asked(client, llm):
    """EOS forced by a bias, past which ignore_eos goes on."""
    eos = llm.tokenizer.eos_token_id
    body = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0, logit_bias={str(eos): 100})
    hidden = client.completions.create(**body, extra_body={"ignore_eos": True}).choices[0].text
    shown = client.completions.create(**body, extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert hidden == "" and shown.choices[0].text == llm.tokenizer.eos_token * 3


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output_keeps_the_stop_string(client, llm, stream):
    text = generate(llm, llm.tokenizer.encode(PROMPT), 24, ignore_eos=True)["text"]
    stop = text[5:8]
    body = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop], stream=stream)

    def text_of(**extra):
        out = client.completions.create(**body, extra_body={"ignore_eos": True, **extra})
        return "".join(c.choices[0].text for c in out) if stream else out.choices[0].text

    cut = text.index(stop)
    assert text_of() == text[:cut]
    assert text_of(include_stop_str_in_output=True) == text[:cut + len(stop)]


@pytest.mark.parametrize("stream", [False, True])
def test_echo_puts_the_prompt_first(client, llm, stream):
    prompts = [PROMPT, "Numbers such as one"]
    out = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=6, temperature=0, n=2, echo=True,
                                    stream=stream, extra_body={"ignore_eos": True})
    texts = {}
    for chunk in out if stream else [out]:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    for index in range(4):
        prompt = prompts[index // 2]
        assert texts[index] == prompt + generate(llm, llm.tokenizer.encode(prompt), 6, ignore_eos=True)["text"]


def test_echo_of_token_ids_decodes_them(client, llm):
    ids = llm.tokenizer.encode(PROMPT)
    out = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=4, temperature=0, echo=True,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == llm.tokenizer.decode(ids) + generate(llm, ids, 4, ignore_eos=True)["text"]


def test_echo_with_logprobs_is_refused_naming_echo(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, echo=True, logprobs=1)
    assert error.value.body["param"] == "echo"
