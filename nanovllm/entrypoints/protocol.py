"""Request and response bodies of the OpenAI-compatible API, as pydantic v2 models. Fields a
request adds that the server does not know are ignored, except those of UNSUPPORTED_FIELDS:
fields of OpenAI's and vLLM's APIs that the server does not implement, answered with a 400
naming the field unless they hold a value that asks for nothing. Integer fields fit int64 (the
server checks token ids against the vocabulary) and no string holds a lone surrogate: the field
is named in a 400 before anything reaches the tokenizer or the engine's tensors."""
import time
import uuid
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

INT64_MAX = 2**63 - 1
Int64 = Annotated[int, Field(ge=-INT64_MAX - 1, le=INT64_MAX)]


def _whole_characters(text: str) -> str:
    """JSON's \\uXXXX escapes can carry half a UTF-16 pair, which no tokenizer can encode."""
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise PydanticCustomError("lone_surrogate", "holds a lone surrogate at index {index}, which is not "
                                  "text", {"index": exc.start}) from None
    return text


Text = Annotated[str, AfterValidator(_whole_characters)]

# field -> the values that ask for nothing (some clients send them by default); null is always
# allowed (it means the field's default).
# echo: a field of completions; chat's is vLLM's other echo, of the last message. tools and
# tool_choice: fields of chat, which declares them.
UNSUPPORTED_FIELDS = {
    "echo": (False,), "suffix": ("",), "tools": ([],), "tool_choice": ("none",), "functions": ([],),
    "function_call": ("none",), "prompt_logprobs": (),
    "use_beam_search": (False,), "allowed_token_ids": (), "truncate_prompt_tokens": (),
}
# vLLM's older fields, each one StructuredOutputsParams field
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class JsonSchemaFormat(BaseModel):
    name: Text | None = None
    description: Text | None = None
    schema_: dict = Field(default_factory=dict, alias="schema")  # OpenAI's default: any JSON value
    strict: bool | None = None  # the schema is enforced either way


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's `structured_outputs` (StructuredOutputsParams' fields, checked by it)."""
    model_config = ConfigDict(extra="forbid")
    json_: dict | Text | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """The fields both generation endpoints share. Sampling values left out (None) take the
    checkpoint's generation_config.json defaults, then SamplingParams'."""
    model_config = ConfigDict(extra="allow")  # kept to check UNSUPPORTED_FIELDS

    model: Text | None = None
    max_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    seed: Int64 | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None  # checked against the vocabulary by the server
    ignore_eos: bool = False
    n: Int64 = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extension: each choice also carries its token ids (the new ones, when streamed).
    return_token_ids: bool = False
    # Penalties, biases and bans: SamplingParams' fields of the same names (checked there).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[Int64, float] | None = None  # JSON's keys are strings: "50256" -> 50256
    min_tokens: Int64 | None = None
    bad_words: list[Text] | None = None
    # vLLM's: the text of a stop string, EOS or stop token ends the output included; special
    # tokens' text shown.
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # A constraint on the output: at most one of these (structured_output() reads them)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data):
        """A field sent as null gets its default, as if left out (some clients send nulls)."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    def unsupported(self) -> str | None:
        """The first field set to a value the server cannot honour."""
        extra = self.model_extra
        return next((name for name, off in UNSUPPORTED_FIELDS.items() if name in extra and extra[name] not in off),
                    None)

    def requested_max_tokens(self) -> tuple[str, int | None]:
        return "max_tokens", self.max_tokens

    def structured_output(self) -> tuple[str, dict] | None:
        """(the field that asks, StructuredOutputsParams' arguments) of the request's constraint,
        None when it has none. ValueError naming the field when two fields ask, or when
        response_format is json_schema without a json_schema."""
        asked = []
        if self.response_format is not None and self.response_format.type != "text":
            fmt = self.response_format
            if fmt.type == "json_object":
                asked.append(("response_format", {"json_object": True}))
            elif fmt.json_schema is None:
                raise ValueError("response_format: type json_schema needs a json_schema")
            else:
                asked.append(("response_format", {"json": fmt.json_schema.schema_}))
        if self.structured_outputs is not None:
            fields = self.structured_outputs.model_dump(exclude_none=True)
            asked.append(("structured_outputs", {"json" if k == "json_" else k: v for k, v in fields.items()}))
        asked += [(name, {field: getattr(self, name)}) for name, field in GUIDED_FIELDS.items()
                  if getattr(self, name) is not None]
        if len(asked) > 1:
            raise ValueError(f"{asked[1][0]}: only one output constraint may be given, and {asked[0][0]} is one")
        return asked[0] if asked else None


class CompletionRequest(SamplingRequest):
    prompt: Text | list[Text] | list[int] | list[list[int]]  # token ids checked against the vocabulary
    logprobs: Int64 | None = None
    best_of: Int64 | None = None
    echo: bool = False  # the prompt's text leads each choice's text

    def unsupported(self) -> str | None:
        if self.best_of is not None and self.best_of != self.n:
            return "best_of"
        if self.echo and self.logprobs is not None:  # the prompt's log-probabilities are not computed
            return "echo"
        return super().unsupported()

    def requested_logprobs(self) -> tuple[str, int | None]:
        """The field that sets SamplingParams.logprobs, and its value."""
        return "logprobs", self.logprobs


class ContentPart(BaseModel):
    type: Text
    text: Text | None = None


class FunctionCallIn(BaseModel):
    name: Text
    arguments: Text | dict = "{}"  # OpenAI's JSON text; a dict is taken too


class ToolCallIn(BaseModel):
    """A call of an earlier assistant message in the history."""
    id: Text | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(BaseModel):
    role: Text
    content: Text | list[ContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant
    tool_call_id: Text | None = None  # tool
    name: Text | None = None
    reasoning_content: Text | None = None  # assistant: passed to templates that render it


class FunctionDefinition(BaseModel):
    name: Annotated[Text, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]  # OpenAI's names, and dotted ones
    description: Text | None = None
    parameters: dict | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None  # the schema is enforced when the call is (tool_choice), either way


class ToolDefinition(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: Text


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, "none" without
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict | None = None  # extra variables of the chat template (enable_thinking)

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value, info: ValidationInfo):
        if not info.data.get("logprobs"):
            raise PydanticCustomError("logprobs_required", "needs logprobs: true")
        return value

    def requested_max_tokens(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:  # OpenAI's newer name wins
            return "max_completion_tokens", self.max_completion_tokens
        return super().requested_max_tokens()

    def requested_logprobs(self) -> tuple[str, int | None]:
        return "top_logprobs", (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model: Text | None = None
    tokens: list[int]  # checked against the vocabulary by the server


# --- responses -------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def omitted_if_none():
    """A field left out of the JSON while None (OpenAI's null fields, like finish_reason, stay)."""
    return Field(default=None, exclude_if=lambda value: value is None)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy format: per token its string, its log-probability, and {string:
    log-probability} of it and the requested most likely tokens; text_offset[i] is the summed
    length of the strings of the choice's earlier tokens."""
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]  # the UTF-8 bytes of `token`


class ChatTokenLogprob(TokenLogprob):
    top_logprobs: list[TokenLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    token_ids: list[int] | None = omitted_if_none()


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = omitted_if_none()


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = omitted_if_none()
    tool_calls: list[ToolCall] | None = omitted_if_none()


ChatFinishReason = Literal["stop", "length", "tool_calls"]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinishReason | None = None
    token_ids: list[int] | None = omitted_if_none()


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(BaseModel):
    name: str | None = omitted_if_none()
    arguments: str


class ToolCallChunk(BaseModel):
    """A piece of a streamed call: the first names it (id, type, function.name), the others
    add to its arguments."""
    index: int
    id: str | None = omitted_if_none()
    type: Literal["function"] | None = omitted_if_none()
    function: FunctionCallDelta


class Delta(BaseModel):
    role: Literal["assistant"] | None = omitted_if_none()
    content: str | None = omitted_if_none()
    reasoning_content: str | None = omitted_if_none()
    tool_calls: list[ToolCallChunk] | None = omitted_if_none()


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinishReason | None = None
    token_ids: list[int] | None = omitted_if_none()


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = omitted_if_none()


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "nanovllm"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
