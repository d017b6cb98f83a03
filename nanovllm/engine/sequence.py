from enum import Enum, auto
from typing import NamedTuple

from nanovllm.sampling_params import SamplingParams

# Stands in for a token sampled by a step still running on the device: the next step can be
# scheduled (lengths, positions, blocks) before the value reaches the host.
PLACEHOLDER = -1


class Draw(NamedTuple):
    """One of the tokens a speculative step draws for a sequence, as the sampler sees it: the
    sequence's params, and the output position the token would have without speculation
    (a seeded request's noise is keyed by it)."""
    request_id: int
    params: SamplingParams
    num_output_tokens: int


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """One request: its tokens, how many of them have keys and values in the cache
    (`num_computed_tokens`), and the cache blocks holding them. `logprobs`, when its params ask:
    one {token id: log-probability} a received output token, in token order."""

    def __init__(self, request_id: int, token_ids: list[int], params: SamplingParams):
        self.request_id = request_id
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.finish_reason: str | None = None
        self.logprobs: list[dict[int, float]] | None = None if params.logprobs is None else []
        # structured_outputs.Constraint, set by the engine where params.structured_outputs asks
        self.constraint = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def finish(self, reason: str) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
