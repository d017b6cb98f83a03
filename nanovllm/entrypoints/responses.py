"""POST /v1/responses, OpenAI's Responses API in its stateless subset (what the OpenAI Agents SDK
sends by default): the request becomes a chat request (input items to messages, function_call
and function_call_output items to assistant tool calls and tool messages, instructions to a
system message, text.format to response_format), which runs through the chat path; its parsed
output becomes reasoning, message and function_call items, whole or as Responses stream events.
Fields that need state or tools the server lacks (previous_response_id, store, background,
built-in tools) are a 400 naming the field."""
import copy
import json
import time
import uuid
from typing import Annotated, Literal

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from nanovllm.entrypoints.chat_output import MessageDelta
from nanovllm.entrypoints.errors import APIError, stream_error
from nanovllm.entrypoints.protocol import ChatCompletionRequest, FunctionDefinition, Int64, JsonSchemaFormat, Text

# chat field -> the Responses field it came from, for errors
CHAT_FIELDS = {"messages": "input", "response_format": "text", "max_completion_tokens": "max_output_tokens"}
# field -> the values that ask for nothing; anything else is a 400
UNSUPPORTED = {"previous_response_id": (), "store": (False,), "background": (False,), "conversation": (),
               "prompt": ()}


class TextPart(BaseModel):
    type: Literal["input_text", "output_text", "text"]
    text: Text


class MessageItem(BaseModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[TextPart]


class FunctionCallItem(BaseModel):
    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text


class FunctionCallOutputItem(BaseModel):
    type: Literal["function_call_output"]
    call_id: Text
    output: Text | list[TextPart]


class ReasoningItem(BaseModel):
    """An earlier turn's reasoning, sent back by clients; not shown to the model again."""
    type: Literal["reasoning"]


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
                      Field(discriminator="type")]


class FunctionTool(FunctionDefinition):
    type: Literal["function"]  # built-in tools (web_search, file_search...) are refused


class NamedFunction(BaseModel):
    type: Literal["function"]
    name: Text


class TextFormat(JsonSchemaFormat):
    type: Literal["text", "json_object", "json_schema"]


class TextConfig(BaseModel):
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept to check UNSUPPORTED
    model: Text | None = None
    input: Text | list[InputItem]
    instructions: Text | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    # extensions, as on chat
    seed: Int64 | None = None
    stop: Text | list[Text] | None = None

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, data):
        """Nulls take defaults; a message item may leave out its type."""
        if not isinstance(data, dict):
            return data
        data = {k: v for k, v in data.items() if v is not None}
        if isinstance(data.get("input"), list):
            data["input"] = [{"type": "message", **item} if isinstance(item, dict) and "type" not in item
                             and "role" in item else item for item in data["input"]]
        return data

    def unsupported(self) -> str | None:
        extra = self.model_extra
        return next((name for name, off in UNSUPPORTED.items() if name in extra and extra[name] not in off), None)

    def chat_request(self) -> ChatCompletionRequest:
        fmt = self.text.format if self.text is not None else None
        tools = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                 for tool in self.tools or []]
        choice = self.tool_choice
        body = dict(messages=self.messages(), tools=tools or None, parallel_tool_calls=self.parallel_tool_calls,
                    tool_choice={"type": "function", "function": {"name": choice.name}}
                    if isinstance(choice, NamedFunction) else choice,
                    response_format=None if fmt is None else {"type": fmt.type, "json_schema": fmt.model_dump(
                        by_alias=True, exclude={"type"}, exclude_none=True) if fmt.type == "json_schema" else None},
                    max_completion_tokens=self.max_output_tokens, temperature=self.temperature, top_p=self.top_p,
                    seed=self.seed, stop=self.stop)
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            field = CHAT_FIELDS.get(str(exc.errors()[0]["loc"][0]), str(exc.errors()[0]["loc"][0]))
            raise APIError(400, f"{field}: {exc.errors()[0]['msg']}", param=field) from None

    def messages(self) -> list[dict]:
        """The input as chat messages: consecutive function_call items make one assistant
        message's tool calls."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        for item in [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input:
            if isinstance(item, MessageItem):
                role = "system" if item.role == "developer" else item.role
                messages.append({"role": role, "content": part_text(item.content)})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else {}
                if last.get("role") == "assistant" and not last.get("content"):
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": part_text(item.output)})
        return messages


def part_text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """A response's output items built from the parsed output as it arrives: one item open at a
    time (reasoning, a message, a function call), closed when another kind of output comes.
    Each add() and close() returns the stream events it makes (without sequence numbers)."""

    def __init__(self):
        self.items: list[dict] = []
        self.open: dict | None = None
        self.num_calls = 0

    def add(self, parsed: MessageDelta) -> list[dict]:
        events = []
        if parsed.reasoning:
            events += self._ensure("reasoning")
            self.open["content"][0]["text"] += parsed.reasoning
            events.append(self._event("response.reasoning_text.delta", content_index=0, delta=parsed.reasoning))
        if parsed.content:
            events += self._ensure("message")
            self.open["content"][0]["text"] += parsed.content
            events.append(self._event("response.output_text.delta", content_index=0, delta=parsed.content,
                                      logprobs=[]))
        for delta in parsed.tool_calls:
            if delta.id is not None:  # a new call
                events += self._ensure("function_call", delta.id, delta.name)
            if delta.arguments:
                self.open["arguments"] += delta.arguments
                events.append(self._event("response.function_call_arguments.delta", delta=delta.arguments))
        return events

    def _ensure(self, kind: str, call_id: str | None = None, name: str | None = None) -> list[dict]:
        """Opens an item of `kind` unless one is open (a new call always opens one)."""
        if self.open is not None and self.open["type"] == kind and kind != "function_call":
            return []
        events = self.close()
        if kind == "reasoning":
            self.open = {"id": item_id("rs"), "type": "reasoning", "summary": [],
                         "content": [{"type": "reasoning_text", "text": ""}]}
        elif kind == "message":
            self.open = {"id": item_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                         "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
        else:
            self.open = {"id": item_id("fc"), "type": "function_call", "call_id": call_id, "name": name,
                         "arguments": "", "status": "in_progress"}
        events.append(self._event("response.output_item.added", item=self._snapshot()))
        if kind == "message":
            events.append(self._event("response.content_part.added", content_index=0,
                                      part={**self.open["content"][0], "text": ""}))
        return events

    def _snapshot(self) -> dict:
        """The open item as just opened (a message lists its parts as they are added)."""
        item = copy.deepcopy(self.open)
        return {**item, "content": []} if item["type"] == "message" else item

    def close(self, last: bool = False) -> list[dict]:
        """Closes the open item; the `last` close gives an output with no item an empty message."""
        if last and not self.items and self.open is None:
            return self._ensure("message") + self.close()
        item, events = self.open, []
        if item is None:
            return events
        if item["type"] == "reasoning":
            events.append(self._event("response.reasoning_text.done", content_index=0,
                                      text=item["content"][0]["text"]))
        elif item["type"] == "message":
            part = item["content"][0]
            events.append(self._event("response.output_text.done", content_index=0, text=part["text"], logprobs=[]))
            events.append(self._event("response.content_part.done", content_index=0, part=part))
        else:
            events.append(self._event("response.function_call_arguments.done", arguments=item["arguments"],
                                      name=item["name"]))
        if "status" in item:
            item["status"] = "completed"
        events.append(self._event("response.output_item.done", item=item))
        self.items.append(item)
        self.open = None
        return events

    def _event(self, kind: str, **fields) -> dict:
        output_index = len(self.items)
        return {"type": kind, "output_index": output_index, **fields} if kind.startswith("response.output_item") \
            else {"type": kind, "item_id": self.open["id"], "output_index": output_index, **fields}


class ResponsesHandler:
    """Runs one Responses request on the chat path of `server` (api_server's OpenAIServer)."""

    def __init__(self, server, request: ResponsesRequest):
        self.server, self.request = server, request
        self.id, self.created_at = item_id("resp"), int(time.time())

    async def respond(self, raw: Request):
        server, request = self.server, self.request
        server.check_model(request.model)
        server.check_ready()
        if (field := request.unsupported()) is not None:
            raise APIError(400, f"{field}: is not supported by this server (responses are not stored)", param=field)
        try:
            chat_request = request.chat_request()
            chat = await server.off_loop(server.prepare_chat, chat_request)
            choices, event = await server.start_choices(chat_request, [chat.prompt], chat, raw)
        except APIError as exc:
            raise responses_error(exc) from None
        choice, output = choices[0], OutputItems()
        if not request.stream:
            await server.run_to_end(choices, event, raw)
            output.add(choice.message.feed(choice.text.text, final=True))
            output.close(last=True)
            return self.response(output.items, choice, len(chat.prompt))

        async def events():
            yield self.response([], None, len(chat.prompt), "response.created")
            try:
                async for c, delta, _, _ in server.generate(choices, event):
                    for item_event in output.add(c.message.feed(delta, final=c.finish_reason is not None)):
                        yield item_event
                for item_event in output.close(last=True):
                    yield item_event
                yield self.response(output.items, choice, len(chat.prompt), "response.completed")
            except Exception as exc:
                error = stream_error(exc)
                yield {"type": "error", "code": error.code, "message": error.message, "param": None}
            finally:  # also when the client left: the task is cancelled
                server.finish(choices)

        return StreamingResponse(sse_events(events()), media_type="text/event-stream")

    def response(self, items: list[dict], choice, num_input: int, event: str | None = None) -> dict:
        """The Response object (wrapped in `event`, when given); `choice` None: in progress."""
        request, num_output = self.request, choice.state.num_tokens if choice is not None else 0
        status = "in_progress" if choice is None else "incomplete" if choice.finish_reason == "length" else "completed"
        fmt = request.text.format if request.text is not None and request.text.format is not None else None
        response = {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "error": None, "model": self.server.model_name, "output": items, "instructions": request.instructions,
            "tools": [tool.model_dump(exclude_none=True) for tool in request.tools or []],
            "tool_choice": (request.tool_choice.model_dump() if isinstance(request.tool_choice, NamedFunction)
                            else request.tool_choice or "auto"),
            "parallel_tool_calls": request.parallel_tool_calls, "temperature": request.temperature,
            "top_p": request.top_p, "max_output_tokens": request.max_output_tokens, "store": False,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "usage": None if choice is None else {
                "input_tokens": num_input, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": num_output,
                "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": num_input + num_output}}
        if event is None:
            return response
        return {"type": "response.incomplete" if status == "incomplete" and event == "response.completed" else event,
                "response": response}


async def sse_events(events):
    """Responses' server-sent events: each names its type, and carries its sequence number."""
    sequence_number = 0
    async for event in events:
        yield f"event: {event['type']}\ndata: {json.dumps({**event, 'sequence_number': sequence_number})}\n\n"
        sequence_number += 1


def responses_error(error: APIError) -> APIError:
    """An error of the chat path, naming the Responses field it came from."""
    field = CHAT_FIELDS.get(error.param)
    if field is not None:
        error.message, error.param = error.message.replace(error.param, field, 1), field
    return error
