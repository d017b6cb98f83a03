"""Tool calls in a model's output text: each parser follows one model family's call format as
the text arrives, a delta at a time, and splits it into content and tool-call deltas in
OpenAI's streamed shape. A whole output is parsed by feeding it at once, so the streamed and
the non-streamed results agree by construction. Each parser also writes the llguidance grammar
that forces its format (tool_choice "required" or a named function).

| parser | families | format |
|---|---|---|
| hermes | qwen2, qwen3, qwen3_moe | <tool_call>{"name": ..., "arguments": {...}}</tool_call>, repeated |
| llama3_json | llama | {"name": ..., "parameters": {...}}, optionally after <|python_tag|>, several joined by ; |
| mistral | mistral | [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...] or [TOOL_CALLS]name[ARGS]{...}, repeated |

Markup never reaches the content, also when a tag is split over deltas: text that could still
become a tag is held back until it cannot. Whitespace next to markup is dropped. A call's first
delta carries its index, id, name and arguments ""; later ones carry argument text. An object
argument streams as the model writes it; any other value (a JSON string holding the object,
say) is sent once complete. Markup that yields no call name (broken JSON, no "name") is given
back as content, and everything after it is content."""
import json
import uuid
from dataclasses import dataclass

ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


def held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class JsonScanner:
    """Follows one JSON object or array as its text arrives: where it starts and ends, and the
    span of each member's value (of an object). Brackets and strings are followed, scalars are
    not checked: the caller parses the spans."""

    def __init__(self):
        self.text = ""
        self.start: int | None = None  # index of the opening bracket
        self.end: int | None = None  # index past the closing bracket, once it came
        self.failed = False  # the text does not start with an object or array
        self.members: dict[str, list] = {}  # key -> [value start, value end or None]
        self._depth = 0
        self._in_string = self._escape = False
        self._string_start = 0
        self._key: str | None = None  # the member whose value comes next or is being scanned
        self._expect_key = True

    def feed(self, text: str) -> str:
        """Scans `text`; returns what follows the value once it has ended."""
        offset = len(self.text)
        self.text += text
        for i in range(offset, len(self.text)):
            if self.end is not None or self.failed:
                break
            self._scan(i, self.text[i])
        return self.text[self.end:] if self.end is not None else ""

    def _scan(self, i: int, c: str) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
                if self._depth == 1:
                    self._string_closed(i)
            return
        if self._depth == 0:
            if c in "{[":
                self.start, self._depth = i, 1
            elif not c.isspace():
                self.failed = True
            return
        if self._depth == 1 and not c.isspace() and c not in ",:}]" and not self._expect_key \
                and self._key is not None and self._key not in self.members:
            self.members[self._key] = [i, None]
        if c == '"':
            self._in_string, self._string_start = True, i
        elif c in "{[":
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
            if self._depth == 1:
                self._value_ended(i + 1)
            elif self._depth == 0:
                self._value_ended(i, scalar=True)
                self.end = i + 1
        elif self._depth == 1 and c == ":":
            self._expect_key = False
        elif self._depth == 1 and c == ",":
            self._value_ended(i, scalar=True)
            self._expect_key, self._key = True, None

    def _string_closed(self, i: int) -> None:
        if self._expect_key:
            try:
                self._key = json.loads(self.text[self._string_start:i + 1])
            except json.JSONDecodeError:
                self.failed = True
        else:
            self._value_ended(i + 1)

    def _value_ended(self, end: int, scalar: bool = False) -> None:
        span = self.members.get(self._key)
        if span is not None and span[1] is None:
            span[1] = len(self.text[:end].rstrip()) if scalar else end

    def value(self, key: str) -> tuple[str, bool] | None:
        """A member's value text so far and whether it is complete; None before it starts."""
        span = self.members.get(key)
        if span is None:
            return None
        return self.text[span[0]:span[1]] if span[1] is not None else self.text[span[0]:], span[1] is not None

    def raw(self) -> str:
        """The value's text so far, from its opening bracket."""
        return "" if self.start is None else self.text[self.start:self.end]


def arguments_text(value: str) -> str:
    """A complete arguments value as OpenAI sends it: the JSON text of the arguments (a JSON
    string holding them is unwrapped)."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        return value
    return parsed if isinstance(parsed, str) else value


class ToolParser:
    """Base of the parsers: the calls found so far and the text not yet classified. A subclass
    implements _step, one state of its format's machine over self.pending."""
    name: str
    # Whether the format's tags are special tokens, which the text must keep to be parsed.
    keep_special_tokens = False

    def __init__(self):
        self.pending = ""
        self.content: list[str] = []
        self.deltas: list[ToolCallDelta] = []
        self.num_calls = 0
        self.plain = False  # everything from here on is content
        self._call: JsonScanner | None = None
        self._call_name: str | None = None  # the name of a call whose arguments are the scanner's value
        self._call_started = False
        self._sent = 0  # argument characters of the current call sent
        self._space = ""  # whitespace held back: it is dropped if markup follows
        self._after_markup = False
        self._emitted = False  # whether any content was given
        self._markup = ""  # the tag of the markup being read, given back if it names no call

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """The content and tool-call deltas that `text` (the output's next delta) completes;
        `final`: the output ends with it, nothing is held back."""
        self.pending += text
        if self.plain:
            self._add_content(self.pending)
            self.pending = ""
        else:
            self._parse(final)
        if final:
            self._finish()
        content, deltas = "".join(self.content), self.deltas
        self.content, self.deltas = [], []
        return content, deltas

    def _finish(self) -> None:
        if self._call is not None and not self._call_started:  # markup that named no call: content
            self._add_content(self._markup + self._call.text)
        self._call = None
        if self._space and not self._after_markup:
            self.content.append(self._space)
        self._space = ""

    def _parse(self, final: bool) -> None:
        """Consumes pending while the format's state machine advances; with `final`, all of it."""
        while not self.plain and self._step(final):
            pass

    def _step(self, final: bool) -> bool:
        """One state's work; False when it waits for more text."""
        raise NotImplementedError

    def _give_back(self, text: str) -> None:
        """Text that turned out not to be markup, and all that follows: content."""
        self.plain = True
        self._add_content(text + self.pending)
        self.pending = ""

    def _add_content(self, text: str) -> None:
        """Content, less the whitespace next to markup: trailing whitespace waits for more
        content, which also drops the whitespace leading it after markup."""
        if self._after_markup:
            text = text.lstrip()
            if not text:
                return
            self._after_markup = False
        stripped = text.rstrip()
        if stripped:
            self.content.append(self._space + stripped)
            self._space, self._emitted = "", True
        self._space += text[len(stripped):]

    def _markup_starts(self, markup: str) -> None:
        if not self._emitted:  # markup first: the whitespace before it leads nothing
            self._space = ""
        self._markup, self._after_markup = markup, True

    def _content_until(self, tag: str, final: bool) -> bool:
        """Moves pending text before `tag` to the content; True with pending starting after the
        tag when it came, False when pending holds at most the start of a tag."""
        index = self.pending.find(tag)
        if index < 0:
            keep = 0 if final else held_back(self.pending, tag)
            self._add_content(self.pending[:len(self.pending) - keep])
            self.pending = self.pending[len(self.pending) - keep:]
            return False
        self._add_content(self.pending[:index])
        self._markup_starts(tag)
        self.pending = self.pending[index + len(tag):]
        return True

    # --- calls ---------------------------------------------------------------------------------
    def _start_call(self, name: str | None = None) -> None:
        """A call's JSON comes next in pending: the call object ({"name", "arguments"}) when
        `name` is None, else its arguments."""
        self._call, self._call_name = JsonScanner(), name
        self._call_started, self._sent = False, 0

    def _scan_call(self) -> bool:
        """Feeds pending to the current call; True once it ended (pending then holds what
        follows). A call that is not JSON turns the rest of the output into content."""
        call = self._call
        self.pending = call.feed(self.pending)
        if call.failed or (call.end is not None and not self._call_started and self._name() is None):
            self._call = None
            self._give_back(self._markup + call.text[:call.end])
            return False
        self._send_call()
        if call.end is None:
            return False
        self._call = None
        self._after_markup = True
        return True

    def _name(self) -> str | None:
        if self._call_name is not None:
            return self._call_name
        value = self._call.value("name")
        if value is None or not value[1]:
            return None
        try:
            name = json.loads(value[0])
        except json.JSONDecodeError:
            return None
        return name if isinstance(name, str) else None

    def _arguments(self) -> tuple[str, bool, bool] | None:
        """(the arguments' text so far, whether complete, whether it streams as it comes)."""
        call = self._call
        if self._call_name is not None:
            return call.raw(), call.end is not None, True
        for key in ARGUMENT_KEYS:
            if (value := call.value(key)) is not None:
                return value[0], value[1], value[0][:1] in "{["
        return ("{}", True, False) if call.end is not None else None

    def _send_call(self) -> None:
        name = self._name()
        if name is None:
            return
        if not self._call_started:
            self._call_started = True
            self.deltas.append(ToolCallDelta(self.num_calls, f"call_{uuid.uuid4().hex[:24]}", name, ""))
            self.num_calls += 1
        arguments = self._arguments()
        if arguments is None:
            return
        text, complete, streams = arguments
        if not streams:
            if not complete or self._sent:
                return
            text = arguments_text(text)
        if len(text) > self._sent:
            self.deltas.append(ToolCallDelta(self.num_calls - 1, arguments=text[self._sent:]))
            self._sent = len(text)


class HermesParser(ToolParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self):
        super().__init__()
        self.state = "content"

    def _step(self, final: bool) -> bool:
        if self.state == "content":
            if not self._content_until(self.OPEN, final):
                return False
            self._start_call()
            self.state = "call"
        elif self.state == "call":
            if not self._scan_call():
                return False
            self.state = "close"
        else:  # after a call: its closing tag, if any
            rest = self.pending.lstrip()
            if rest.startswith(self.CLOSE):
                rest = rest[len(self.CLOSE):]
            elif self.CLOSE.startswith(rest):  # (the start of) the tag, or nothing yet
                self.pending = "" if final else rest
                return False
            self.pending, self.state = rest, "content"
        return True

    @classmethod
    def grammar(cls, tools: list[dict], parallel: bool, tokenizer) -> str:
        call = f'"{cls.OPEN}\\n" call_json "\\n{cls.CLOSE}"'
        return lark(f"call: {call}", "call", "\"\\n\"", parallel, call_schema(tools, "arguments"))


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"
    keep_special_tokens = True  # <|python_tag|>

    def __init__(self):
        super().__init__()
        self.state = "start"

    def _step(self, final: bool) -> bool:
        rest = self.pending.lstrip()
        if self.state == "call":
            if not self._scan_call():
                return False
            self.state = "between"
        elif not rest and not final:
            return False
        elif self.state == "start":  # calls make the whole output, JSON from its first character
            if rest.startswith(self.TAG) or rest.startswith("{"):
                markup = self.TAG if rest.startswith(self.TAG) else ""
                self._markup_starts(markup)
                self.pending = rest[len(markup):]
                self._start_call()
                self.state = "call"
            elif self.TAG.startswith(rest) and not final:
                return False
            else:
                self._give_back("")
        elif rest.startswith(";"):
            self._markup_starts("")
            self.pending = rest[1:]
            self._start_call()
            self.state = "call"
        else:
            self._give_back("")
        return True

    @classmethod
    def grammar(cls, tools: list[dict], parallel: bool, tokenizer) -> str:
        return lark("call: call_json", "call", '"; "', parallel, call_schema(tools, "parameters"))


class MistralParser(ToolParser):
    name = "mistral"
    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"
    keep_special_tokens = True  # [TOOL_CALLS], [ARGS]

    def __init__(self):
        super().__init__()
        self.state = "content"

    def _step(self, final: bool) -> bool:
        if self.state == "content":
            if not self._content_until(self.TAG, final):
                return False
            self.state = "open"
        elif self.state in ("call", "args"):
            if not self._scan_call():
                return False
            self.state = "list" if self.state == "call" else "content"
        elif self.state == "name":  # [TOOL_CALLS]name[ARGS]{...}
            index = self.pending.find(self.ARGS)
            if index < 0:
                if final:
                    self._give_back(self._markup)
                return False
            self._markup += self.pending[:index + len(self.ARGS)]
            self._start_call(self.pending[:index].strip())
            self.pending = self.pending[index + len(self.ARGS):]
            self.state = "args"
        else:  # open: a list or a name; list: [{...}, {...}]
            rest = self.pending.lstrip()
            if not rest:
                self.pending = ""
                return False
            if self.state == "open":
                self.pending, self.state = (rest[1:], "list") if rest[0] == "[" else (rest, "name")
            elif rest[0] == "{":
                self.pending = rest
                self._start_call()
                self.state = "call"
            elif rest[0] in ",]":
                self.pending = rest[1:]
                self.state = "list" if rest[0] == "," else "content"
            else:
                self._give_back("")
        return True

    @classmethod
    def grammar(cls, tools: list[dict], parallel: bool, tokenizer) -> str:
        tag = special_token(tokenizer, cls.TAG)
        args = special_token(tokenizer, cls.ARGS) if cls.ARGS in tokenizer.get_vocab() else None
        if args is None:  # the older format: one list of call objects
            return lark(f'call: {tag} "[" call_json ("," call_json)* "]"' if parallel else
                        f'call: {tag} "[" call_json "]"', "call", None, False, call_schema(tools, "arguments"))
        named = [f'{tag} {json.dumps(tool["name"])} {args} %json {json.dumps(parameters_schema(tool))}'
                 for tool in tools]
        return lark("call: " + " | ".join(named), "call", "", parallel, None)


PARSERS = {parser.name: parser for parser in (HermesParser, Llama3JsonParser, MistralParser)}
# architecture -> the parser of its family's call format
FAMILY_PARSERS = {"Qwen2ForCausalLM": "hermes", "Qwen2MoeForCausalLM": "hermes", "Qwen3ForCausalLM": "hermes",
                  "Qwen3MoeForCausalLM": "hermes", "LlamaForCausalLM": "llama3_json",
                  "MistralForCausalLM": "mistral"}


def parameters_schema(tool: dict) -> dict:
    return tool.get("parameters") or {"type": "object", "properties": {}}


def call_schema(tools: list[dict], arguments_key: str) -> dict:
    """The JSON schema of a call object naming one of `tools`, with arguments valid against its
    parameters schema; name first, so a streamed call is named before its arguments come."""
    variants = [{"type": "object", "properties": {"name": {"const": tool["name"]},
                                                  arguments_key: parameters_schema(tool)},
                 "required": ["name", arguments_key], "additionalProperties": False} for tool in tools]
    return variants[0] if len(variants) == 1 else {"anyOf": variants}


def lark(rules: str, call: str, separator: str | None, parallel: bool, schema: dict | None) -> str:
    """A Lark grammar of one call, or with `parallel` one or more joined by `separator`."""
    start = f"start: {call} ({separator} {call})*" if parallel else f"start: {call}"
    json_rule = f"\ncall_json: %json {json.dumps(schema)}" if schema is not None else ""
    return f"{start}\n{rules}{json_rule}\n"


def special_token(tokenizer, text: str) -> str:
    """A tag in a Lark grammar: its token when the tokenizer has it as one, else its text."""
    token_id = tokenizer.get_vocab().get(text)
    return f"<[{token_id}]>" if token_id is not None else json.dumps(text)
