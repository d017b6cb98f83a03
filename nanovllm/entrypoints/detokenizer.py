"""Token ids to text, a few tokens at a time, for streaming: deltas never end in half a
character and never show a stop string, and their concatenation is the text of the whole
output."""

REPLACEMENT = "\ufffd"  # what a decoder gives for bytes that are not (yet) a whole character


class IncrementalDetokenizer:
    """Decodes only a window of the last tokens: the tokens of the previous delta (so a
    tokenizer that drops a word's leading space at the start of a decode still keeps it) and
    the new ones. Text ending in U+FFFD is held back: the next token may complete the
    character."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = self.read_offset = 0

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.token_ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int], final: bool = False) -> str:
        if self.tokenizer is None:  # token-id-only model folder: no text
            return ""
        self.token_ids.extend(token_ids)
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset)
        if len(new_text) <= len(prefix_text) or (new_text.endswith(REPLACEMENT) and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return new_text[len(prefix_text):]


class StopStringBuffer:
    """Holds back the last len(longest stop) - 1 characters, so a stop string split over two
    deltas is still found before any of it is sent."""

    def __init__(self, stop: list[str], include_stop: bool = False):
        self.stop, self.include_stop = stop, include_stop
        self.hold = max(map(len, stop), default=1) - 1
        self.pending = ""

    def add(self, text: str, final: bool = False) -> tuple[str, bool]:
        """Text that may be sent now (up to the stop string found, or through it with
        include_stop), and whether a stop string ended the output."""
        self.pending += text
        found = [(i, i + len(s) if self.include_stop else i) for i, s in ((self.pending.find(s), s) for s in self.stop)
                 if i >= 0]
        if found:
            out, self.pending = self.pending[:min(found)[1]], ""
            return out, True
        cut = len(self.pending) if final else max(len(self.pending) - self.hold, 0)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False


class TextStream:
    """One choice's output text. With `stop_token` the last token ended the output by being
    EOS or one of the request's stop_token_ids: as in OpenAI's API its text is left out, unless
    `include_stop` (which also keeps a stop string that ends the output)."""

    def __init__(self, tokenizer, stop: list[str], skip_special_tokens: bool = True, include_stop: bool = False):
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.stops = StopStringBuffer(stop, include_stop)
        self.include_stop = include_stop
        self.text = ""

    def add(self, token_ids: list[int], final: bool = False, stop_token: bool = False) -> tuple[str, bool]:
        """The delta to send and whether a stop string ended the output (no more deltas)."""
        if stop_token and not self.include_stop:
            token_ids = token_ids[:-1]
        delta, stopped = self.stops.add(self.detokenizer.add(token_ids, final), final)
        self.text += delta
        return delta, stopped
