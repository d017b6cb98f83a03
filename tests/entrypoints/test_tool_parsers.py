"""The tool-call and reasoning parsers on injected text: what a whole output parses to, and that
the same text streamed in any split (at every position, and a character at a time) gives the same
content, reasoning and calls, with no markup in the content and calls in OpenAI's streamed shape."""
import json

import llguidance
import llguidance.hf
import pytest
from transformers import AutoTokenizer

from nanovllm.entrypoints.chat_output import MessageParser
from nanovllm.entrypoints.reasoning import Qwen3ReasoningParser
from nanovllm.entrypoints.tool_parsers import PARSERS

CASES = [  # parser, output text, content, [(name, arguments)]
    ("hermes", 'Sure. <tool_call>\n{"name": "get", "arguments": {"city": "Paris é", "n": [1, {"x": "}"}]}}\n'
               '</tool_call>\n<tool_call>{"arguments": "{\\"a\\": 1}", "name": "b"}</tool_call> done',
     "Sure. done", [("get", '{"city": "Paris é", "n": [1, {"x": "}"}]}'), ("b", '{"a": 1}')]),
    ("hermes", "<tool_call>\n{\"name\": \"f\"}\n</tool_call>", None, [("f", "{}")]),
    ("hermes", "no calls here <tool", "no calls here <tool", []),
    ("hermes", 'bad <tool_call>{"nam": 1}</tool_call> after', 'bad <tool_call>{"nam": 1}</tool_call> after', []),
    ("hermes", "x <tool_call>not json</tool_call>", "x <tool_call>not json</tool_call>", []),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}', None,
     [("f", '{"a": 1}'), ("g", "{}")]),
    ("llama3_json", '{"name": "f", "arguments": {"q": "a;b"}}', None, [("f", '{"q": "a;b"}')]),
    ("llama3_json", 'Hello {"name": "f"}', 'Hello {"name": "f"}', []),
    ("llama3_json", '{"x": 2}', '{"x": 2}', []),
    ("mistral", 'ok [TOOL_CALLS][{"name": "f", "arguments": {"a": "é"}}, {"name": "g", "arguments": {}}]', "ok",
     [("f", '{"a": "é"}'), ("g", "{}")]),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{"b": [2]} tail', "tail",
     [("f", '{"a": 1}'), ("g", '{"b": [2]}')]),
    ("mistral", "plain [TOOL", "plain [TOOL", []),
]


def parse(parser, pieces: list[str]):
    """Feeds `pieces`; returns (content or None, reasoning, calls) as a client assembles them,
    checking each delta's shape."""
    content, reasoning, calls = "", "", []
    for i, piece in enumerate(pieces):
        delta = parser.feed(piece, final=i == len(pieces) - 1)
        content, reasoning = content + delta.content, reasoning + delta.reasoning
        for call in delta.tool_calls:
            if call.id is not None:  # a call's first delta: named, empty arguments
                assert call.index == len(calls) and call.id.startswith("call_") and call.name and call.arguments == ""
                calls.append([call.name, ""])
            else:
                assert call.name is None and call.index == len(calls) - 1
                calls[call.index][1] += call.arguments
    return content or None, reasoning, [tuple(call) for call in calls]


def splits(text: str):
    yield [text]
    yield list(text) or [""]
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_tool_parser_whole_and_streamed_at_every_split(name, text, content, calls):
    for pieces in splits(text):
        assert parse(MessageParser(None, PARSERS[name]()), pieces) == (content, "", calls), pieces


def test_call_ids_are_unique():
    parser = PARSERS["hermes"]()
    _, deltas = parser.feed('<tool_call>{"name": "a"}</tool_call><tool_call>{"name": "a"}</tool_call>', final=True)
    ids = [d.id for d in deltas if d.id is not None]
    assert len(ids) == 2 and len(set(ids)) == 2


@pytest.mark.parametrize("mode, text, reasoning, content", [
    ("may", "<think>\nlet me see</think>\n\nThe answer", "\nlet me see", "The answer"),
    ("open", "thinking only ends here</think>answer", "thinking only ends here", "answer"),
    ("open", "still thinking <", "still thinking <", None),
    ("may", "  no reasoning at all", "", "  no reasoning at all"),
    ("off", "<think>x</think>y", "x", "y"),
])
def test_reasoning_split_whole_and_streamed(mode, text, reasoning, content):
    for pieces in splits(text):
        assert parse(MessageParser(Qwen3ReasoningParser(mode), None), pieces) == (content, reasoning, []), pieces


def test_reasoning_then_tool_call():
    text = '<think>call f</think>\n<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    for pieces in splits(text):
        parser = MessageParser(Qwen3ReasoningParser("may"), PARSERS["hermes"]())
        assert parse(parser, pieces) == (None, "call f", [("f", '{"a": 1}')]), pieces


@pytest.mark.parametrize("prompt, mode", [
    ("<|im_start|>assistant\n<think>\n", "open"),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "off"),
    ("<|im_start|>assistant\n", "may"),
])
def test_reasoning_mode_from_the_prompt(prompt, mode):
    assert Qwen3ReasoningParser.reasoning_mode(prompt, "... <think> ...") == mode
    assert Qwen3ReasoningParser.reasoning_mode("<|im_start|>assistant\n", "no tags") == "off"


TOOLS = [{"name": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                            "required": ["city"]}},
         {"name": "noop"}]


@pytest.mark.parametrize("name, parallel, good, bad", [
    ("hermes", True, '<tool_call>\n{"name": "weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
                     '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "weather", "arguments": {}}\n</tool_call>'),
    ("llama3_json", False, '{"name": "weather", "parameters": {"city": "Rome"}}',
     '{"name": "other", "parameters": {}}'),
    ("mistral", True, '[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Rome"}},{"name": "noop", '
                      '"arguments": {}}]', '[TOOL_CALLS][{"name": "weather", "arguments": {"town": "Rome"}}]'),
])
def test_grammars_accept_their_format_and_parse_back(chat_checkpoint, name, parallel, good, bad):
    tokenizer = AutoTokenizer.from_pretrained(chat_checkpoint)
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer)
    grammar = PARSERS[name].grammar(TOOLS, parallel, tokenizer)

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(ll_tokenizer, llguidance.grammar_from("grammar", grammar), log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher.consume_tokens(tokenizer.encode(text)) and matcher.is_accepting()

    assert accepts(good) and not accepts(bad)
    _, _, calls = parse(MessageParser(None, PARSERS[name]()), [good])
    assert [(call, json.loads(arguments)) for call, arguments in calls] == \
        [("weather", {"city": "Rome"}), ("noop", {})][:len(calls)]


def test_mistral_grammar_with_its_special_tokens(chat_checkpoint):
    """A tokenizer with [TOOL_CALLS] and [ARGS] as tokens gets the newer name[ARGS]{...} format."""
    tokenizer = AutoTokenizer.from_pretrained(chat_checkpoint)
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    grammar = PARSERS["mistral"].grammar(TOOLS, True, tokenizer)
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer)),
                                   llguidance.grammar_from("grammar", grammar), log_level=0)
    text = '[TOOL_CALLS]weather[ARGS]{"city": "Rome"}[TOOL_CALLS]noop[ARGS]{}'
    assert matcher.consume_tokens(tokenizer.encode(text)) and matcher.is_accepting(), matcher.get_error()
    _, _, calls = parse(MessageParser(None, PARSERS["mistral"]()), [text])
    assert calls == [("weather", '{"city": "Rome"}'), ("noop", "{}")]
