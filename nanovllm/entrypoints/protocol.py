"""Request and response bodies of the OpenAI-compatible API, as pydantic v2 models. Fields a
request adds that the server does not know are ignored; known OpenAI fields that the engine
cannot honour are named by `unsupported()` and answered with a 400."""
import time
import uuid
from typing import Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """The fields both generation endpoints share. Sampling values left out (None) take the
    checkpoint's generation_config.json defaults, then SamplingParams'."""
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extension: each choice also carries its token ids (the new ones, when streamed).
    return_token_ids: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data):
        """A field sent as null gets its default, as if left out (some clients send nulls)."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    def unsupported(self) -> str | None:
        """The first field set to a value the engine cannot honour."""
        if self.presence_penalty or self.frequency_penalty:
            return "presence_penalty" if self.presence_penalty else "frequency_penalty"
        return "logit_bias" if self.logit_bias else None

    def requested_max_tokens(self) -> tuple[str, int | None]:
        return "max_tokens", self.max_tokens


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> str | None:
        if self.echo or self.suffix:
            return "echo" if self.echo else "suffix"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of"
        return super().unsupported()

    def requested_logprobs(self) -> tuple[str, int | None]:
        """The field that sets SamplingParams.logprobs, and its value."""
        return "logprobs", self.logprobs


class ContentPart(BaseModel):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    response_format: dict | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value, info: ValidationInfo):
        if not info.data.get("logprobs"):
            raise PydanticCustomError("logprobs_required", "needs logprobs: true")
        return value

    def unsupported(self) -> str | None:
        if self.tools:
            return "tools"
        if self.response_format and self.response_format.get("type", "text") != "text":
            return "response_format"
        return super().unsupported()

    def requested_max_tokens(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:  # OpenAI's newer name wins
            return "max_completion_tokens", self.max_completion_tokens
        return super().requested_max_tokens()

    def requested_logprobs(self) -> tuple[str, int | None]:
        return "top_logprobs", (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


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


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    token_ids: list[int] | None = omitted_if_none()


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = omitted_if_none()
    content: str | None = omitted_if_none()


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
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
