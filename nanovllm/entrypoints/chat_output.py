"""A chat choice's output text split, as it arrives, into reasoning, content and tool calls:
the reasoning parser first, then the tool parser over what follows the reasoning."""
from dataclasses import dataclass, field

from nanovllm.entrypoints.reasoning import Qwen3ReasoningParser
from nanovllm.entrypoints.tool_parsers import ToolCallDelta, ToolParser


@dataclass
class MessageDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class MessageParser:
    def __init__(self, reasoning: Qwen3ReasoningParser | None, tools: ToolParser | None):
        self.reasoning, self.tools = reasoning, tools

    def feed(self, text: str, final: bool = False) -> MessageDelta:
        """What the output's next delta completes; `final`: the output ends with it."""
        reasoning, content = self.reasoning.feed(text, final) if self.reasoning is not None else ("", text)
        if self.tools is None:
            return MessageDelta(reasoning, content)
        content, calls = self.tools.feed(content, final)
        return MessageDelta(reasoning, content, calls)

    @property
    def called(self) -> bool:
        """Whether the output holds a tool call."""
        return self.tools is not None and self.tools.num_calls > 0
