"""Continuous batching with chunked prefill. Each step spends a budget of
`max_num_batched_tokens`: running sequences first (one token for each decode, the next chunk
for each unfinished prefill), then waiting ones. When blocks run out, the most recently
admitted sequence is preempted: its blocks are freed and it waits to be recomputed, keeping
every token it has generated."""
from collections import deque
from dataclasses import dataclass

from nanovllm.config import Config
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens each sequence computes this step

    def __len__(self) -> int:
        return len(self.seqs)


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

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch([], [])
        preemptions = self.num_preemptions
        budget = self._schedule_running(batch, self.max_num_batched_tokens)
        if self.num_preemptions == preemptions or not batch:  # else a victim would come straight back
            self._schedule_waiting(batch, budget)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_uncomputed_tokens(), budget)
            if self.block_manager.grow(seq, num_new):
                batch.seqs.append(seq)
                batch.num_new_tokens.append(num_new)
                budget -= num_new
                index += 1
            elif not self._preempt_last(protect=seq):
                self._preempt(seq)  # nothing left to take blocks from but itself
        return budget

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
            num_new = self.block_manager.admit(seq, budget)
            if num_new == 0:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new

    def postprocess(self, batch: ScheduledBatch, sampled: dict[int, int]) -> list[Sequence]:
        """Records the step: computed tokens, newly full blocks, sampled tokens (by request id).
        Returns the sequences that finished."""
        finished = []
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            before = seq.num_computed_tokens
            seq.num_computed_tokens += num_new
            self.block_manager.register_full_blocks(seq, before)
            if seq.request_id in sampled:
                seq.append_token(sampled[seq.request_id])
                if self._check_stop(seq):
                    finished.append(seq)
        return finished

    def _check_stop(self, seq: Sequence) -> bool:
        token = seq.token_ids[-1]
        if not seq.params.ignore_eos and token in self.eos_token_ids or token in seq.params.stop_token_ids:
            self.finish(seq, "stop")
        elif seq.num_output_tokens >= seq.params.max_tokens or len(seq) >= self.max_model_len:
            self.finish(seq, "length")
        return seq.is_finished

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.finish(reason)
        self.block_manager.free(seq)
        self.running.remove(seq)

    def abort(self, request_id: int) -> Sequence | None:
        for seq in [*self.running, *self.waiting]:
            if seq.request_id == request_id:
                if seq.status == SequenceStatus.RUNNING:
                    self.finish(seq, "abort")
                else:
                    self.waiting.remove(seq)
                    seq.finish("abort")
                return seq
        return None
