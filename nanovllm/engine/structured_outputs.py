"""Structured outputs: a request's StructuredOutputsParams compiled by llguidance into a token
matcher, which says before each draw which tokens may come next (a bitmask the sampler applies)
and accepts each token drawn.

GrammarCompiler compiles when a request is added, so a schema, regex or grammar it cannot
compile is refused before anything is queued; compiled grammars are kept by (kind, text), a
bounded number of them, and every sequence takes a copy of its own. A Constraint is one
sequence's matcher: it follows the sequence's output tokens by position, so preemption (which
keeps every generated token and recomputes the cache) leaves it as it is. With reasoning_end,
the tokens up to the one that completes that text pass unconstrained; the grammar starts with
the token after it.
"""
import json
from collections import OrderedDict

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from nanovllm.engine.sequence import PLACEHOLDER
from nanovllm.sampling_params import StructuredOutputsParams

# Whitespace JSON may hold between two tokens: enough for output indented three levels deep by
# two spaces, too little for a model to spend its tokens on spaces.
MAX_JSON_WHITESPACE = 8
COMPILED_CACHE_SIZE = 256
_JSON_OPTIONS = {"whitespace_flexible": False, "whitespace_pattern": rf"[ \n\t]{{0,{MAX_JSON_WHITESPACE}}}"}


def bitmask_words(vocab_size: int) -> int:
    """int32 words a row of the bitmask takes: bit v % 32 of word v // 32 allows token v."""
    return -(-vocab_size // 32)


def _grammar(params: StructuredOutputsParams) -> tuple[str, str]:
    """(the field set, llguidance's grammar of it); ValueError for text it cannot read."""
    if params.json is not None:
        schema = params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs.json: not valid JSON ({exc})") from None
        if not isinstance(schema, dict):
            raise ValueError(f"structured_outputs.json: a JSON schema must be an object, got {schema!r}")
        return "json", llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    if params.json_object:
        return "json_object", llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                                             defaults=_JSON_OPTIONS)
    if params.regex is not None:
        return "regex", llguidance.LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        return "choice", llguidance.grammar_from("choice", json.dumps(params.choice))
    try:
        return "grammar", llguidance.grammar_from("grammar", params.grammar)
    except ValueError as exc:
        raise ValueError(f"structured_outputs.grammar: {exc}") from None


def _cache_key(params: StructuredOutputsParams) -> tuple[str, str]:
    for name in ("json", "regex", "choice", "grammar"):
        value = getattr(params, name)
        if value is not None:
            return name, value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return "json_object", ""


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer; `vocab_size` is the model's, which
    may pass the tokenizer's (the extra ids are never allowed)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self._compiled: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()

    def compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A matcher at the start of the constraint, shared: copy it before use."""
        key = _cache_key(params)
        compiled = self._compiled.get(key)
        if compiled is None:
            kind, grammar = _grammar(params)
            compiled = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
            if compiled.is_error():
                raise ValueError(f"structured_outputs.{kind}: cannot be compiled: {_first_line(compiled.get_error())}")
            if len(self._compiled) >= COMPILED_CACHE_SIZE:
                self._compiled.popitem(last=False)
            self._compiled[key] = compiled
        self._compiled.move_to_end(key)
        return compiled

    def constraint(self, params: StructuredOutputsParams, num_prompt_tokens: int) -> "Constraint":
        return Constraint(self.compile(params).deep_copy(), num_prompt_tokens, params.reasoning_end, self.tokenizer)


def _first_line(error: str) -> str:
    return error.strip().splitlines()[0] if error.strip() else "invalid"


class Constraint:
    """One sequence's matcher. `position`: the sequence position of the next token to accept;
    tokens before it (from the first output token on) are accepted, or were passed by before
    reasoning_end."""

    def __init__(self, matcher: llguidance.LLMatcher, num_prompt_tokens: int, reasoning_end: str | None, tokenizer):
        self.matcher = matcher
        self.position = num_prompt_tokens
        self.reasoning_end = reasoning_end
        self.active = reasoning_end is None  # whether the grammar has started
        self._tokenizer = tokenizer
        self._reasoning_tail = ""  # the output's text, from its last partial match of reasoning_end on

    def accept(self, tokens: list[int]) -> None:
        """Accepts the sequence's next tokens, from `position` on. A token the grammar refuses
        (one drawn without the mask) leaves the matcher in error: terminated, so the sequence ends."""
        for token in tokens:
            self.position += 1
            if self.active:
                self.matcher.consume_token(token)
            else:
                self._pass_reasoning(token)

    def _pass_reasoning(self, token: int) -> None:
        text = self._reasoning_tail + self._tokenizer.decode([token])
        if self.reasoning_end in text:
            self.active = True
            return
        # What could still start reasoning_end: its length less one is enough.
        self._reasoning_tail = text[max(0, len(text) - len(self.reasoning_end) + 1):]

    @property
    def terminated(self) -> bool:
        """Whether the output is complete: the grammar allows nothing but its end (or it is in
        error). The sequence then finishes, with no EOS token needed."""
        return self.active and (self.matcher.is_stopped() or self.matcher.is_error())

    def ends_at(self, token_ids: list[int], position: int) -> bool:
        """After the token at `position` is recorded: accepts what the matcher has not seen up
        to it, and whether the output is complete there."""
        if self.position <= position:
            self.accept(token_ids[self.position:position + 1])
        return self.terminated

    def masks(self) -> bool:
        """Whether the next draw is constrained: the grammar has started and not ended."""
        return self.active and not self.terminated


def fill_bitmask(constraints: list[Constraint | None], bitmask: torch.Tensor) -> None:
    """Fills rows [0, len(constraints)) of `bitmask` (int32 on the host, [rows, words]): each
    row's allowed next tokens; every token for a row with no constraint, one not started, or
    one already complete (its token is never recorded)."""
    bitmask[:len(constraints)] = -1
    rows = [(c.matcher, row) for row, c in enumerate(constraints) if c is not None and c.masks()]
    for matcher, row in rows:
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, row)


def accept_unseen(seqs, last_token) -> None:
    """Each constraint of `seqs` accepts the tokens it has not seen. The last may be in flight,
    sampled by the step before: only then is `last_token(seq)` called, which may wait for it."""
    for seq in seqs:
        if seq.constraint is None:
            continue
        unseen = seq.token_ids[seq.constraint.position:]
        if unseen and unseen[-1] == PLACEHOLDER:
            unseen[-1] = last_token(seq)
        seq.constraint.accept(unseen)


class BitmaskStaging:
    """The host buffers a step's bitmask is filled in, then copied to the device. Pinned (with
    `pin`): the copy does not wait for it. Two buffers taken in turn; one is written again only
    once its copy has left it."""

    def __init__(self, vocab_size: int, max_rows: int, device: torch.device, pin: bool):
        self.vocab_size, self.max_rows, self.device, self.pin = vocab_size, max_rows, device, pin
        self.buffers: torch.Tensor | None = None  # allocated for the first constrained step
        self.copies = 0
        self.copied: list[torch.cuda.Event | None] = [None, None]

    def to_device(self, constraints: list[Constraint | None]) -> torch.Tensor:
        """The rows' allowed tokens ([B, words] int32 on the device; all for rows without a
        constraint)."""
        if self.buffers is None:
            words = bitmask_words(self.vocab_size)
            self.buffers = torch.empty(2, self.max_rows, words, dtype=torch.int32, pin_memory=self.pin)
        slot = self.copies % 2
        if self.copied[slot] is not None:
            self.copied[slot].synchronize()
        host = self.buffers[slot, :len(constraints)]
        fill_bitmask(constraints, host)
        allowed = host.to(self.device, non_blocking=True)
        if self.pin:
            self.copied[slot] = torch.cuda.Event()
            self.copied[slot].record()
        self.copies += 1
        return allowed
