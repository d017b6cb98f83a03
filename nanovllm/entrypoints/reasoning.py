"""Reasoning in a model's output: the text between <think> and </think> goes to
reasoning_content, the rest to content, a delta at a time (a tag split over deltas is held back
until it is whole or cannot be). Qwen3's templates may open the reasoning in the prompt (the
output then starts inside it, with no <think> of its own) or close it there (enable_thinking
false: no reasoning at all); reasoning_mode reads which from the prompt."""
from nanovllm.entrypoints.tool_parsers import held_back

# architecture -> the reasoning parser its checkpoints get unless --reasoning-parser says otherwise
FAMILY_REASONING_PARSERS = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3"}


class Qwen3ReasoningParser:
    name = "qwen3"
    START, END = "<think>", "</think>"

    def __init__(self, mode: str):
        """`mode`: reasoning_mode's."""
        self.state = "reasoning" if mode == "open" else "start"
        self.pending = ""

    @classmethod
    def reasoning_mode(cls, prompt: str, chat_template: str) -> str:
        """"open": the prompt opened the reasoning; "may": the output may open it (the template
        knows the tag and the prompt did not close it); "off": it will not reason."""
        prompt = prompt.rstrip()
        if prompt.endswith(cls.START):
            return "open"
        return "may" if cls.START in chat_template and not prompt.endswith(cls.END) else "off"

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) that `text`, the output's next delta, completes; `final`: the
        output ends with it."""
        self.pending += text
        reasoning = ""
        if self.state == "start":  # the output may open with <think>, after whitespace
            rest = self.pending.lstrip()
            if rest.startswith(self.START):
                self.pending, self.state = rest[len(self.START):], "reasoning"
            elif self.START.startswith(rest) and not final:
                return "", ""
            else:
                self.state = "content"
        if self.state == "reasoning":
            index = self.pending.find(self.END)
            if index < 0:
                cut = len(self.pending) - (0 if final else held_back(self.pending, self.END))
                reasoning, self.pending = self.pending[:cut], self.pending[cut:]
                return reasoning, ""
            reasoning, self.pending = self.pending[:index], self.pending[index + len(self.END):]
            self.state = "after"
        if self.state == "after":  # the whitespace that follows </think> leads nothing
            self.pending = self.pending.lstrip()
            if not self.pending and not final:
                return reasoning, ""
            self.state = "content"
        content, self.pending = self.pending, ""
        return reasoning, content


REASONING_PARSERS = {"qwen3": Qwen3ReasoningParser}
