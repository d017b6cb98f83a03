"""Structured output through the server with the official openai client: response_format
(json_schema, json_object) on chat and completions, vLLM's structured_outputs and guided_*
fields, and 400s naming the field for a constraint the engine cannot compile or for two at once."""
import json
import re

import jsonschema
import openai
import pytest

from servers import MODEL_NAME

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                           "rank": {"type": "integer", "minimum": 1, "maximum": 5},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["city", "rank", "tags"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Answer in JSON."}]


def test_chat_json_schema(client):
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, temperature=1.0, seed=3, n=4, max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}})
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_chat_json_schema_streamed(client):
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, temperature=1.0, seed=5, max_tokens=200, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_completions_json_object(client):
    response = client.completions.create(model=MODEL_NAME, prompt="JSON:", temperature=1.0, seed=1, n=3,
                                         max_tokens=200, extra_body={"response_format": {"type": "json_object"}})
    for choice in response.choices:
        if choice.finish_reason == "stop":  # any object: nothing bounds its size
            assert isinstance(json.loads(choice.text), dict)
        else:
            assert choice.text.startswith("{")


def test_guided_choice_and_structured_outputs_regex(client):
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=1.0, seed=2, n=4,
                                          extra_body={"guided_choice": ["left", "right"]})
    assert all(c.message.content in ("left", "right") and c.finish_reason == "stop" for c in chat.choices)
    completion = client.completions.create(model=MODEL_NAME, prompt="Code:", temperature=1.0, seed=2, max_tokens=50,
                                           extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}})
    assert re.fullmatch("[A-Z]{3}-[0-9]{2}", completion.choices[0].text)


@pytest.mark.parametrize("kwargs, param, reason", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nothing"}}}),
     "response_format", "cannot be compiled"),
    (dict(response_format={"type": "json_schema"}), "response_format", "needs a json_schema"),
    (dict(extra_body={"structured_outputs": {"regex": "a(b"}}), "structured_outputs", "cannot be compiled"),
    (dict(extra_body={"guided_grammar": 'root ::= "a" missing'}), "guided_grammar", "missing"),
    (dict(extra_body={"structured_outputs": {"choice": ["a"], "regex": "a"}}), "structured_outputs", "exactly one"),
    (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a+"}), "guided_regex",
     "only one output constraint"),
])
def test_bad_constraints_are_400s_naming_the_field(client, kwargs, param, reason):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, **kwargs)
    error = raised.value.body
    assert error["param"] == param and error["message"].startswith(param) and reason in error["message"], error
    assert client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2).choices  # still serving
