import math
from dataclasses import dataclass, field
from numbers import Integral, Real

import numpy as np

# A temperature below this samples greedily: logits / T overflows float32 for T below ~1e-38,
# and long before that a draw is all but certain to be the argmax.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # most likely tokens a request may ask log-probabilities of, OpenAI's bound
MAX_TOP_K = 2**63 - 1  # top_k travels to the sampler in an int64 tensor
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit_bias value


@dataclass(slots=True)
class StructuredOutputsParams:
    """A constraint on the output, enforced token by token by a grammar engine; exactly one
    field is set. json: a JSON schema (dict, or its text); json_object: any JSON object;
    regex: a regular expression; choice: one of these strings; grammar: an EBNF (GBNF)
    grammar. vLLM's names, so its clients' `structured_outputs` carry over. The engine compiles
    the constraint before the request is queued: one it cannot compile raises ValueError.
    reasoning_end: the constraint starts only once the output contains this text (a reasoning
    model's end of thinking, e.g. "</think>"); None starts it with the first output token."""
    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    reasoning_end: str | None = None

    def __post_init__(self):
        if not isinstance(self.json_object, (bool, np.bool_)):
            raise ValueError(f"structured_outputs.json_object: must be a bool, got {self.json_object!r}")
        self.json_object = bool(self.json_object)
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs.json: must be a JSON schema (dict or str), got {self.json!r}")
        for name in ("regex", "grammar", "reasoning_end"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name}: must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError(f"structured_outputs.choice: must be a non-empty list of non-empty strings, "
                                 f"got {self.choice!r}")
            self.choice = list(self.choice)
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"structured_outputs: exactly one of json, json_object, regex, choice, grammar "
                             f"must be set, got {given or 'none'}")


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token.

    temperature: >= 0, finite; any temperature below GREEDY_TEMPERATURE (1e-5), 0 included,
    takes the most likely token. top_k: keep the k most likely tokens; -1, or k at least the
    vocabulary size, keeps all; at most MAX_TOP_K (2**63 - 1). top_p: in (0, 1], keep the
    smallest set of most likely tokens whose probability reaches top_p; 1 keeps all, and a top_p
    too small for float32 keeps the most likely token alone. min_p: in [0, 1], the least
    probability a token needs, as a fraction of the most likely token's; 0 keeps all. Every
    filter keeps the most likely token. max_tokens: at most this many output tokens (>= 1, any
    size); output also ends when prompt + output reach the engine's max_model_len. ignore_eos:
    keep going past EOS. stop_token_ids: token ids (>= 0, below the vocabulary size: the engine
    checks) that end the output. seed: any integer; with a seed, a request's tokens do not
    depend on the run or on its batch. logprobs: None asks for none; N in [0, 20] asks, for
    each output token, for the log-probability of the sampled token and of the N most likely
    tokens, under log_softmax(logits / T) with T = 1 for greedy rows (the distribution before
    top-k, top-p and min-p, after the penalties, biases and bans below). structured_outputs: a
    StructuredOutputsParams (or a dict of its fields) the output must follow, or None.

    presence_penalty, frequency_penalty: in [-2, 2]; OpenAI's definition, over the output tokens:
    logit -= frequency_penalty * count + presence_penalty * (count > 0). repetition_penalty: > 0,
    1 is off; transformers' definition, over prompt and output tokens: a seen token's logit is
    divided by it when positive, multiplied when negative (applied before the other two).
    logit_bias: {token id: bias in [-100, 100]} added to the logits (ids below the vocabulary
    size: the engine checks). min_tokens: >= 0; EOS and stop_token_ids cannot end the output
    before this many tokens. bad_words: strings never produced: each is tokenized with and
    without a leading space; a one-token word is banned, a longer one bans its last token where
    the output ends with the others.

    Every field is checked on construction: a wrong type or range raises ValueError naming
    it. Integer fields take Python or numpy integers, float fields also take integers; bools
    count as neither. Values are stored as plain Python types."""
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 64
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    bad_words: list[str] | None = None
    # Set by the engine from the tokenizer: bad_words as token ids, and the ids min_tokens holds back.
    bad_words_token_ids: list[list[int]] = field(default_factory=list, init=False, repr=False, compare=False)
    min_tokens_stop_ids: list[int] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self):
        # Comparisons written so that NaN fails them.
        self.temperature = _number("temperature", self.temperature)
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature: must be a finite number >= 0, got {self.temperature}")
        self.top_k = _integer("top_k", self.top_k)
        if self.top_k == 0 or not -1 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k: must be -1 (off) or in [1, {MAX_TOP_K}], got {self.top_k}")
        self.top_p = _number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        self.min_p = _number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p: must be in [0, 1], got {self.min_p}")
        self.max_tokens = _integer("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be at least 1, got {self.max_tokens}")
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise ValueError(f"ignore_eos: must be a bool, got {self.ignore_eos!r}")
        self.ignore_eos = bool(self.ignore_eos)
        self.stop_token_ids = _token_ids("stop_token_ids", self.stop_token_ids)
        if self.seed is not None:
            self.seed = _integer("seed", self.seed)
        if self.logprobs is not None:
            self.logprobs = _integer("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(f"logprobs: must be None or in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs: must be a StructuredOutputsParams or a dict, "
                             f"got {self.structured_outputs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            setattr(self, name, _number(name, getattr(self, name)))
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name}: must be in [-2, 2], got {getattr(self, name)}")
        self.repetition_penalty = _number("repetition_penalty", self.repetition_penalty)
        if not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty: must be a finite number > 0, got {self.repetition_penalty}")
        self.logit_bias = _logit_bias(self.logit_bias)
        self.min_tokens = _integer("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens: must be >= 0, got {self.min_tokens}")
        if self.bad_words is not None:
            words = self.bad_words
            if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w for w in words):
                raise ValueError(f"bad_words: must be a list of non-empty strings, got {self.bad_words!r}")
            self.bad_words = list(self.bad_words)

    @property
    def penalized(self) -> bool:
        """Whether the sampler keeps token counts for the request."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


# Python's bool is an Integral and a Real, refused as both; numpy's bool is neither.
def _integer(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{name}: must be an integer, got {value!r}")
    return int(value)


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name}: must be a number, got {value!r}")
    return float(value)


def _logit_bias(value) -> dict[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias: must be a dict of token id -> bias, got {value!r}")
    bias = {}
    for token, amount in value.items():
        token, amount = _integer("logit_bias", token), _number("logit_bias", amount)
        if token < 0 or not -MAX_LOGIT_BIAS <= amount <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias: token ids must be >= 0 and biases in [-{MAX_LOGIT_BIAS:g}, "
                             f"{MAX_LOGIT_BIAS:g}], got {token}: {amount}")
        bias[token] = amount
    return bias


def _token_ids(name: str, value) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name}: must be a list of token ids, got {value!r}")
    ids = [_integer(name, t) for t in value]
    if any(t < 0 for t in ids):
        raise ValueError(f"{name}: token ids must be >= 0, got {value!r}")
    return ids
