"""Tool calling and reasoning through the server with the official openai client, on the tiny
Qwen3 checkpoint with a Qwen-style template: tool_choice "required" and a named function force
calls whose arguments validate against the tool's schema (for each parser's format), streamed
calls in OpenAI's shape, the history's calls rendered with dict arguments, reasoning split
into reasoning_content, and 400s naming the field for bad tools and tool_choice."""
import json

import jsonschema
import openai
import pytest

from servers import MODEL_NAME, TIMEOUT, RunningServer

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
UNITS = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "units", "parameters": UNITS}}]
SCHEMAS = {"weather": WEATHER, "units": UNITS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tools_checkpoint):
    # the tools' JSON makes long prompts for the tiny byte-level tokenizer
    running = RunningServer(tools_checkpoint, dict(max_model_len=1024, num_kvcache_blocks=512)).start()
    yield running
    running.stop()


@pytest.fixture
def parser(server, request):
    """The server's tool-call parser for one test (each format's grammar and parser)."""
    server.app.state.server.tool_call_parser = request.param
    yield request.param
    server.app.state.server.tool_call_parser = None


def assert_valid_calls(message, names=SCHEMAS):
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({call.id for call in message.tool_calls}) == len(message.tool_calls)


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"], indirect=True)
@pytest.mark.parametrize("parallel", [True, False])
def test_required_always_calls_with_valid_arguments(client, parser, parallel):
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, n=4, seed=1,
                                              temperature=1.0, tool_choice="required",
                                              parallel_tool_calls=parallel)
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert_valid_calls(choice.message)
        assert choice.message.content is None
        assert parallel or len(choice.message.tool_calls) == 1


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"], indirect=True)
def test_named_function_streamed_equals_whole(client, parser):
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, seed=4, temperature=1.0,
                  tool_choice={"type": "function", "function": {"name": "units"}})
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert_valid_calls(whole.message, names=["units"])
    calls, reasons = [], []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        choice = chunk.choices[0]
        assert not choice.delta.content and not getattr(choice.delta, "reasoning_content", None)
        reasons.append(choice.finish_reason)
        for call in choice.delta.tool_calls or []:
            if call.id is not None:  # the first chunk of a call: named, arguments ""
                assert call.index == len(calls) and call.type == "function" and call.function.arguments == ""
                calls.append([call.id, call.function.name, ""])
            else:
                assert call.function.name is None and call.type is None
                calls[call.index][2] += call.function.arguments
    assert reasons[-1] == "tool_calls" and not any(reasons[:-1])
    assert [(name, args) for _, name, args in calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_auto_on_a_random_model_answers_in_text(client):
    choice = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=20).choices[0]
    assert choice.finish_reason == "length" and isinstance(choice.message.content, str)


def test_history_calls_render_with_dict_arguments(server):
    from nanovllm.entrypoints.protocol import ChatCompletionRequest
    request = ChatCompletionRequest(messages=[
        *MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather",
                                                              "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], tools=TOOLS)
    plan = server.app.state.server.prepare_chat(request)
    text = server.app.state.server.tokenizer.decode(plan.prompt)
    assert '<tool_call>{"name": "weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>' in text
    assert "<tool_response>sunny</tool_response>" in text and '"name": "units"' in text


def test_history_round_trip_through_the_client(client):
    first = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS,
                                           tool_choice="required", parallel_tool_calls=False).choices[0].message
    history = [*MESSAGES, first.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "sunny"}]
    second = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS, max_tokens=5)
    assert second.choices[0].finish_reason == "length"


def test_reasoning_when_the_template_opens_it(client):
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=30, extra_body={
        "chat_template_kwargs": {"enable_thinking": True}})
    message = client.chat.completions.create(**kwargs).choices[0].message
    assert message.reasoning_content and message.content is None  # </think> never came
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
    assert streamed == message.reasoning_content and not any(c.choices[0].delta.content for c in chunks)
    plain = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=30).choices[0].message
    assert plain.content and getattr(plain, "reasoning_content", None) is None


def test_constraints_wait_for_the_end_of_reasoning(client):
    """guided_choice starts after </think>, which a random model does not write: the output is
    reasoning, unconstrained; with thinking closed in the prompt it is one of the choices."""
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=20, temperature=1.0, seed=3)
    thinking = client.chat.completions.create(**kwargs, extra_body={
        "guided_choice": ["left", "right"], "chat_template_kwargs": {"enable_thinking": True}}).choices[0]
    assert thinking.finish_reason == "length" and thinking.message.reasoning_content
    closed = client.chat.completions.create(**kwargs, extra_body={"guided_choice": ["left", "right"]}).choices[0]
    assert closed.message.content in ("left", "right")


@pytest.mark.parametrize("kwargs, param", [
    (dict(tools=[{"type": "function"}]), "tools"),
    (dict(tools=[{"type": "retrieval", "function": {"name": "f"}}]), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "two words"}}]), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": "{}"}}]), "tools"),
    (dict(tools=TOOLS + TOOLS[:1]), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nothing"}}}],
          tool_choice="required"), "tools"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "missing"}}), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "response_format"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "units"}},
          extra_body={"guided_regex": "a+"}), "guided_regex"),
])
def test_bad_tools_and_tool_choice_are_400s_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, **kwargs)
    assert raised.value.body["param"] == param, raised.value.body


def test_tool_choice_none_ignores_the_tools(client):
    choice = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                            max_tokens=5).choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
