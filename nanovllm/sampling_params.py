import math
from dataclasses import dataclass
from numbers import Integral, Real

import numpy as np

# A temperature below this samples greedily: logits / T overflows float32 for T below ~1e-38,
# and long before that a draw is all but certain to be the argmax.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # most likely tokens a request may ask log-probabilities of, OpenAI's bound
MAX_TOP_K = 2**63 - 1  # top_k travels to the sampler in an int64 tensor


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
    top-k, top-p and min-p). structured_outputs: a StructuredOutputsParams (or a dict of its
    fields) the output must follow, or None.

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


# Python's bool is an Integral and a Real, refused as both; numpy's bool is neither.
def _integer(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{name}: must be an integer, got {value!r}")
    return int(value)


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name}: must be a number, got {value!r}")
    return float(value)


def _token_ids(name: str, value) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name}: must be a list of token ids, got {value!r}")
    ids = [_integer(name, t) for t in value]
    if any(t < 0 for t in ids):
        raise ValueError(f"{name}: token ids must be >= 0, got {value!r}")
    return ids
