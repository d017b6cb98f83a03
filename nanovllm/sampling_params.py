from dataclasses import dataclass


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token. temperature=0 is greedy; top_k=-1 and top_p=1 disable those
    filters. With a seed, a request's tokens do not depend on the run or on its batch."""
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    seed: int | None = None

    def __post_init__(self):
        if not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens: must be an integer, got {self.max_tokens!r}")
        if not isinstance(self.top_k, int):
            raise ValueError(f"top_k: must be an integer, got {self.top_k!r}")
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:  # also rejects NaN
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k: must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be at least 1, got {self.max_tokens}")
        self.stop_token_ids = list(self.stop_token_ids or [])
