"""The OpenAI-compatible HTTP server: FastAPI routes over an AsyncEngine (engine_loop.py), or a
DataParallelEngine of several for --data-parallel-size > 1.

Handlers never run the model: they turn a request into engine requests (one per prompt and
choice), wait on an asyncio.Event that the engine handle sets as tokens arrive, and turn the
tokens into text (detokenizer.py). A client that goes away aborts its engine requests. Prompts
are tokenized on a thread of their own, so that a long one holds up neither /health nor the
streams of others."""
import asyncio
import concurrent.futures
import contextlib
import functools
import itertools
import json
import secrets
import signal
import socket
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import metadata

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanovllm.entrypoints import DEFAULT_MAX_ENGINE_RESTARTS, DEFAULT_MAX_REQUEST_BYTES
from nanovllm.entrypoints.chat_output import MessageDelta, MessageParser
from nanovllm.entrypoints.detokenizer import TextStream
from nanovllm.entrypoints.engine_loop import AsyncEngine, DataParallelEngine, EngineDeadError, RequestState
from nanovllm.entrypoints.errors import APIError, engine_error, shorten, stream_error
from nanovllm.entrypoints.metrics import ServerMetrics
from nanovllm.entrypoints.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                           ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs, ChatMessage,
                                           ChatTokenLogprob, CompletionChoice, CompletionLogprobs, CompletionRequest,
                                           CompletionResponse, Delta, DetokenizeRequest, FunctionCall,
                                           FunctionCallDelta, ModelCard, ModelList, SamplingRequest, TokenizeRequest,
                                           TokenLogprob, ToolCall, ToolCallChunk, Usage, new_id)
from nanovllm.entrypoints.reasoning import FAMILY_REASONING_PARSERS, REASONING_PARSERS
from nanovllm.entrypoints.responses import ResponsesHandler, ResponsesRequest
from nanovllm.entrypoints.tool_parsers import FAMILY_PARSERS, PARSERS, ToolCallDelta
from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams

# A completion request without max_tokens gets OpenAI's default; a chat request gets the room
# left in max_model_len.
DEFAULT_COMPLETION_MAX_TOKENS = 16
MAX_N = 128  # choices a request may ask for
# Seconds requests ended at --shutdown-timeout get to send their error before uvicorn cancels them.
SHUTDOWN_GRACE = 5.0
OPEN_PATHS = ("/health", "/metrics")  # probes and scrapers: open also with --api-key
SAMPLING_DEFAULT_FIELDS = ("temperature", "top_k", "top_p", "min_p")
# SamplingRequest's fields that go to SamplingParams as they are, when set
SAMPLING_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
                   "bad_words")


class ClientDisconnected(Exception):
    pass


def bad_request(exc: ValueError, param: str | None = None) -> APIError:
    """A 400 for a ValueError whose message starts with the field it is about ("top_p: ...")."""
    message = str(exc)
    field = message.split(":", 1)[0] if ":" in message else None
    return APIError(400, message, param=param or (field if field and field.isidentifier() else None))


def constraint_error(exc: ValueError, field: str) -> APIError:
    """A 400 for an output constraint that StructuredOutputsParams or the engine refused (its
    message names structured_outputs), naming the request's field instead."""
    message = str(exc)
    if message.startswith("structured_outputs"):
        message = f"{field}:{message.split(':', 1)[1]}"
    return APIError(400, message, param=field)


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    """Token ids are checked before they reach a tensor (an id past int64 would overflow it)."""
    for token_id in token_ids:
        if not 0 <= token_id < vocab_size:
            raise APIError(400, f"{param}: token ids must be in [0, {vocab_size}), got {shorten(str(token_id))}",
                           param=param)


def sse(payload) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


@dataclass
class ChatPlan:
    """A chat request made ready for the engine: its prompt, its output constraint (the field
    that asks, its params) and how its output is parsed."""
    prompt: list[int]
    constraint: tuple[str | None, StructuredOutputsParams | None]
    reasoning: type | None  # a reasoning parser class, or None
    reasoning_mode: str  # the parser's reasoning_mode of the prompt
    tool_parser: type | None  # a tool parser class, or None: calls are not parsed

    def message_parser(self) -> MessageParser:
        return MessageParser(self.reasoning(self.reasoning_mode) if self.reasoning is not None else None,
                             self.tool_parser() if self.tool_parser is not None else None)


class Choice:
    """One choice of a response: its engine request and its text so far; `message` parses a
    chat choice's text into reasoning, content and tool calls."""

    def __init__(self, index: int, state: RequestState, text: TextStream, stop_token_ids: set[int],
                 message: MessageParser | None = None):
        self.index, self.state, self.text, self.message = index, state, text, message
        # the tokens that end the output by being drawn; a grammar's end finishes it as "stop" too
        self.stop_token_ids = stop_token_ids
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] = []  # one a token, when the request asked
        self.text_offset = 0  # summed length of the token strings given log-probabilities so far (completions)
        self.finish_reason: str | None = None

    @property
    def chat_finish_reason(self) -> str | None:
        """finish_reason, "tool_calls" for an output that ended by itself after calling tools."""
        return "tool_calls" if self.finish_reason == "stop" and self.message.called else self.finish_reason

    def advance(self) -> tuple[str, list[int], list[dict[int, float]]]:
        """Takes the tokens that arrived: the text delta, the new token ids and their
        log-probabilities. Sets finish_reason once the output is complete (engine finish or
        stop string)."""
        state = self.state
        token_ids, logprobs = state.take()
        if state.error is not None:
            raise state.error
        self.token_ids += token_ids
        self.logprobs += logprobs
        engine_reason = state.finish_reason
        stop_token = engine_reason == "stop" and bool(self.token_ids) and self.token_ids[-1] in self.stop_token_ids
        delta, stopped = self.text.add(token_ids, final=engine_reason is not None, stop_token=stop_token)
        if stopped or engine_reason is not None:
            self.finish_reason = "stop" if stopped else engine_reason
        return delta, token_ids, logprobs


class OpenAIServer:
    def __init__(self, model: str, engine_args: dict, served_model_name: str | None = None,
                 max_queue: int | None = None, engine_class=None,
                 max_engine_restarts: int = DEFAULT_MAX_ENGINE_RESTARTS, reasoning_parser: str | None = None,
                 tool_call_parser: str | None = None):
        self.model_dir = model
        # None: the checkpoint family's (FAMILY_REASONING_PARSERS, FAMILY_PARSERS); "none": off
        self.reasoning_parser, self.tool_call_parser = reasoning_parser, tool_call_parser
        self.model_name = served_model_name or model
        self.max_queue = max_queue
        self.metrics = ServerMetrics(self.model_name, lambda: self.engine.stats)
        engine_cls = DataParallelEngine if engine_args.get("data_parallel_size", 1) > 1 else AsyncEngine
        self.engine = engine_cls(model, engine_args, self.metrics, engine_class, max_restarts=max_engine_restarts)
        self.engine.on_ready = self._became_ready
        self.on_ready = None  # called each time /health turns 200
        self.tokenizer = None
        self.tokenizer_loaded = False
        # Tokenization and chat templates run here, off the event loop: a long prompt must not
        # stall other requests and /health. One thread, as a tokenizer is not made for
        # concurrent encodes.
        self.tokenizer_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nanovllm-tokenizer")

    # --- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        await self.engine.start()
        self._tokenizer_task = asyncio.create_task(self._load_tokenizer())

    async def _load_tokenizer(self) -> None:
        from nanovllm.engine.llm_engine import load_tokenizer
        try:
            self.tokenizer = await asyncio.to_thread(load_tokenizer, self.model_dir)
        except Exception as exc:
            self.engine.give_up(f"the tokenizer failed to load: {type(exc).__name__}: {exc}")
            return
        self.tokenizer_loaded = True
        self._became_ready()

    def _became_ready(self) -> None:
        if self.ready and self.on_ready is not None:
            self.on_ready()

    async def shutdown(self) -> None:
        self._tokenizer_task.cancel()
        self.tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        await self.engine.shutdown()

    @property
    def ready(self) -> bool:
        return self.engine.ready and self.tokenizer_loaded

    def check_ready(self) -> None:
        if not self.ready:
            error = self.engine.error
            raise APIError(503, f"the engine is not running: {error}" if error else "the model is still loading",
                           code="engine_unavailable", headers={"Retry-After": "1"})

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model {shorten(repr(name))} does not exist; this server serves "
                                f"{self.model_name!r}", param="model", code="model_not_found")

    async def off_loop(self, fn, *args):
        """fn(*args) on the tokenizer's thread."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, fn, *args)

    # --- prompts ----------------------------------------------------------------------------
    def _encode(self, text: str, param: str) -> list[int]:
        if self.tokenizer is None:
            raise APIError(400, f"{param}: this model has no tokenizer; send token ids", param=param)
        return self.tokenizer.encode(text)

    def completion_prompts(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self._encode(prompt, "prompt")]
        if not prompt:
            raise APIError(400, "prompt: is empty", param="prompt")
        prompts = [prompt] if isinstance(prompt[0], int) else [
            self._encode(p, "prompt") if isinstance(p, str) else p for p in prompt]
        for token_ids in prompts:
            check_token_ids(token_ids, self.engine.info["vocab_size"], "prompt")
        return prompts

    def chat_prompt(self, messages: list[ChatMessage]) -> list[int]:
        return self.tokenizer.encode(self.render_chat(messages), add_special_tokens=False)

    def render_chat(self, messages: list[ChatMessage], tools: list[dict] | None = None,
                    template_kwargs: dict | None = None) -> str:
        """The prompt's text: the conversation through the chat template, with `tools` (OpenAI's
        tool definitions) and the request's chat_template_kwargs."""
        if not messages:
            raise APIError(400, "messages: must hold at least one message", param="messages")
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "messages: this model's tokenizer has no chat template; use /v1/completions",
                           param="messages")
        conversation = [template_message(i, message) for i, message in enumerate(messages)]
        try:
            return self.tokenizer.apply_chat_template(conversation, **{**(template_kwargs or {}), "tools": tools},
                                                      add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # the template rejects the conversation (jinja raise_exception)
            raise APIError(400, f"messages: the chat template rejected them: {exc}", param="messages") from None

    def prepare_chat(self, request: ChatCompletionRequest) -> ChatPlan:
        """The prompt, constraint and parsers of a chat request (on the tokenizer's thread)."""
        tools, tool_parser, forced = self.tool_use(request)
        text = self.render_chat(request.messages, tools, request.chat_template_kwargs)
        reasoning = REASONING_PARSERS.get(self.parser_name(self.reasoning_parser, FAMILY_REASONING_PARSERS))
        mode = reasoning.reasoning_mode(text, str(self.tokenizer.chat_template)) if reasoning is not None else "off"
        # the grammar starts once the reasoning has ended
        reasoning_end = reasoning.END if mode != "off" else None
        constraint = self.constraint(request, reasoning_end)
        if forced is not None:
            if constraint[0] is not None:
                raise APIError(400, f"{constraint[0]}: cannot be combined with a tool_choice that forces a call",
                               param=constraint[0])
            constraint = "tools", StructuredOutputsParams(grammar=forced, reasoning_end=reasoning_end)
        return ChatPlan(self.tokenizer.encode(text, add_special_tokens=False), constraint, reasoning, mode, tool_parser)

    def parser_name(self, chosen: str | None, families: dict[str, str]) -> str | None:
        if chosen is not None:
            return None if chosen == "none" else chosen
        return families.get(self.engine.info.get("architecture"))

    def tool_use(self, request: ChatCompletionRequest) -> tuple[list[dict] | None, type | None, str | None]:
        """(the tools the template is given, the parser of the output's calls, the Lark grammar
        that forces calls). tool_choice "none": the model is not told of the tools."""
        choice = request.tool_choice
        if not request.tools:
            if choice not in (None, "none"):
                raise APIError(400, "tool_choice: needs tools", param="tool_choice")
            return None, None, None
        if choice == "none":
            return None, None, None
        functions = [tool.function.model_dump(exclude_none=True) for tool in request.tools]
        names = [function["name"] for function in functions]
        if len(set(names)) < len(names):
            raise APIError(400, "tools: two tools have the same name", param="tools")
        name = self.parser_name(self.tool_call_parser, FAMILY_PARSERS)
        if name is None:
            raise APIError(400, f"tools: this server has no tool-call parser for {self.engine.info.get('architecture')}"
                                "; start it with --tool-call-parser", param="tools")
        parser = PARSERS[name]
        template_tools = [{"type": "function", "function": function} for function in functions]
        if choice in (None, "auto"):
            return template_tools, parser, None
        if choice == "required":
            return template_tools, parser, parser.grammar(functions, request.parallel_tool_calls, self.tokenizer)
        chosen = [function for function in functions if function["name"] == choice.function.name]
        if not chosen:
            raise APIError(400, f"tool_choice: no tool is named {shorten(repr(choice.function.name))}",
                           param="tool_choice")
        return template_tools, parser, parser.grammar(chosen, False, self.tokenizer)

    # --- generation -------------------------------------------------------------------------
    def sampling_params(self, request: SamplingRequest, prompt_len: int, seed_offset: int, chat: bool,
                        prompt_param: str, constraint: StructuredOutputsParams | None = None) -> SamplingParams:
        """The engine's parameters for one choice. max_tokens is clamped to the room the prompt
        leaves in max_model_len; a prompt that leaves none is rejected."""
        max_model_len = self.engine.info["max_model_len"]
        room = max_model_len - prompt_len
        if room < 1:
            raise APIError(400, f"{prompt_param}: {prompt_len} tokens leave no room for output in "
                                f"max_model_len={max_model_len}", param=prompt_param, code="context_length_exceeded")
        max_tokens_field, max_tokens = request.requested_max_tokens()
        logprobs_field, logprobs = request.requested_logprobs()
        if max_tokens is None:
            max_tokens = room if chat else DEFAULT_COMPLETION_MAX_TOKENS
        defaults = self.engine.info["sampling_defaults"]
        sampling = {name: getattr(request, name) if getattr(request, name) is not None else defaults.get(name)
                    for name in SAMPLING_DEFAULT_FIELDS}
        try:
            return SamplingParams(max_tokens=min(max_tokens, room), ignore_eos=request.ignore_eos,
                                  stop_token_ids=request.stop_token_ids, logprobs=logprobs,
                                  seed=None if request.seed is None else request.seed + seed_offset,
                                  structured_outputs=constraint,
                                  **{k: v for k, v in sampling.items() if v is not None},
                                  **{k: getattr(request, k) for k in SAMPLING_FIELDS if getattr(request, k) is not None})
        except ValueError as exc:
            error = bad_request(exc)
            # the request's name for the field: max_completion_tokens, top_logprobs on chat
            field = {"max_tokens": max_tokens_field, "logprobs": logprobs_field}.get(error.param)
            if field is not None:
                error.param, error.message = field, error.message.replace(error.param, field, 1)
            raise error from None

    def check_request(self, request: SamplingRequest) -> list[str]:
        """Checks what the engine does not; returns the stop strings."""
        if (field := request.unsupported()) is not None:
            raise APIError(400, f"{field}: is not supported by this server", param=field)
        if not 1 <= request.n <= MAX_N:
            raise APIError(400, f"n: must be in [1, {MAX_N}], got {request.n}", param="n")
        if request.stream_options is not None and not request.stream:
            raise APIError(400, "stream_options: is only allowed with stream=true", param="stream_options")
        stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
        if any(not s for s in stop):
            raise APIError(400, "stop: stop strings must not be empty", param="stop")
        if stop and self.tokenizer is None:
            raise APIError(400, "stop: this model has no tokenizer to match stop strings with", param="stop")
        check_token_ids(request.stop_token_ids or [], self.engine.info["vocab_size"], "stop_token_ids")
        check_token_ids(list(request.logit_bias or {}), self.engine.info["vocab_size"], "logit_bias")
        if request.bad_words and self.tokenizer is None:
            raise APIError(400, "bad_words: this model has no tokenizer to tokenize them with", param="bad_words")
        if self.max_queue is not None and self.engine.num_waiting >= self.max_queue:
            raise APIError(429, f"{self.engine.num_waiting} requests are already waiting (--max-queue "
                                f"{self.max_queue}); retry later", code="queue_full", headers={"Retry-After": "1"})
        return stop

    def constraint(self, request: SamplingRequest,
                   reasoning_end: str | None = None) -> tuple[str | None, StructuredOutputsParams | None]:
        """(the field that asks, its StructuredOutputsParams) of the request's output constraint."""
        try:
            asked = request.structured_output()
        except ValueError as exc:
            raise bad_request(exc) from None
        if asked is None:
            return None, None
        field, arguments = asked
        if self.tokenizer is None:
            raise APIError(400, f"{field}: this model has no tokenizer to build a grammar's token masks", param=field)
        try:
            return field, StructuredOutputsParams(**arguments, reasoning_end=reasoning_end)
        except ValueError as exc:
            raise constraint_error(exc, field) from None

    async def start_choices(self, request: SamplingRequest, prompts: list[list[int]], chat: ChatPlan | None,
                            raw: Request) -> tuple[list[Choice], asyncio.Event]:
        """Queues one engine request per prompt and choice and waits until the engine accepted
        them all; on any error (or a client gone meanwhile) none is left running."""
        self.check_ready()  # again: the engine may have died while the prompt was tokenized
        stop = self.check_request(request)
        constraint_field, constraint = chat.constraint if chat else self.constraint(request)
        # a format whose tags are special tokens needs their text to be parsed
        keep_special = chat is not None and chat.tool_parser is not None and chat.tool_parser.keep_special_tokens
        skip_special_tokens = request.skip_special_tokens and not keep_special
        prompt_param = "messages" if chat else "prompt"
        params = [[self.sampling_params(request, len(p), i, chat, prompt_param, constraint) for i in range(request.n)]
                  for p in prompts]
        event = asyncio.Event()
        stop_token_ids = set(request.stop_token_ids or []) | set(() if request.ignore_eos else
                                                                 self.engine.info["eos_token_ids"])
        choices = []
        for prompt, prompt_params in zip(prompts, params):
            for sp in prompt_params:
                state = self.engine.add(prompt, sp, event)
                choices.append(Choice(len(choices), state, TextStream(self.tokenizer, stop, skip_special_tokens,
                                                                      request.include_stop_str_in_output),
                                      stop_token_ids, chat.message_parser() if chat else None))
        try:
            await until_disconnected(raw, self._accepted(choices, event, prompt_param, constraint_field))
        except ClientDisconnected:
            self.finish(choices)
            raise
        except BaseException:
            self.engine.abort([c.state for c in choices])
            raise
        self.metrics.prompt_tokens(sum(map(len, prompts)) * request.n)
        return choices, event

    @staticmethod
    async def _accepted(choices: list[Choice], event: asyncio.Event, prompt_param: str,
                        constraint_field: str | None) -> None:
        while not all(c.state.accepted for c in choices):
            for c in choices:
                if isinstance(c.state.error, ValueError) and str(c.state.error).startswith("structured_outputs"):
                    raise constraint_error(c.state.error, constraint_field or "structured_outputs")
                if isinstance(c.state.error, ValueError):
                    raise bad_request(c.state.error, prompt_param if str(c.state.error).startswith("prompt") else None)
                if c.state.error is not None:
                    raise engine_error(c.state.error)
            await event.wait()
            event.clear()
        event.set()  # tokens may have come with the acceptance

    def finish(self, choices: list[Choice]) -> None:
        """Aborts what is still running and counts each choice's end."""
        self.engine.abort([c.state for c in choices])
        now = time.perf_counter()
        for c in choices:
            reason = c.finish_reason or ("error" if c.state.error is not None else "abort")
            self.metrics.finished(reason, now - c.state.arrival)

    async def generate(self, choices: list[Choice], event: asyncio.Event):
        """Yields (choice, delta, new token ids, their log-probabilities) as output arrives, until
        every choice is done; a choice's last yield has its finish_reason set."""
        running = list(choices)
        while running:
            await event.wait()
            event.clear()
            for c in list(running):
                if not c.state.new_token_ids and not c.state.done:
                    continue
                delta, token_ids, logprobs = c.advance()
                if c.finish_reason is not None:
                    running.remove(c)
                    self.engine.abort([c.state])  # a stop string ended it: the engine may still run it
                yield c, delta, token_ids, logprobs

    async def collect(self, choices: list[Choice], event: asyncio.Event) -> None:
        async for _ in self.generate(choices, event):
            pass

    def usage(self, prompts: list[list[int]], choices: list[Choice]) -> Usage:
        prompt_tokens = sum(map(len, prompts))
        completion_tokens = sum(c.state.num_tokens for c in choices)
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)

    # --- log-probabilities ------------------------------------------------------------------
    def token_string(self, token_id: int) -> str:
        """A token as log-probabilities name it: the tokenizer's decode of it alone (a piece of
        a multi-byte character decodes to U+FFFD), or "token_id:N" without a tokenizer."""
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"token_id:{token_id}"

    def completion_logprobs(self, c: Choice, token_ids: list[int], entries: list[dict]) -> CompletionLogprobs:
        """OpenAI's legacy format; each token's top_logprobs holds the sampled token and the
        `logprobs` most likely. Tokens whose strings are equal (byte pieces that all decode to
        U+FFFD) share a key, which keeps the sampled token's value, else the most likely's. Text
        offsets continue from the choice's earlier chunks."""
        tokens = [self.token_string(t) for t in token_ids]
        offsets = list(itertools.accumulate(map(len, tokens), initial=c.text_offset))
        c.text_offset = offsets.pop()
        top_logprobs = []
        for entry in entries:  # the sampled token first, then the others most likely first
            top = {}
            for token_id, logprob in entry.items():
                top.setdefault(self.token_string(token_id), logprob)
            top_logprobs.append(top)
        return CompletionLogprobs(tokens=tokens, token_logprobs=[e[t] for t, e in zip(token_ids, entries)],
                                  top_logprobs=top_logprobs, text_offset=offsets)

    def chat_logprobs(self, token_ids: list[int], entries: list[dict], num_top: int) -> ChatLogprobs:
        """Chat's format: each token with its `num_top` most likely tokens, most likely first."""
        def token(token_id: int, logprob: float) -> dict:
            text = self.token_string(token_id)
            return dict(token=text, logprob=logprob, bytes=list(text.encode()))

        def most_likely(entry: dict) -> list[TokenLogprob]:
            ranked = sorted(entry.items(), key=lambda item: item[1], reverse=True)
            return [TokenLogprob(**token(i, v)) for i, v in ranked[:num_top]]

        return ChatLogprobs(content=[ChatTokenLogprob(**token(t, e[t]), top_logprobs=most_likely(e))
                                     for t, e in zip(token_ids, entries)])

    # --- endpoints --------------------------------------------------------------------------
    async def completions(self, request: CompletionRequest, raw: Request):
        self.check_model(request.model)
        self.check_ready()
        return await self.respond(request, await self.off_loop(self.completion_prompts, request.prompt), raw,
                                  chat=None)

    async def chat_completions(self, request: ChatCompletionRequest, raw: Request):
        self.check_model(request.model)
        self.check_ready()
        chat = await self.off_loop(self.prepare_chat, request)
        return await self.respond(request, [chat.prompt], raw, chat=chat)

    async def respond(self, request: SamplingRequest, prompts: list[list[int]], raw: Request, chat: ChatPlan | None):
        """Runs the request's choices and answers with the whole response, or streams it."""
        choices, event = await self.start_choices(request, prompts, chat, raw)
        response_id, created = new_id("chatcmpl" if chat else "cmpl"), int(time.time())
        echoed = [] if chat or not request.echo else self.echo_texts(request, prompts)
        with_ids = request.return_token_ids
        num_logprobs = request.requested_logprobs()[1]
        with_logprobs = num_logprobs is not None

        def chunk(choices_out: list, usage: Usage | None = None):
            return (ChatCompletionChunk if chat else CompletionResponse)(
                id=response_id, created=created, model=self.model_name, choices=choices_out, usage=usage)

        def choice_out(c: Choice, text: str, token_ids: list[int], entries: list[dict], streamed: bool,
                       parsed: MessageDelta | None = None):
            logprobs = None
            if with_logprobs:
                logprobs = (self.chat_logprobs(token_ids, entries, num_logprobs) if chat
                            else self.completion_logprobs(c, token_ids, entries))
            token_ids = token_ids if with_ids else None
            if not chat:
                return CompletionChoice(index=c.index, text=text, logprobs=logprobs, finish_reason=c.finish_reason,
                                        token_ids=token_ids)
            if streamed:
                return ChatChunkChoice(index=c.index, delta=chat_delta(parsed), logprobs=logprobs,
                                       finish_reason=c.chat_finish_reason, token_ids=token_ids)
            message = assistant_message(c.message.feed(text, final=True), c.message.called)
            return ChatChoice(index=c.index, message=message, logprobs=logprobs, finish_reason=c.chat_finish_reason,
                              token_ids=token_ids)

        if request.stream:
            async def deltas():
                for c in choices if chat else ():  # the first delta of each choice carries the role
                    yield sse(chunk([ChatChunkChoice(index=c.index, delta=Delta(role="assistant", content=""))]))
                for c in choices if echoed else ():
                    yield sse(chunk([CompletionChoice(index=c.index, text=echoed[c.index // request.n])]))
                async for c, delta, token_ids, logprobs in self.generate(choices, event):
                    parsed = c.message.feed(delta, final=c.finish_reason is not None) if chat else None
                    shown = (parsed.content or parsed.reasoning or parsed.tool_calls) if chat else delta
                    # every token's ids and log-probabilities are sent, also while its text is held back
                    if shown or c.finish_reason or ((with_ids or with_logprobs) and token_ids):
                        yield sse(chunk([choice_out(c, delta, token_ids, logprobs, streamed=True, parsed=parsed)]))

            return self.stream(deltas(), choices, request, lambda: chunk([], self.usage(prompts, choices)))
        await self.run_to_end(choices, event, raw)
        choices_out = [choice_out(c, (echoed[c.index // request.n] if echoed else "") + c.text.text, c.token_ids,
                                  c.logprobs, streamed=False) for c in choices]
        usage = self.usage(prompts, choices)
        if chat:
            return ChatCompletionResponse(id=response_id, created=created, model=self.model_name,
                                          choices=choices_out, usage=usage)
        return chunk(choices_out, usage)

    def echo_texts(self, request: CompletionRequest, prompts: list[list[int]]) -> list[str]:
        """Each prompt's text for echo: the string sent, else its token ids decoded."""
        sent = [request.prompt] if isinstance(request.prompt, str) or isinstance(request.prompt[0], int) \
            else request.prompt
        if self.tokenizer is None:
            return [""] * len(prompts)
        return [item if isinstance(item, str) else
                self.tokenizer.decode(ids, skip_special_tokens=request.skip_special_tokens)
                for item, ids in zip(sent, prompts)]

    async def run_to_end(self, choices: list[Choice], event: asyncio.Event, raw: Request) -> None:
        try:
            await until_disconnected(raw, self.collect(choices, event))
        except EngineDeadError as exc:
            raise engine_error(exc) from None
        finally:
            self.finish(choices)

    def stream(self, deltas, choices: list[Choice], request: SamplingRequest, usage_chunk) -> StreamingResponse:
        """Server-sent events: the deltas, an optional usage chunk, then [DONE]. An error
        midway (the engine died) is sent as an error event before [DONE]."""
        include_usage = request.stream_options is not None and request.stream_options.include_usage

        async def events():
            try:
                async for event in deltas:
                    yield event
                if include_usage:
                    yield sse(usage_chunk())
            except Exception as exc:
                yield sse(stream_error(exc).body())
            finally:  # also when the client left: the task is cancelled
                self.finish(choices)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def tokenize(self, request: TokenizeRequest) -> dict:
        self.check_model(request.model)
        self.check_ready()
        if (request.prompt is None) == (request.messages is None):
            raise APIError(400, "prompt: give either prompt or messages", param="prompt")
        if request.messages is not None:
            tokens = await self.off_loop(self.chat_prompt, request.messages)
        elif self.tokenizer is None:
            raise APIError(400, "prompt: this model has no tokenizer", param="prompt")
        else:
            tokens = await self.off_loop(functools.partial(
                self.tokenizer.encode, request.prompt, add_special_tokens=request.add_special_tokens))
        return {"count": len(tokens), "max_model_len": self.engine.info["max_model_len"], "tokens": tokens}

    async def detokenize(self, request: DetokenizeRequest) -> dict:
        self.check_model(request.model)
        self.check_ready()
        if self.tokenizer is None:
            raise APIError(400, "tokens: this model has no tokenizer", param="tokens")
        check_token_ids(request.tokens, len(self.tokenizer), "tokens")
        return {"prompt": await self.off_loop(self.tokenizer.decode, request.tokens)}


def template_message(i: int, message: ChatMessage) -> dict:
    """A message as chat templates take it: text content, a call's arguments as a dict (templates
    render them with tojson), the tool fields when set."""
    content = message.content
    if isinstance(content, list):
        if any(part.type != "text" or part.text is None for part in content):
            raise APIError(400, f"messages.{i}.content: only text parts are supported", param="messages")
        content = "".join(part.text for part in content)
    out = {"role": message.role, "content": content or ""}
    if message.tool_calls:
        out["tool_calls"] = [{"id": call.id, "type": "function",
                              "function": {"name": call.function.name,
                                           "arguments": call_arguments(call.function.arguments, i)}}
                             for call in message.tool_calls]
    for key in ("tool_call_id", "name", "reasoning_content"):
        if getattr(message, key) is not None:
            out[key] = getattr(message, key)
    return out


def call_arguments(arguments: str | dict, i: int) -> dict:
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise APIError(400, f"messages.{i}.tool_calls: arguments must be a JSON object, got "
                            f"{shorten(repr(arguments))}", param="messages")
    return parsed


def tool_calls(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """The calls that a whole output's deltas make."""
    calls = []
    for delta in deltas:
        if delta.id is not None:
            calls.append(ToolCall(id=delta.id, function=FunctionCall(name=delta.name, arguments=delta.arguments)))
        else:
            calls[delta.index].function.arguments += delta.arguments
    return calls


def assistant_message(parsed: MessageDelta, called: bool) -> AssistantMessage:
    """A whole output's message; its content is null when calls or reasoning took all of it."""
    return AssistantMessage(content=parsed.content or (None if called or parsed.reasoning else ""),
                            reasoning_content=parsed.reasoning or None, tool_calls=tool_calls(parsed.tool_calls) or None)


def chat_delta(parsed: MessageDelta) -> Delta:
    chunks = [ToolCallChunk(index=d.index, id=d.id, type="function" if d.id is not None else None,
                            function=FunctionCallDelta(name=d.name, arguments=d.arguments)) for d in parsed.tool_calls]
    return Delta(content=parsed.content or None, reasoning_content=parsed.reasoning or None, tool_calls=chunks or None)


async def until_disconnected(raw: Request, awaitable):
    """Runs `awaitable` unless the client disconnects first; then it is cancelled and
    ClientDisconnected raised."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_disconnected(raw))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        disconnected = not task.done()
        task.cancel()
    if disconnected:
        raise ClientDisconnected
    return task.result()


async def _disconnected(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


# --- the application ---------------------------------------------------------------------------
def build_app(model: str, engine_args: dict, served_model_name: str | None = None, api_key: str | None = None,
              max_queue: int | None = None, engine_class=None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              max_engine_restarts: int = DEFAULT_MAX_ENGINE_RESTARTS, enable_docs: bool = False,
              reasoning_parser: str | None = None, tool_call_parser: str | None = None) -> FastAPI:
    """The FastAPI app serving `model`; the engine process starts with the app (lifespan) and
    loads in the background: /health answers 503 until it is ready. `enable_docs`: serve
    /docs, /redoc and /openapi.json. `reasoning_parser`, `tool_call_parser`: a parser's name,
    "none" (reasoning: off), or None for the checkpoint family's."""
    server = OpenAIServer(model, engine_args, served_model_name, max_queue, engine_class, max_engine_restarts,
                          reasoning_parser, tool_call_parser)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await server.start()
        try:
            yield
        finally:
            await server.shutdown()

    docs = {} if enable_docs else dict(docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(title="nanovllm", lifespan=lifespan, **docs)
    app.state.server = server
    app.add_middleware(RequestGuard, api_key=api_key, max_request_bytes=max_request_bytes)
    install_error_handlers(app)

    v1 = APIRouter(prefix="/v1")

    @v1.post("/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw: Request):
        return await server.chat_completions(request, raw)

    @v1.post("/responses")
    async def responses(request: ResponsesRequest, raw: Request):
        return await ResponsesHandler(server, request).respond(raw)

    @v1.post("/completions")
    async def completions(request: CompletionRequest, raw: Request):
        return await server.completions(request, raw)

    @v1.get("/models")
    async def models() -> ModelList:
        info = server.engine.info or {}
        return ModelList(data=[ModelCard(id=server.model_name, root=server.model_dir,
                                         max_model_len=info.get("max_model_len", 0))])

    app.include_router(v1)

    @app.get("/health")
    async def health():
        server.check_ready()
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        try:
            return {"version": metadata.version("nanovllm")}
        except metadata.PackageNotFoundError:  # run from a source tree that is not installed
            return {"version": "unknown"}

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest):
        return await server.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest):
        return await server.detokenize(request)

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


class RequestGuard:
    """ASGI middleware that checks a request before the app reads it: the API key on every path
    but OPEN_PATHS, and the body's size, a 413 past max_request_bytes (counted as the body
    arrives too: a chunked body declares no length)."""

    def __init__(self, app, api_key: str | None, max_request_bytes: int):
        self.app, self.api_key, self.max_request_bytes = app, api_key, max_request_bytes
        self.too_large = f"the request body is larger than {max_request_bytes} bytes (--max-request-bytes)"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        if self.api_key is not None and scope["path"] not in OPEN_PATHS and not secrets.compare_digest(
                headers.get("authorization", "").encode(), f"Bearer {self.api_key}".encode()):
            error = APIError(401, "missing or wrong API key (Authorization: Bearer KEY)", code="invalid_api_key")
            return await error.response()(scope, receive, send)
        if int(headers.get("content-length") or 0) > self.max_request_bytes:
            return await APIError(413, self.too_large).response()(scope, receive, send)
        received = 0

        async def receive_counted():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_request_bytes:  # FastAPI passes an HTTPException through its body parsing
                raise StarletteHTTPException(413, self.too_large)
            return message

        await self.app(scope, receive_counted, send)


def install_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape; invalid fields are 400s (FastAPI would answer 422)."""

    @app.exception_handler(APIError)
    async def api_error(_, exc: APIError):
        return exc.response()

    @app.exception_handler(ClientDisconnected)
    async def client_gone(_, exc: ClientDisconnected):
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, exc: RequestValidationError):
        errors = exc.errors()
        if errors[0].get("type") == "json_invalid":
            return APIError(400, f"the body is not valid JSON: {errors[0].get('ctx', {}).get('error', '')}").response()
        param = str(errors[0]["loc"][1]) if len(errors[0]["loc"]) > 1 else None  # loc[0] is "body"
        errors = [e for e in errors if e["loc"][1:2] == errors[0]["loc"][1:2]]
        # A union field (prompt, stop) fails once per accepted form: the forms of the value's own
        # type (whose error is not a type mismatch) tell what is wrong with it.
        errors = [e for e in errors if not e["type"].endswith("_type")] or errors
        messages = list(dict.fromkeys(e["msg"] for e in errors))
        if len(messages) > 1:
            return APIError(400, f"{param}: matches none of its accepted forms ({'; '.join(messages)})",
                            param=param).response()
        return APIError(400, f"{param or 'body'}: {messages[0]}", param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, exc: StarletteHTTPException):
        return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def internal_error(_, exc: Exception):
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()


class Server(uvicorn.Server):
    """uvicorn's server, except that SIGTERM and Ctrl-C, once the graceful shutdown is done,
    end the process with exit code 0 (uvicorn raises the signal again after it), and that the
    requests still running `shutdown_timeout` seconds into it end with an error (a stream: an
    error event, then [DONE]) rather than being cut off."""

    def __init__(self, app: FastAPI, shutdown_timeout: float, log_level: str):
        super().__init__(uvicorn.Config(app, log_level=log_level,
                                        timeout_graceful_shutdown=shutdown_timeout + SHUTDOWN_GRACE))
        self.engine, self.shutdown_timeout = app.state.server.engine, shutdown_timeout

    async def shutdown(self, sockets=None) -> None:
        end = asyncio.get_running_loop().call_later(self.shutdown_timeout, self.engine.fail,
                                                    "the server is shutting down")
        try:
            await super().shutdown(sockets)
        finally:
            end.cancel()

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0: the OS picks one). Made with proto IPPROTO_TCP: asyncio
    sets TCP_NODELAY only on such sockets, and without it a response's body waits for the
    client's delayed ACK of its headers."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def serve(model: str, engine_args: dict, host: str = "127.0.0.1", port: int = 8000,
          served_model_name: str | None = None, api_key: str | None = None, max_queue: int | None = None,
          shutdown_timeout: float = 30.0, log_level: str = "info", max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
          max_engine_restarts: int = DEFAULT_MAX_ENGINE_RESTARTS, enable_docs: bool = False,
          reasoning_parser: str | None = None, tool_call_parser: str | None = None) -> int:
    """Runs the server until SIGTERM or Ctrl-C; returns the exit code (1 if the engine failed to
    load, or died more often than it may be restarted)."""
    sock = bind_socket(host, port)
    app = build_app(model, engine_args, served_model_name, api_key, max_queue, max_request_bytes=max_request_bytes,
                    max_engine_restarts=max_engine_restarts, enable_docs=enable_docs, reasoning_parser=reasoning_parser,
                    tool_call_parser=tool_call_parser)
    server = Server(app, shutdown_timeout, log_level)
    failure = []

    def on_fatal(message: str) -> None:
        print(f"nanovllm serve: {message}; shutting down", flush=True)
        failure.append(message)
        server.should_exit = True

    url = f"http://{host}:{sock.getsockname()[1]}"
    app.state.server.engine.on_fatal = on_fatal
    app.state.server.on_ready = lambda: print(f"nanovllm serve: ready on {url}", flush=True)
    print(f"nanovllm serve: {app.state.server.model_name} on {url}", flush=True)
    server.run(sockets=[sock])
    return 1 if failure else 0
