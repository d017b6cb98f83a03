"""Owns the model and its KV cache on one device: builds and loads the model, sizes the cache,
turns a scheduled batch into tensors, runs the forward pass (a captured CUDA graph for decode
batches and single-sequence prefills) and samples. Nothing waits for the device until the
sampled tokens are read, so the engine can schedule the next step meanwhile; that step's
decode inputs are then the previous step's samples, taken on the device.

With tensor_parallel_size N > 1 the runner in the engine's process is rank 0 of N: it starts
ranks 1..N-1 (nanovllm.engine.worker), each a runner of the same class owning its shard, sends
each step's prepared inputs to them, and all run the same forward pass. Rank 0 alone samples
and broadcasts the tokens, which the next step's decode inputs on every rank are taken from."""
import atexit
import contextlib
import functools
import random
import weakref
from dataclasses import dataclass

import torch

from nanovllm import distributed, kernels
from nanovllm.config import Config
from nanovllm.engine import kv_cache, sampler_warmup
from nanovllm.engine.cuda_graphs import CUDAGraphs
from nanovllm.engine.sampled_tokens import SampledTokens, pinned_copy, pack_logprobs
from nanovllm.engine.sampling_inputs import SamplingInputs, TokenCounts
from nanovllm.engine.scheduler import ScheduledBatch
from nanovllm.engine.sequence import PLACEHOLDER
from nanovllm.engine.structured_outputs import BitmaskStaging, accept_unseen
from nanovllm.engine.worker import WorkerError, Workers, shutdown_ranks, start_ranks, synchronize, wait_for
from nanovllm.layers.attention import Attention
from nanovllm.layers.linear import weight_quantization
from nanovllm.layers.sampler import Sampler
from nanovllm.models import MODEL_REGISTRY
from nanovllm.utils.context import reset_context, set_context
from nanovllm.utils.loader import init_dummy_weights, load_model

# What a closed runner keeps: the settings and its ranks' handle, no tensor.
_KEPT_WHEN_CLOSED = {"config", "rank", "draft_block_bytes", "tp_size", "device", "dtype", "closed", "workers"}


@dataclass(slots=True)
class StepInputs:
    """A scheduled batch as the forward pass takes it, on the host; rank 0 sends it to the
    other ranks as it is. An input id below 0 is -1 - the row, in last_tokens, of a token the
    step before sampled (`deferred` says whether any is)."""
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    cu_seqlens_q: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    max_seqlen_q: int
    deferred: bool
    sample_rows: list[int]  # the sequences whose next token the step samples
    # The rows whose logits are drawn from, where the step verifies proposals (every row of a
    # verifying sequence); None: each sample row's last.
    logit_rows: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


class ModelRunner:
    def __init__(self, config: Config, rank: int = 0, draft_block_bytes: int = 0):
        """`rank` > 0: a tensor-parallel rank in its own process, in the group already.
        `draft_block_bytes`: a block's bytes in a draft model's cache, which takes the same
        number of blocks (engine/speculative.py); the cache's memory is shared with it."""
        self.config, self.rank, self.draft_block_bytes = config, rank, draft_block_bytes
        self.tp_size = config.tensor_parallel_size
        self.device, self.dtype = config.torch_device, config.torch_dtype  # "cuda": this rank's GPU
        self.block_size = config.kvcache_block_size
        self.max_blocks_per_seq = kv_cache.max_blocks_per_seq(config)
        self.pin = self.device.type == "cuda"
        self.graphs = CUDAGraphs()
        self.workers: Workers | None = None
        self.closed = False
        # The layers take their shard from the process's group: one engine's at a time.
        if distributed.rank_and_size() != ((rank, self.tp_size) if rank else (0, 1)):
            raise RuntimeError("a tensor-parallel engine is open in this process; close() it first")
        if self.tp_size > 1 and rank == 0:
            self.workers = start_ranks(type(self), config)
            # Stops the ranks when the engine is closed, collected, or the interpreter exits
            # (registered after multiprocessing's exit hook, so it runs before it).
            self._shutdown = weakref.finalize(self, shutdown_ranks, self.workers, self.graphs)
            atexit.register(self._shutdown)
        try:
            self._build()
            if self.workers:
                self.workers.wait_all()  # every rank built its shard
        except BaseException as exc:
            try:
                if self.workers and not isinstance(exc, ValueError):  # a ValueError is every rank's
                    self.workers.fail_after(exc)
            finally:
                self.close()
            raise

    def _build(self) -> None:
        self.model = self._build_model()
        self.sampler = Sampler()
        self.noise_rng = random.Random()  # seeds the noise of unseeded requests, from OS entropy
        self.token_counts = TokenCounts(self.config.hf_config.vocab_size, self.device)  # of penalized requests
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        kv_cache.set_scales(self.config, self.attention_layers)
        self.num_kvcache_blocks = self._allocate_kv_cache()
        # A step's samples land in last_tokens on every rank, where the next step's input ids
        # that wait for them are read; rank 0 also publishes them to the host in a row of
        # sampled_host, the two rows taken in turn (kernels.publish_tokens).
        rows = self.config.max_num_seqs
        self.last_tokens = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.sampled_host = torch.zeros(2, rows, dtype=torch.long, pin_memory=self.pin)
        self.publish_parity = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._published = 0  # the next publish takes row _published % 2
        self._readers: list[SampledTokens | None] = [None, None]  # the reader of each row's tokens
        self._publish_row: int | None = None  # the last launched step's row, None when it sampled nothing
        self._last_logprobs: torch.Tensor | None = None  # rank 0's, packed (pack_logprobs), when rows asked
        self._last_sample_rows: dict[int, int] = {}  # each sampling request's row in last_tokens
        self.bitmasks = BitmaskStaging(self.config.hf_config.vocab_size, rows, self.device, self.pin)
        if self.device.type == "cuda" and not self.config.enforce_eager and kernels.graph_capturable(self.device):
            self._capture_graphs()
        if self.device.type == "cuda" and kernels.backend_for(self.device) == "triton":
            self._warm_up_sampler()

    def close(self) -> None:
        """Stops the other ranks (rank 0 of several) and leaves their group, then frees the
        device memory the runner holds: another engine may start in this process. Later
        steps raise; closing again does nothing."""
        if self.closed:
            return
        self.closed = True
        if self.workers:
            with contextlib.suppress(WorkerError):  # a rank gone since the last step: its group is aborted
                self.workers.check()
            self._shutdown()
        self._release()
        if self.tp_size > 1 and not self.workers:  # NCCL communicators go after the graphs captured with them
            distributed.destroy()

    def _release(self) -> None:
        """Drops every attribute but the settings: the model, the KV cache, the CUDA graphs (and
        with them their memory pool), the staging and sampling buffers; then returns the
        allocator's cached blocks to the device, where other processes see them."""
        cuda = self.device.type == "cuda" and not distributed.abort_pending()  # else waits could hang on the lost rank
        if cuda:  # kernels still in flight store into pinned memory, which a free would hand on
            torch.cuda.synchronize()
        self.graphs.clear()  # also held by the ranks' finalizer
        for name in vars(self).keys() - _KEPT_WHEN_CLOSED:
            delattr(self, name)
        reset_context()  # a step cut short leaves its tensors there
        if cuda:
            torch.cuda.empty_cache()

    # --- building -----------------------------------------------------------------------
    def _build_model(self):
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device), weight_quantization(self.config.quantization, self.config.weight_block_size):
                model = MODEL_REGISTRY[self.config.hf_config.architecture](self.config.hf_config)
        finally:
            torch.set_default_dtype(default_dtype)
        if self.config.load_format == "dummy":
            init_dummy_weights(model)
        else:
            load_model(model, self.config.model)
        _drop_weight_loaders(model)
        return model.eval()

    def block_bytes(self) -> int:
        return kv_cache.block_bytes(self.config)

    def _allocate_kv_cache(self) -> int:
        num_blocks = kv_cache.count_blocks(self.config, self.model, self.sampler, self.attention_layers,
                                           self.block_bytes() + self.draft_block_bytes, self.workers)
        self.kv_cache = kv_cache.allocate(self.config, self.attention_layers, num_blocks)
        return num_blocks

    def resize_kv_cache(self, num_blocks: int, capture_graphs: bool) -> None:
        """A draft model's cache takes its target's block count; its graphs, captured with the
        cache they write, come after."""
        del self.kv_cache
        self.kv_cache = kv_cache.allocate(self.config, self.attention_layers, num_blocks)
        self.num_kvcache_blocks = num_blocks
        if capture_graphs and self.device.type == "cuda" and kernels.graph_capturable(self.device):
            self._capture_graphs()

    def _synchronize(self) -> None:
        """Waits for the device; rank 0 of several raises meanwhile if another rank fails."""
        if self.device.type == "cuda":
            synchronize(self.workers)

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("the engine is closed")

    # --- one step -------------------------------------------------------------------------
    def _to_device(self, values, dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, pin_memory=self.pin).to(self.device, non_blocking=True)

    def _slots(self, seq, start: int, end: int) -> list[int]:
        """Cache slots of the sequence's tokens [start, end), one block's run at a time."""
        slots, size = [], self.block_size
        for index in range(start // size, (end - 1) // size + 1):
            base = seq.block_table[index] * size - index * size
            slots.extend(range(base + max(start, index * size), base + min(end, (index + 1) * size)))
        return slots

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        input_ids, positions, slot_mapping, cu_seqlens_q, seq_lens = [], [], [], [0], []
        deferred = False  # whether an input id is still to come from the last step's samples
        size = self.block_size
        for row, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            if num_new == 1:  # decode: the common case, kept cheap
                token = seq.token_ids[start]
                if token == PLACEHOLDER:  # -1 - its row in last_tokens
                    token, deferred = -1 - self._last_sample_rows[seq.request_id], True
                input_ids.append(token)
                positions.append(start)
                slot_mapping.append(seq.block_table[start // size] * size + start % size)
            else:  # a prefill chunk, or a decode and the proposals it verifies
                input_ids.extend(seq.token_ids[start:end] if row not in batch.proposals
                                 else [seq.token_ids[start], *batch.proposals[row]])
                positions.extend(range(start, end))
                slot_mapping.extend(self._slots(seq, start, end))
            cu_seqlens_q.append(cu_seqlens_q[-1] + num_new)
            seq_lens.append(end)
        width = max(len(seq.block_table) for seq in batch.seqs)
        block_tables = [seq.block_table + [-1] * (width - len(seq.block_table)) for seq in batch.seqs]
        logit_rows = None
        if batch.proposals:
            logit_rows = [i for row in batch.sample_rows
                          for i in range(cu_seqlens_q[row] if row in batch.proposals else cu_seqlens_q[row + 1] - 1,
                                         cu_seqlens_q[row + 1])]
        return StepInputs(input_ids, positions, slot_mapping, cu_seqlens_q, seq_lens, block_tables,
                          max(batch.num_new_tokens), deferred, batch.sample_rows, logit_rows)

    def launch(self, batch: ScheduledBatch) -> SampledTokens:
        """Queues one forward pass and the sampling of every sequence in `batch.sample_rows`;
        returns their tokens without waiting for them."""
        self._check_open()
        step = self.prepare(batch)
        seqs = batch.draws()
        if self.workers:
            self.workers.send(("run_step", step))
            try:
                self.run_step(step, seqs)
            except BaseException as exc:
                self.workers.fail_after(exc)
                raise
        else:
            self.run_step(step, seqs)
        self._last_sample_rows = {seq.request_id: i for i, seq in enumerate(seqs)}
        num_logprobs = None if self._last_logprobs is None else [seq.params.logprobs for seq in seqs]
        row = self._publish_row
        if step.logit_rows is not None:
            host = self._draws_host
        else:
            host = None if row is None else self.sampled_host[row, :len(seqs)]
        # The wait holds the ranks, not the runner: the runner keeps its readers, and a cycle
        # would keep the device memory until the garbage collector finds it.
        sampled = SampledTokens(host, self.pin,
                                functools.partial(wait_for, self.workers), self._last_logprobs, num_logprobs)
        if row is not None:
            self._readers[row] = sampled
        return sampled

    @torch.inference_mode()
    def run_step(self, step: StepInputs, seqs=None) -> None:
        """The forward pass of a prepared step and the tokens of its sample rows (`seqs`, on rank
        0): sampled on rank 0, broadcast from it to the other ranks. Log-probabilities stay on
        rank 0."""
        sampling = None
        if seqs:
            self.token_counts.release_finished()
            sampling = SamplingInputs(seqs, self.config.hf_config.vocab_size, self.noise_rng, self.token_counts,
                                      lambda seq: self._last_sample_rows[seq.request_id])
        shape = self.graphs.shape_for(step) if self.graphs else None
        verifying = step.logit_rows is not None
        draw_in_graph = shape is not None and not verifying and self.graphs.draws(shape, step, sampling)
        # the reader of the step launched before, whose tokens constrained rows may wait for
        previous = None if self._publish_row is None else self._readers[self._publish_row]
        self._last_logprobs, self._publish_row = None, None
        row = self._published % 2
        if step.sample_rows and self.rank == 0 and self._readers[row] is not None:
            self._readers[row].settle()  # the tokens two publishes back leave the row first
        if shape is None:
            hidden = self._run_eager(step)
        else:
            hidden = self.graphs.replay(step, shape, sampling if draw_in_graph else None)
        if not step.sample_rows:
            return
        if self.rank == 0:
            if not draw_in_graph:  # else the graph replayed drew and published them
                graph_logits = self.graphs.logits(shape) if shape else None
                logits = self._logits(hidden, step, graph_logits)
                # filled on the host while the forward pass runs on the device; a verifying
                # step's draws are never constrained (speculative.speculates)
                constrained = not verifying and any(s.constraint for s in seqs)
                allowed = self._grammar_bitmask(seqs, previous) if constrained else None
                tokens, self._last_logprobs = self._sample(logits, seqs, sampling, allowed)
                if verifying:  # more draws than last_tokens holds; the next step waits for them
                    self._draws_host = pinned_copy(tokens) if self.pin else tokens
                    return
                kernels.publish_tokens(tokens, self.last_tokens, self.sampled_host, self.publish_parity)
            self._published, self._publish_row = self._published + 1, row
        else:
            self._logits(hidden, step)  # this rank's vocabulary rows, gathered on rank 0
        if self.tp_size > 1 and not verifying:
            distributed.broadcast_from_first(self.last_tokens[:len(step.sample_rows)])

    def _logits(self, hidden: torch.Tensor | None, step: StepInputs,
                graph_logits: torch.Tensor | None = None) -> torch.Tensor | None:
        """`hidden`: None after a decode graph that ends with the LM head, whose output is
        `graph_logits` (a decode step samples every row)."""
        if hidden is None:
            return graph_logits[:len(step.sample_rows)]
        last_rows = step.logit_rows or [step.cu_seqlens_q[row + 1] - 1 for row in step.sample_rows]
        if len(last_rows) < hidden.shape[0]:  # a decode step samples every row: no gather needed
            hidden = hidden[self._to_device(last_rows, torch.long)]
        return self.model.compute_logits(hidden)

    def _grammar_bitmask(self, seqs, previous: SampledTokens | None) -> torch.Tensor:
        """The sampled rows' allowed tokens ([B, words] int32 on the device; all for rows without
        a constraint). Each constraint first accepts the tokens it has not seen; the last may be
        in flight, sampled by the step before: only then does this wait for that step."""
        accept_unseen(seqs, lambda seq: previous.tolist()[self._last_sample_rows[seq.request_id]])
        return self.bitmasks.to_device([seq.constraint for seq in seqs])

    def _sample(self, logits: torch.Tensor, seqs, sampling: SamplingInputs, allowed: torch.Tensor | None = None):
        """-> (token ids [B], packed log-probabilities or None when no row asks). `allowed`:
        the rows' token bitmask, None when no row is constrained."""
        tensors = sampling.tensors(self._to_device, self.last_tokens)
        if allowed is not None:
            tensors["token_bitmask"] = allowed
        if all(s.params.logprobs is None for s in seqs):
            return self.sampler(logits, **tensors)[0], None
        top_rows = [row for row, s in enumerate(seqs) if s.params.logprobs]
        num_top = max((seqs[row].params.logprobs for row in top_rows), default=0)
        tokens, (chosen, top) = self.sampler(logits, **tensors, logprobs=True, num_top=num_top,
                                             top_rows=self._to_device(top_rows, torch.long) if top_rows else None)
        return tokens, pack_logprobs(chosen, top)

    def _run_eager(self, step: StepInputs) -> torch.Tensor:
        set_context(cu_seqlens_q=self._to_device(step.cu_seqlens_q, torch.int32),
                    seq_lens=self._to_device(step.seq_lens, torch.int32),
                    block_tables=self._to_device(step.block_tables, torch.int32),
                    slot_mapping=self._to_device(step.slot_mapping, torch.long),
                    max_seqlen_q=step.max_seqlen_q)
        input_ids = self._to_device(step.input_ids, torch.long)
        if step.deferred:  # ids -1 - i: the last step's sample i
            waiting = input_ids < 0
            input_ids = torch.where(waiting, self.last_tokens[torch.where(waiting, -1 - input_ids, 0)], input_ids)
        try:
            return self.model(input_ids, self._to_device(step.positions, torch.long))
        finally:
            reset_context()  # the step's tensors must not outlive it, even on an error

    @torch.inference_mode()
    def _warm_up_sampler(self) -> None:
        """Launches once every variant of the sampling kernels that a step can launch, so that
        Triton compiles each (or loads it from its cache) now, not in the first request that
        needs it: a draw for each of sampler_warmup.warmup_params(), then a publish of each
        kind of row count. Every rank computes the LM head's logits, in the layout of a step's
        (with several ranks, gathered to rank 0); rank 0 draws."""
        hidden = torch.zeros(1, self.config.hf_config.hidden_size, dtype=self.dtype, device=self.device)
        logits = self.model.compute_logits(hidden)
        if logits is None:
            return
        sampler_warmup.draw_every_variant(functools.partial(self._sample, logits), self.config.hf_config.vocab_size,
                                          self.noise_rng, self.device)
        sampler_warmup.publish_every_count((self.last_tokens, self.sampled_host, self.publish_parity),
                                           self.config.max_num_seqs, self.device)
        self._synchronize()

    def _capture_graphs(self) -> None:
        self.graphs.capture(self.model, self.sampler, self.config, self.max_blocks_per_seq,
                            (self.last_tokens, self.sampled_host, self.publish_parity), self.workers, self.tp_size)

    def memory_stats(self) -> dict:
        self._check_open()
        stats = {"kv_cache_bytes": self.kv_cache.numel() * self.kv_cache.element_size()}
        if self.device.type == "cuda":
            stats.update(device_allocated_bytes=torch.cuda.memory_allocated(self.device),
                         device_reserved_bytes=torch.cuda.memory_reserved(self.device),
                         device_peak_bytes=torch.cuda.max_memory_allocated(self.device))
        return stats


def _drop_weight_loaders(model) -> None:
    """A parameter's weight_loader is bound to its module, which holds the parameter: a cycle
    that would keep the weights on the device after the engine is dropped, until the garbage
    collector runs. Nothing loads weights after the build."""
    for param in model.parameters():
        vars(param).pop("weight_loader", None)
        vars(param).pop("quantize_from", None)
