"""/v1/responses through the official openai client: text, structured text, forced function
calls, a history with function_call and function_call_output items, streamed events in the
order and shape the client parses, and 400s for fields that need state or built-in tools."""
import json

import jsonschema
import openai
import pytest

from servers import MODEL_NAME, RunningServer

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "name": "weather", "description": "forecast", "parameters": WEATHER, "strict": True}]


@pytest.fixture(scope="module")
def server(tools_checkpoint):
    running = RunningServer(tools_checkpoint, dict(max_model_len=1024, num_kvcache_blocks=512)).start()
    yield running
    running.stop()


def test_text_and_incomplete(client):
    response = client.responses.create(model=MODEL_NAME, input="Hello", instructions="Be brief.",
                                       max_output_tokens=8)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert response.output_text == message.content[0].text and response.output_text
    assert response.usage.output_tokens == 8 and response.usage.total_tokens == response.usage.input_tokens + 8


def test_json_schema_format(client):
    response = client.responses.create(
        model=MODEL_NAME, input=[{"role": "user", "content": [{"type": "input_text", "text": "JSON please"}]}],
        temperature=1.0, text={"format": {"type": "json_schema", "name": "w", "schema": WEATHER, "strict": True}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), WEATHER)


def test_required_function_call_then_its_output(client):
    response = client.responses.create(model=MODEL_NAME, input="Weather in Rome?", tools=TOOLS,
                                       tool_choice="required", temperature=1.0, parallel_tool_calls=False)
    [call] = response.output
    assert call.type == "function_call" and call.name == "weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    follow_up = client.responses.create(model=MODEL_NAME, tools=TOOLS, max_output_tokens=5, input=[
        {"role": "user", "content": "Weather in Rome?"}, call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert follow_up.output[0].type == "message"


def test_streamed_events_match_the_whole_response(client):
    kwargs = dict(model=MODEL_NAME, input="Weather?", tools=TOOLS, temperature=1.0,
                  tool_choice={"type": "function", "name": "weather"})
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert types[1:3] == ["response.output_item.added", "response.function_call_arguments.delta"]
    assert types[-3:-1] == ["response.function_call_arguments.done", "response.output_item.done"]
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    final = events[-1].response
    assert arguments == final.output[0].arguments and final.output[0].name == "weather"
    jsonschema.validate(json.loads(arguments), WEATHER)
    assert [item.type for item in whole.output] == ["function_call"]
    text_events = list(client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=6, stream=True))
    kinds = [e.type for e in text_events]
    assert kinds[:4] == ["response.created", "response.output_item.added", "response.content_part.added",
                         "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    text = "".join(e.delta for e in text_events if e.type == "response.output_text.delta")
    assert text == text_events[-1].response.output_text == text_events[-4].text


@pytest.mark.parametrize("kwargs, param", [
    (dict(previous_response_id="resp_1"), "previous_response_id"),
    (dict(store=True), "store"),
    (dict(background=True), "background"),
    (dict(tools=[{"type": "web_search"}]), "tools"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "name": "nope"}), "tool_choice"),
    (dict(text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "nothing"}}}), "text"),
    (dict(input=[{"type": "function_call_output"}]), "input"),
])
def test_unsupported_and_bad_fields_are_400s(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(**{"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 2, **kwargs})
    assert raised.value.body["param"] == param, raised.value.body
