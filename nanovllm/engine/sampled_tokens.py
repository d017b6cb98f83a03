"""A step's sampled tokens on their way to the host, and the log-probabilities its rows asked
for, packed so that one copy takes them there."""
import torch


class SampledTokens:
    """Token ids sampled on the device, on their way to the host: kernels.publish_tokens stores
    them into `host`, a row of pinned memory, and the log-probabilities the rows asked for come
    by one non-blocking copy into pinned memory. With `on_gpu`, both are read once an event
    recorded after them has passed, waited for by `wait` (given the event).
    `logprobs`: None when no row asked, else the float32 tensor pack_logprobs made;
    `num_logprobs`: each row's SamplingParams.logprobs."""

    def __init__(self, host: torch.Tensor | None, on_gpu: bool = False, wait=None,
                 logprobs: torch.Tensor | None = None, num_logprobs: list[int | None] | None = None):
        self._host, self._wait, self.num_logprobs, self._tokens = host, wait, num_logprobs, None
        self.logprobs_packed = pinned_copy(logprobs) if on_gpu and logprobs is not None else logprobs
        self._ready = None
        if on_gpu and host is not None:
            self._ready = torch.cuda.Event()
            self._ready.record()

    def tolist(self) -> list[int]:
        self.settle()
        return self._tokens

    def settle(self) -> None:
        """Waits for the tokens and keeps them, before their slot is written again."""
        if self._tokens is not None:
            return
        if self._ready is not None:
            self._wait(self._ready)
        self._tokens = [] if self._host is None else self._host.tolist()

    def logprobs(self, tokens: list[int]) -> list[dict[int, float] | None] | None:
        """After tolist(), given its tokens: for each row, {token id: log-probability} of the
        sampled token and the row's N most likely (N + 1 entries, or N when the sampled token is
        one of them; the sampled token's value is always the sampler's), or None for a row that
        did not ask; None when no row asked."""
        if self.logprobs_packed is None:
            return None
        packed = self.logprobs_packed
        asked = self.num_logprobs
        top_rows = [row for row, n in enumerate(asked) if n]
        width = max((asked[row] for row in top_rows), default=0)
        chosen, values, ids = packed.split([len(tokens), len(top_rows) * width, len(top_rows) * width])
        top = dict(zip(top_rows, zip(ids.view(torch.int32).view(-1, width or 1).tolist(),
                                     values.view(-1, width or 1).tolist())))
        entries = []
        for row, (token, logprob, n) in enumerate(zip(tokens, chosen.tolist(), asked)):
            entry = None if n is None else {token: logprob}
            if n:
                row_ids, row_values = top[row]
                for token_id, value in zip(row_ids[:n], row_values[:n]):
                    entry.setdefault(token_id, value)
            entries.append(entry)
        return entries


def pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


def pack_logprobs(chosen: torch.Tensor, top) -> torch.Tensor:
    """One float32 tensor, so that one copy takes the log-probabilities to the host: the chosen
    tokens' [B], then the top rows' values [R * n] and ids [R * n] (int32 bits)."""
    if top is None:
        return chosen
    values, ids = top
    return torch.cat([chosen, values.flatten(), ids.to(torch.int32).view(torch.float32).flatten()])
