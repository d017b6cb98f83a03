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
import struct
import weakref

import torch
import xxhash

from nanovllm import distributed, kernels
from nanovllm.config import CPU_KV_CACHE_BYTES, Config
from nanovllm.engine import sampler_warmup
from nanovllm.engine.scheduler import ScheduledBatch
from nanovllm.engine.sequence import PLACEHOLDER, Sequence
from nanovllm.engine.worker import WorkerError, Workers, start_ranks
from nanovllm.layers.attention import Attention
from nanovllm.layers.sampler import Sampler
from nanovllm.models import MODEL_REGISTRY
from nanovllm.sampling_params import GREEDY_TEMPERATURE, MAX_LOGPROBS
from nanovllm.utils.context import reset_context, set_context
from nanovllm.utils.loader import init_dummy_weights, load_model

LOGITS_IN_GRAPH_MAX_ROWS = 16
# What a closed runner keeps: the settings and its ranks' handle, no tensor.
_KEPT_WHEN_CLOSED = {"config", "rank", "tp_size", "device", "dtype", "closed", "workers"}


class SampledTokens:
    """Token ids sampled on the device, on their way to the host: kernels.publish_tokens stores
    them into `host`, a row of pinned memory, and the log-probabilities the rows asked for come
    by one non-blocking copy into pinned memory. With `on_gpu`, both are read once an event
    recorded after them has passed, waited for by `wait` (given the event).
    `logprobs`: None when no row asked, else the float32 tensor _pack_logprobs made;
    `num_logprobs`: each row's SamplingParams.logprobs."""

    def __init__(self, host: torch.Tensor | None, on_gpu: bool = False, wait=None,
                 logprobs: torch.Tensor | None = None, num_logprobs: list[int | None] | None = None):
        self._host, self._wait, self.num_logprobs, self._tokens = host, wait, num_logprobs, None
        self.logprobs_packed = _pinned_copy(logprobs) if on_gpu and logprobs is not None else logprobs
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


def _pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


def _pack_logprobs(chosen: torch.Tensor, top) -> torch.Tensor:
    """One float32 tensor, so that one copy takes the log-probabilities to the host: the chosen
    tokens' [B], then the top rows' values [R * n] and ids [R * n] (int32 bits)."""
    if top is None:
        return chosen
    values, ids = top
    return torch.cat([chosen, values.flatten(), ids.to(torch.int32).view(torch.float32).flatten()])


class ModelRunner:
    def __init__(self, config: Config, rank: int = 0):
        """`rank` > 0: a tensor-parallel rank in its own process, in the group already."""
        self.config, self.rank = config, rank
        self.tp_size = config.tensor_parallel_size
        self.device, self.dtype = config.torch_device, config.torch_dtype  # "cuda": this rank's GPU
        self.block_size = config.kvcache_block_size
        self.max_blocks_per_seq = -(-config.max_model_len // self.block_size)
        self.pin = self.device.type == "cuda"
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.graph_logits: dict[tuple, torch.Tensor] = {}  # the LM head's output of small decode graphs
        # Twins of the graphs with the LM head that also draw (without filters or
        # log-probabilities) and publish the tokens.
        self.sample_graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.workers: Workers | None = None
        self.closed = False
        # The layers take their shard from the process's group: one engine's at a time.
        if distributed.rank_and_size() != ((rank, self.tp_size) if rank else (0, 1)):
            raise RuntimeError("a tensor-parallel engine is open in this process; close() it first")
        if self.tp_size > 1 and rank == 0:
            self.workers = start_ranks(type(self), config)
            # Stops the ranks when the engine is closed, collected, or the interpreter exits
            # (registered after multiprocessing's exit hook, so it runs before it).
            self._shutdown = weakref.finalize(self, _shutdown, self.workers, self.graphs)
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
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
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
        self._last_logprobs: torch.Tensor | None = None  # rank 0's, packed (_pack_logprobs), when rows asked
        self._last_sample_rows: dict[int, int] = {}  # each sampling request's row in last_tokens
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
        for held in (self.graphs, self.graph_logits, self.sample_graphs):  # also held by the ranks' finalizer
            held.clear()
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
            with torch.device(self.device):
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
        hf = self.config.hf_config
        per_token = 2 * hf.num_hidden_layers * self.num_kv_heads * hf.head_dim * self.dtype.itemsize
        return per_token * self.block_size

    @property
    def num_kv_heads(self) -> int:
        """Of this rank: its cache holds its share of the heads."""
        return self.config.hf_config.num_key_value_heads // self.tp_size

    def _allocate_kv_cache(self) -> int:
        num_blocks, field = self.config.num_kvcache_blocks, "num_kvcache_blocks"
        if num_blocks <= 0 and self.device.type == "cuda":
            num_blocks, field = self._blocks_from_gpu_memory(), "gpu_memory_utilization"
        elif num_blocks <= 0:
            num_blocks = self._cpu_default_blocks()
        if self.tp_size > 1:  # the scheduler's block ids must fit every rank's cache
            num_blocks = self._min_across_ranks(num_blocks)
        if num_blocks < self.max_blocks_per_seq:
            raise ValueError(f"{field}: leaves room for {max(num_blocks, 0)} KV blocks of {self.block_size} tokens; "
                             f"one sequence of max_model_len={self.config.max_model_len} needs {self.max_blocks_per_seq}")
        self._bind_kv_cache(num_blocks)
        return num_blocks

    def _cpu_default_blocks(self) -> int:
        """A CPU_KV_CACHE_BYTES budget, but no more than max_num_seqs full-length sequences use."""
        needed = self.config.max_num_seqs * self.max_blocks_per_seq
        return max(1, min(CPU_KV_CACHE_BYTES // self.block_bytes(), needed))

    def _bind_kv_cache(self, num_blocks: int) -> None:
        hf = self.config.hf_config
        shape = (2, len(self.attention_layers), num_blocks, self.block_size, self.num_kv_heads, hf.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.attention_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    def _blocks_from_gpu_memory(self) -> int:
        """Runs the largest step the scheduler can produce (with a temporary cache just large
        enough for it) and the sampling of a full decode batch, then gives the cache what is
        left of gpu_memory_utilization."""
        seq_len = min(self.config.max_model_len, self.config.max_num_batched_tokens)
        num_seqs = -(-self.config.max_num_batched_tokens // seq_len)
        torch.cuda.empty_cache()
        self._bind_kv_cache(num_seqs * self.max_blocks_per_seq)
        # Weights and the temporary cache are in `base`; the peak above it is the activations.
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._warmup(num_seqs, seq_len)
        self._synchronize()
        peak_activations = torch.cuda.max_memory_allocated(self.device) - base
        del self.kv_cache
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        weights_and_others = total - free
        budget = total * self.config.gpu_memory_utilization - weights_and_others - peak_activations
        return int(budget // self.block_bytes())

    @torch.inference_mode()
    def _warmup(self, num_seqs: int, seq_len: int) -> None:
        device = self.device
        tokens = torch.zeros(num_seqs * seq_len, dtype=torch.long, device=device)
        positions = torch.arange(seq_len, device=device).repeat(num_seqs)
        tables = torch.arange(num_seqs * self.max_blocks_per_seq, dtype=torch.int32, device=device).view(num_seqs, -1)
        slots = (tables[:, :, None] * self.block_size + torch.arange(self.block_size, device=device)).flatten(1)
        set_context(cu_seqlens_q=torch.arange(0, num_seqs * seq_len + 1, seq_len, dtype=torch.int32, device=device),
                    seq_lens=torch.full((num_seqs,), seq_len, dtype=torch.int32, device=device),
                    block_tables=tables, max_seqlen_q=seq_len, slot_mapping=slots[:, :seq_len].flatten().long())
        hidden = self.model(tokens, positions)
        reset_context()
        # A full decode batch samples this many rows, with filters and every row asking for the
        # most log-probabilities: top_logprobs' log_softmax over the vocabulary is sampling's peak.
        rows = self.config.max_num_seqs
        logits = self.model.compute_logits(hidden[-1:].expand(rows, -1))
        if logits is not None:  # None on ranks other than 0, which do not sample
            ones = torch.ones(rows, device=device)
            self.sampler(logits, ones, torch.zeros(rows, dtype=torch.long, device=device),
                         torch.full((rows,), 50, device=device), ones * 0.9, logprobs=True,
                         top_rows=torch.arange(rows, device=device), num_top=MAX_LOGPROBS)

    def _min_across_ranks(self, value: int) -> int:
        value = distributed.all_reduce(torch.tensor([value], device=self.device), op=torch.distributed.ReduceOp.MIN)
        self._synchronize()
        return int(value.item())

    def _synchronize(self) -> None:
        """Waits for the device; rank 0 of several raises meanwhile if another rank fails."""
        if self.device.type != "cuda":
            return
        if self.workers:
            event = torch.cuda.Event()
            event.record()
            _wait_for(self.workers, event)
        torch.cuda.synchronize()

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

    def prepare(self, batch: ScheduledBatch):
        input_ids, positions, slot_mapping, cu_seqlens_q, seq_lens = [], [], [], [0], []
        deferred = False  # whether an input id is still to come from the last step's samples
        size = self.block_size
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            if num_new == 1:  # decode: the common case, kept cheap
                token = seq.token_ids[start]
                if token == PLACEHOLDER:  # -1 - its row in last_tokens
                    token, deferred = -1 - self._last_sample_rows[seq.request_id], True
                input_ids.append(token)
                positions.append(start)
                slot_mapping.append(seq.block_table[start // size] * size + start % size)
            else:
                input_ids.extend(seq.token_ids[start:end])
                positions.extend(range(start, end))
                slot_mapping.extend(self._slots(seq, start, end))
            cu_seqlens_q.append(cu_seqlens_q[-1] + num_new)
            seq_lens.append(end)
        width = max(len(seq.block_table) for seq in batch.seqs)
        block_tables = [seq.block_table + [-1] * (width - len(seq.block_table)) for seq in batch.seqs]
        return dict(input_ids=input_ids, positions=positions, slot_mapping=slot_mapping, cu_seqlens_q=cu_seqlens_q,
                    seq_lens=seq_lens, block_tables=block_tables, max_seqlen_q=max(batch.num_new_tokens),
                    deferred=deferred, sample_rows=batch.sample_rows)

    def launch(self, batch: ScheduledBatch) -> SampledTokens:
        """Queues one forward pass and the sampling of every sequence in `batch.sample_rows`;
        returns their tokens without waiting for them."""
        self._check_open()
        step = self.prepare(batch)
        seqs = [batch.seqs[row] for row in batch.sample_rows]
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
        # The wait holds the ranks, not the runner: the runner keeps its readers, and a cycle
        # would keep the device memory until the garbage collector finds it.
        sampled = SampledTokens(None if row is None else self.sampled_host[row, :len(seqs)], self.pin,
                                functools.partial(_wait_for, self.workers), self._last_logprobs, num_logprobs)
        if row is not None:
            self._readers[row] = sampled
        return sampled

    @torch.inference_mode()
    def run_step(self, step: dict, seqs=None) -> None:
        """The forward pass of a prepared step and the tokens of its sample rows (`seqs`, on rank
        0): sampled on rank 0, broadcast from it to the other ranks. Log-probabilities stay on
        rank 0."""
        shape = self._graph_shape_for(step) if self.graphs else None
        sample_in_graph = shape in self.sample_graphs and _plain_draws(seqs, len(step["seq_lens"]))
        sample_rows = step["sample_rows"]
        self._last_logprobs, self._publish_row = None, None
        row = self._published % 2
        if sample_rows and self.rank == 0 and self._readers[row] is not None:
            self._readers[row].settle()  # the tokens two publishes back leave the row first
        hidden = self._replay_graph(step, shape, seqs if sample_in_graph else None) if shape else self._run_eager(step)
        if not sample_rows:
            return
        if self.rank == 0:
            if not sample_in_graph:  # else the graph replayed drew and published them
                graph_logits = self.graph_logits.get(shape) if shape else None
                tokens, self._last_logprobs = self._sample(hidden, step, sample_rows, seqs, graph_logits)
                kernels.publish_tokens(tokens, self.last_tokens, self.sampled_host, self.publish_parity)
            self._published, self._publish_row = self._published + 1, row
        else:
            self._logits(hidden, step, sample_rows)  # this rank's vocabulary rows, gathered on rank 0
        if self.tp_size > 1:
            distributed.broadcast_from_first(self.last_tokens[:len(sample_rows)])

    def _logits(self, hidden: torch.Tensor | None, step, sample_rows: list[int],
                graph_logits: torch.Tensor | None = None) -> torch.Tensor | None:
        """`hidden`: None after a decode graph that ends with the LM head, whose output is
        `graph_logits` (a decode step samples every row)."""
        if hidden is None:
            return graph_logits[:len(sample_rows)]
        last_rows = [step["cu_seqlens_q"][row + 1] - 1 for row in sample_rows]
        if len(last_rows) < hidden.shape[0]:  # a decode step samples every row: no gather needed
            hidden = hidden[self._to_device(last_rows, torch.long)]
        return self.model.compute_logits(hidden)

    def _sample(self, hidden: torch.Tensor | None, step, sample_rows: list[int], seqs, graph_logits):
        """-> (token ids [B], packed log-probabilities or None when no row asks)."""
        logits = self._logits(hidden, step, sample_rows, graph_logits)
        tensors = self._sampling_tensors(seqs)
        if all(s.params.logprobs is None for s in seqs):
            return self.sampler(logits, *tensors)[0], None
        top_rows = [row for row, s in enumerate(seqs) if s.params.logprobs]
        num_top = max((seqs[row].params.logprobs for row in top_rows), default=0)
        tokens, (chosen, top) = self.sampler(logits, *tensors, logprobs=True, num_top=num_top,
                                             top_rows=self._to_device(top_rows, torch.long) if top_rows else None)
        return tokens, _pack_logprobs(chosen, top)

    def _run_eager(self, step) -> torch.Tensor:
        set_context(cu_seqlens_q=self._to_device(step["cu_seqlens_q"], torch.int32),
                    seq_lens=self._to_device(step["seq_lens"], torch.int32),
                    block_tables=self._to_device(step["block_tables"], torch.int32),
                    slot_mapping=self._to_device(step["slot_mapping"], torch.long),
                    max_seqlen_q=step["max_seqlen_q"])
        input_ids = self._to_device(step["input_ids"], torch.long)
        if step["deferred"]:  # ids -1 - i: the last step's sample i
            waiting = input_ids < 0
            input_ids = torch.where(waiting, self.last_tokens[torch.where(waiting, -1 - input_ids, 0)], input_ids)
        try:
            return self.model(input_ids, self._to_device(step["positions"], torch.long))
        finally:
            reset_context()  # the step's tensors must not outlive it, even on an error

    def _sampling_tensors(self, seqs):
        temperatures = self._to_device(_temperatures(seqs), torch.float32)
        seeds = self._to_device([self._noise_seed(s) for s in seqs], torch.long)
        min_ps = self._to_device([s.params.min_p for s in seqs], torch.float32) if any(
            s.params.min_p > 0 for s in seqs) else None
        if not any(_ranks(s.params) for s in seqs):
            return temperatures, seeds, None, None, min_ps
        vocab = self.config.hf_config.vocab_size
        top_ks = [s.params.top_k if s.params.top_k != -1 else vocab for s in seqs]
        # how many tokens a row's top-k / top-p may keep: the sampler's sort-free bound
        max_top_k = max(k for s, k in zip(seqs, top_ks) if _ranks(s.params))
        return (temperatures, seeds, self._to_device(top_ks, torch.long),
                self._to_device([s.params.top_p for s in seqs], torch.float32), min_ps, max_top_k)

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
        draws = [functools.partial(self._sample, None, None, [0], [Sequence(0, [0], params)], logits)
                 for params in sampler_warmup.warmup_params()]
        draws[0]()  # alone: a kernel's first launch sets up its caches
        sampler_warmup.in_parallel(draws[1:], self.device)
        for count in sampler_warmup.SPECIALIZED_COUNTS:
            if count <= self.config.max_num_seqs:
                kernels.publish_tokens(torch.zeros(count, dtype=torch.long, device=self.device), self.last_tokens,
                                       self.sampled_host, self.publish_parity)
        self.publish_parity.zero_()  # the host counts publishes from 0
        self._synchronize()

    def _noise_seed(self, seq) -> int:
        """The sampling noise key of a sequence's next token: from its seed and position when
        it has one (the same token in any batch, across preemptions), else fresh."""
        if seq.params.seed is None:
            return self.noise_rng.getrandbits(31)
        return xxhash.xxh32_intdigest(f"{seq.params.seed}:{seq.num_output_tokens}".encode()) & 0x7FFFFFFF

    # --- CUDA graphs -----------------------------------------------------------------------
    # A graph is captured for a shape (tokens, sequences, max_seqlen_q): decode batches of
    # 1..max_num_seqs sequences, and single-sequence prefills of up to max_num_batched_tokens
    # (which otherwise spend ~30 ms launching ~400 kernels from Python, for ~2 ms of GPU work).
    # A step runs in the smallest graph that holds it. Padding rows belong to padding sequences
    # of seq_len 0: they read no keys, write no cache slot (-1), and their output is dropped.
    # Decode graphs of up to LOGITS_IN_GRAPH_MAX_ROWS sequences end with the LM head: its
    # launch and the graph boundary before it are a visible share of a small batch's step.
    # Not with several ranks, where the LM head's gather to rank 0 is a collective. Each of them
    # has a twin in sample_graphs that also draws, for steps whose rows all draw without
    # filters or log-probabilities (greedy, temperature, seeds): the sampler's launches, its
    # buffers and the seeds' and temperatures' copies leave the step (H200, Qwen3-0.6B, 1,024
    # tokens: 1 x 0.677 -> 0.674 ms, 4 x 1.035 -> 1.028, 16 x 1.615 -> 1.606, against eager
    # draws after the graph or, at one sequence, a graph of the draw alone).
    # A graph's first kernel stages its inputs from pinned memory the host wrote
    # (kernels.stage_inputs), and the draw's last kernel publishes the tokens into pinned
    # memory: no copy-engine transfer between the steps' kernels (H200, Qwen3-0.6B, 1 x 1,024:
    # 0.694 -> 0.677 ms a step with both, against copies before the replay and after the draw).
    def _capture_graphs(self) -> None:
        max_bs = min(self.config.max_num_seqs, 512)
        decode = [(b, b, 1) for b in sorted({1, 2, 4, 8, *range(16, max_bs + 1, 16), max_bs}) if b <= max_bs]
        max_prefill = min(self.config.max_num_batched_tokens, self.config.max_model_len, 8192)
        prefill = [(t, 2, t) for t in (16 << i for i in range(10)) if t <= max_prefill]
        self.graph_shapes = decode + prefill
        max_tokens = max(t for t, _, _ in self.graph_shapes)
        max_seqs = max(s for _, s, _ in self.graph_shapes)
        device = self.device
        # Per token: input ids, positions, slot mapping. Per sequence: seq_lens, cu_seqlens_q,
        # then for sampling graphs noise seeds and temperatures (float32 bits).
        self.graph_tokens = torch.zeros(3, max_tokens, dtype=torch.long, device=device)
        self.graph_seqs = torch.zeros(4, max_seqs + 1, dtype=torch.int32, device=device)
        # Two slots of pinned memory, a replay's staged inputs in one while the host writes the
        # other; the event after each replay says when its slot is free again.
        capacity = kernels.staged_length(max_tokens, max_seqs, max_seqs * self.max_blocks_per_seq)
        self.staging = torch.zeros(2, capacity, dtype=torch.int32, pin_memory=True)
        self._staging_slots = self.staging.numpy()
        self.staging_parity = torch.zeros(1, dtype=torch.int32, device=device)
        self._staged_events = [torch.cuda.Event(), torch.cuda.Event()]
        self._staged = 0  # replays so far: the next one's slot is _staged % 2
        self.graph_inputs = dict(
            input_ids=self.graph_tokens[0], positions=self.graph_tokens[1], slot_mapping=self.graph_tokens[2],
            seq_lens=self.graph_seqs[0, :max_seqs], cu_seqlens_q=self.graph_seqs[1],
            block_tables=torch.zeros(max_seqs, self.max_blocks_per_seq, dtype=torch.int32, device=device),
        )
        self.graph_output = torch.zeros(max_tokens, self.config.hf_config.hidden_size, dtype=self.dtype, device=device)
        sampling_graphs = kernels.graph_capturable(device, sampling=True)
        pool = None
        for shape in sorted(self.graph_shapes, reverse=True):  # largest first: the rest reuse its pool
            self._stage_padding(shape)
            graph = torch.cuda.CUDAGraph()
            self._graph_forward(shape)  # compiles kernels and settles allocations outside capture
            with torch.cuda.graph(graph, pool):
                logits = self._graph_forward(shape)
            pool = graph.pool()
            self.graphs[shape] = graph
            if logits is None:
                continue
            # Kept alive, so no later capture reuses its memory in the graphs' shared pool; graphs
            # captured before it may use that memory for their intermediates, so it is read (by
            # the sampler, on the same stream) before the next replay.
            self.graph_logits[shape] = logits
            if sampling_graphs:
                self._graph_sample(shape, logits)  # the sampler's kernels, compiled outside capture
                self.sample_graphs[shape] = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.sample_graphs[shape], pool):
                    self._graph_sample(shape, self._graph_forward(shape))
        self._synchronize()
        reset_context()
        # the runs before each capture staged and published: both counts start again
        self.staging_parity.zero_()
        self.publish_parity.zero_()
        self._synchronize()

    def _stage_padding(self, shape) -> None:
        """Puts a step of padding sequences of `shape` in both slots, for the run and the
        capture of its graph."""
        tokens, seqs, _ = shape
        values = kernels.staged_values([[0] * tokens, [0] * tokens, [-1] * tokens],
                                       [[0] * (seqs + 1), [*range(seqs), tokens], [0] * (seqs + 1), [0] * (seqs + 1)],
                                       [])
        self._synchronize()  # the run before may still read them
        self._staging_slots[:, :len(values)] = values

    def _graph_forward(self, shape) -> torch.Tensor | None:
        """The forward pass of a graph of `shape`; the LM head's logits where it ends with it."""
        tokens, seqs, max_seqlen_q = shape
        g = self.graph_inputs
        kernels.stage_inputs(self.staging, self.staging_parity, self.last_tokens, self.graph_tokens, self.graph_seqs,
                             g["block_tables"], tokens, seqs)
        set_context(cu_seqlens_q=g["cu_seqlens_q"][:seqs + 1], seq_lens=g["seq_lens"][:seqs],
                    block_tables=g["block_tables"][:seqs], slot_mapping=g["slot_mapping"][:tokens],
                    max_seqlen_q=max_seqlen_q)
        hidden = self.model(g["input_ids"][:tokens], g["positions"][:tokens])
        if max_seqlen_q == 1 and tokens <= LOGITS_IN_GRAPH_MAX_ROWS and self.tp_size == 1:
            # The hidden states stay inside: a copy out would be one more kernel in the step.
            return self.model.compute_logits(hidden)
        self.graph_output[:tokens] = hidden
        return None

    def _graph_sample(self, shape, logits: torch.Tensor) -> None:
        seqs = shape[1]
        temperatures = self.graph_seqs[3, :seqs].view(torch.float32)
        tokens = self.sampler(logits, temperatures, self.graph_seqs[2, :seqs])[0]
        kernels.publish_tokens(tokens, self.last_tokens, self.sampled_host, self.publish_parity)

    def _graph_shape_for(self, step) -> tuple | None:
        num_seqs, num_tokens = len(step["seq_lens"]), len(step["input_ids"])
        if step["max_seqlen_q"] == 1:
            fits = [s for s in self.graph_shapes if s[2] == 1 and s[1] >= num_seqs]
        elif num_seqs == 1:
            fits = [s for s in self.graph_shapes if s[2] > 1 and s[0] >= num_tokens]
        else:
            return None
        return min(fits, default=None)

    def _replay_graph(self, step, shape, sampled_seqs=None) -> torch.Tensor | None:
        """The step's hidden states, None where the graph ends with the LM head (graph_logits).
        `sampled_seqs`: the step's sequences when the graph replayed is the one that also draws
        their tokens (sample_graphs)."""
        tokens, seqs, _ = shape
        num_tokens, num_seqs = len(step["input_ids"]), len(step["seq_lens"])
        pad_tokens, pad_seqs = tokens - num_tokens, seqs - num_seqs
        # Padding sequences take one padding row each, the last one all that remain.
        cu = step["cu_seqlens_q"] + [num_tokens + i for i in range(1, pad_seqs)] + [tokens] * (pad_seqs > 0)
        # Padding rows write no cache slot (-1); padding sequences read no keys (seq_len 0).
        token_rows = [step["input_ids"] + [0] * pad_tokens, step["positions"] + [0] * pad_tokens,
                      step["slot_mapping"] + [-1] * pad_tokens]
        seq_rows = [step["seq_lens"] + [0] * (pad_seqs + 1), cu]
        if sampled_seqs is None:
            seq_rows += [[0] * (seqs + 1)] * 2
        else:  # padding rows draw greedily with seed 0
            temperatures = _temperatures(sampled_seqs) + [0.0] * (pad_seqs + 1)
            seq_rows += [[self._noise_seed(s) for s in sampled_seqs] + [0] * (pad_seqs + 1),
                         list(struct.unpack(f"{len(temperatures)}i", struct.pack(f"{len(temperatures)}f", *temperatures)))]
        values = kernels.staged_values(token_rows, seq_rows, step["block_tables"])
        slot = self._staged % 2
        _wait_for(self.workers, self._staged_events[slot])  # the replay two back has read it
        self._staging_slots[slot, :len(values)] = values
        (self.graphs if sampled_seqs is None else self.sample_graphs)[shape].replay()
        self._staged_events[slot].record()
        self._staged += 1
        return None if shape in self.graph_logits else self.graph_output[:num_tokens]

    def memory_stats(self) -> dict:
        self._check_open()
        stats = {"kv_cache_bytes": self.kv_cache.numel() * self.kv_cache.element_size()}
        if self.device.type == "cuda":
            stats.update(device_allocated_bytes=torch.cuda.memory_allocated(self.device),
                         device_reserved_bytes=torch.cuda.memory_reserved(self.device),
                         device_peak_bytes=torch.cuda.max_memory_allocated(self.device))
        return stats


def _temperatures(seqs) -> list[float]:
    # Every sampling path sees 0 for a near-zero temperature, where logits / T would overflow.
    return [s.params.temperature if s.params.temperature >= GREEDY_TEMPERATURE else 0.0 for s in seqs]


def _ranks(params) -> bool:
    """Whether the draw keeps only the top tokens (top-k or top-p), which the sampler ranks."""
    return params.top_k != -1 or params.top_p < 1


def _plain_draws(seqs, num_seqs: int) -> bool:
    """Every one of the step's sequences samples, without filters or log-probabilities."""
    return seqs is not None and len(seqs) == num_seqs and all(
        s.params.logprobs is None and not _ranks(s.params) and s.params.min_p <= 0 for s in seqs)


def _drop_weight_loaders(model) -> None:
    """A parameter's weight_loader is bound to its module, which holds the parameter: a cycle
    that would keep the weights on the device after the engine is dropped, until the garbage
    collector runs. Nothing loads weights after the build."""
    for param in model.parameters():
        vars(param).pop("weight_loader", None)


def _wait_for(workers: Workers | None, event: torch.cuda.Event) -> None:
    """event.synchronize(), watching the other ranks meanwhile: the collectives of a step
    whose rank is gone never end."""
    if workers:
        workers.wait_event(event)
    event.synchronize()


def _shutdown(workers: Workers, graphs: dict) -> None:
    """Rank 0's end of a tensor-parallel engine."""
    failed = workers.failure is not None
    workers.stop()
    if failed:  # the lost rank's collectives never finish: abort them before anything waits for them
        distributed.destroy(abort=True)
        graphs.clear()
    else:  # NCCL communicators go after the graphs captured with them
        graphs.clear()
        distributed.destroy()
    workers.join()
