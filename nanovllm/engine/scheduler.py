"""Continuous batching with chunked prefill. Each step spends a budget of
`max_num_batched_tokens`: running sequences first (one token for each decode, the next chunk
for each unfinished prefill), then waiting ones. When blocks run out, the most recently
admitted sequence is preempted: its blocks are freed and it waits to be recomputed, keeping
every token it has generated.

A step is recorded in two halves so that the next one can be scheduled while it runs:
`launched` when it is handed to the device (computed tokens advance, each sampled token gets a
placeholder), `postprocess` when its tokens arrive (placeholders filled, stops checked).

A speculating decode (docs/speculative_decoding.md) reserves blocks for its last token and k
proposals; it counts one computed token when launched, like a plain decode, and the accepted
proposals when its tokens arrive, which give back the blocks of the rejected ones."""
from collections import deque
from dataclasses import dataclass, field

from nanovllm.config import Config
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import PLACEHOLDER, Draw, Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens each sequence computes this step
    sample_rows: list[int] = field(default_factory=list)  # indices of the sequences that sample a token
    # Filled by Scheduler.launched:
    computed_before: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)  # the lists themselves: see postprocess
    token_positions: list[int] = field(default_factory=list)  # where each sampled token goes in its sequence
    # Speculating rows: the proposals each may verify (reserved by schedule), the proposals
    # (filled before launch, none left empty), the proposals accepted (filled by postprocess).
    num_speculative: dict[int, int] = field(default_factory=dict)
    proposals: dict[int, list[int]] = field(default_factory=dict)
    num_accepted: dict[int, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.seqs)

    def draws(self) -> list:
        """What each of the step's draws samples for, in token order: a sample row's sequence,
        or for a row verifying proposals one Draw per position."""
        if not self.proposals:
            return [self.seqs[row] for row in self.sample_rows]
        draws = []
        for row in self.sample_rows:
            seq = self.seqs[row]
            if row in self.proposals:
                draws.extend(Draw(seq.request_id, seq.params, seq.num_output_tokens + i)
                             for i in range(len(self.proposals[row]) + 1))
            else:
                draws.append(seq)
        return draws


class Scheduler:
    def __init__(self, config: Config, eos_token_ids: list[int], num_blocks: int):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.block_manager = BlockManager(num_blocks, config.kvcache_block_size, config.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self, num_speculative: dict[int, int] | None = None) -> ScheduledBatch:
        """`num_speculative`: request id -> the proposals its decode may verify this step; the
        sequences' last tokens must be on the host."""
        batch = ScheduledBatch([], [])
        preemptions = self.num_preemptions
        budget = self._schedule_running(batch, self.max_num_batched_tokens, num_speculative or {})
        if self.num_preemptions == preemptions or not batch:  # else a victim would come straight back
            self._schedule_waiting(batch, budget)
        batch.sample_rows = [row for row, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens))
                             if seq.num_computed_tokens + num_new == len(seq)]
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int, num_speculative: dict[int, int]) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_uncomputed_tokens(), budget)
            k = self._speculative_tokens(seq, num_speculative, budget) if num_speculative and num_new == 1 else 0
            if k and not self.block_manager.grow(seq, num_new + k):
                k = 0  # no preemption to make room for proposals
            if num_new == 0:  # its last token is still being sampled: it ends when that arrives
                index += 1
            elif self.block_manager.grow(seq, num_new + k):
                if k:
                    batch.num_speculative[len(batch.seqs)] = k
                batch.seqs.append(seq)
                batch.num_new_tokens.append(num_new)
                budget -= num_new + k
                index += 1
            elif not self._preempt_last(protect=seq):
                self._preempt(seq)  # nothing left to take blocks from but itself
        return budget

    def _speculative_tokens(self, seq: Sequence, num_speculative: dict[int, int], budget: int) -> int:
        """How many proposals a decode may verify: its share, within the step's budget, and no
        more than fit before max_tokens and max_model_len (every drawn token must be allowed)."""
        k = num_speculative.get(seq.request_id, 0)
        if not k:
            return 0
        return max(0, min(k, budget - 1, seq.params.max_tokens - seq.num_output_tokens - 1,
                          self.max_model_len - len(seq) - 1))

    def _preempt_last(self, protect: Sequence) -> bool:
        victim = self.running[-1]
        if victim is protect:
            return False
        self._preempt(victim)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.token_ids[-1] == PLACEHOLDER:  # preempted while its token is in flight: wait for it
                break
            num_new = self.block_manager.admit(seq, budget)
            if num_new == 0:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new

    def launched(self, batch: ScheduledBatch) -> None:
        """Records a batch handed to the device: its tokens count as computed, and each token it
        samples gets a placeholder, unless that token ends its sequence by length."""
        for row, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            batch.computed_before.append(seq.num_computed_tokens)
            batch.block_tables.append(seq.block_table)
            # a verifying row's proposals count once accepted (postprocess)
            seq.num_computed_tokens += 1 if row in batch.num_speculative else num_new
        for row in batch.sample_rows:
            seq = batch.seqs[row]
            batch.token_positions.append(len(seq))
            if not self._ends_by_length(seq, len(seq)):
                seq.append_token(PLACEHOLDER)

    def postprocess(self, batch: ScheduledBatch, tokens: list[int]) -> list[tuple[Sequence, int]]:
        """Records a launched batch's sampled tokens (in `sample_rows` order) and makes the blocks
        it filled findable. Returns the sequences that received a token, each with the token's
        position (placeholders of steps launched since may follow it); not those that finished
        or were aborted while the step ran."""
        if batch.num_speculative:
            return self._postprocess_speculative(batch, tokens)
        for seq, num_new, before, table in zip(batch.seqs, batch.num_new_tokens, batch.computed_before,
                                               batch.block_tables):
            # A sequence freed since (finished, aborted, preempted, maybe readmitted) holds another
            # list: the blocks this step filled are no longer its own.
            if seq.block_table is table:
                self.block_manager.register_full_blocks(seq, before, before + num_new)
        received = []
        for row, position, token in zip(batch.sample_rows, batch.token_positions, tokens):
            seq = batch.seqs[row]
            if not seq.is_finished:
                self._record_token(seq, position, token)
                received.append((seq, position))
        return received

    def _postprocess_speculative(self, batch: ScheduledBatch, tokens: list[int]) -> list[tuple[Sequence, int]]:
        """postprocess of a step that verified proposals: `tokens` holds a verifying row's
        draws at each of its positions. The row takes the proposals equal to the draws before
        them and the draw after the last, stopping at a stop; the computed tokens advance by
        the accepted proposals, and the blocks reserved past them go back."""
        received, draws = [], iter(tokens)
        for row, position in zip(batch.sample_rows, batch.token_positions):
            seq, proposals = batch.seqs[row], batch.proposals.get(row, [])
            drawn = [next(draws) for _ in range(len(proposals) + 1)]
            accepted = num_accepted(proposals, drawn)
            if row in batch.num_speculative:
                batch.num_accepted[row] = accepted
            if seq.is_finished:
                continue
            for offset in range(accepted + 1):
                self._record_token(seq, position + offset, drawn[offset])
                received.append((seq, position + offset))
                if seq.is_finished:
                    break
            if row in batch.num_speculative and seq.block_table is batch.block_tables[row] and not seq.is_finished:
                seq.num_computed_tokens += accepted
                self.block_manager.trim(seq)
        for row, (seq, num_new, before, table) in enumerate(zip(batch.seqs, batch.num_new_tokens,
                                                                 batch.computed_before, batch.block_tables)):
            if seq.block_table is table:
                end = seq.num_computed_tokens if row in batch.num_speculative else before + num_new
                self.block_manager.register_full_blocks(seq, before, end)
        return received

    def _record_token(self, seq: Sequence, position: int, token: int) -> None:
        if position < len(seq):
            seq.token_ids[position] = token
        else:
            seq.append_token(token)
        reason = self._stop_reason(seq, position)
        if reason:
            del seq.token_ids[position + 1:]  # the placeholder of a step launched meanwhile
            self.finish(seq, reason)

    def _stop_reason(self, seq: Sequence, position: int) -> str | None:
        token = seq.token_ids[position]
        if not seq.params.ignore_eos and token in self.eos_token_ids or token in seq.params.stop_token_ids:
            return "stop"
        if seq.constraint is not None and seq.constraint.ends_at(seq.token_ids, position):
            return "stop"  # the grammar is complete: nothing but EOS could follow
        return "length" if self._ends_by_length(seq, position) else None

    def _ends_by_length(self, seq: Sequence, position: int) -> bool:
        """Whether a token at `position` is the last its sequence may have: its output reaches
        max_tokens, or prompt and output together reach max_model_len."""
        return position + 1 - seq.num_prompt_tokens >= seq.params.max_tokens or position + 1 >= self.max_model_len

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status == SequenceStatus.RUNNING:
            self.block_manager.free(seq)
            self.running.remove(seq)
        else:  # preempted while its last step ran
            self.waiting.remove(seq)
        seq.finish(reason)

    def abort(self, request_id: int) -> Sequence | None:
        for seq in [*self.running, *self.waiting]:
            if seq.request_id == request_id:
                self.finish(seq, "abort")
                return seq
        return None


def num_accepted(proposals: list[int], drawn: list[int]) -> int:
    """How many leading proposals equal the tokens drawn at their positions."""
    accepted = 0
    while accepted < len(proposals) and proposals[accepted] == drawn[accepted]:
        accepted += 1
    return accepted
