"""CUDA graphs of the forward pass, captured once per shape (tokens, sequences, max_seqlen_q):
decode batches of 1..max_num_seqs sequences, and single-sequence prefills of up to
max_num_batched_tokens (which otherwise spend most of their time launching kernels from
Python). A step runs in the smallest graph that holds it. Padding rows belong to padding
sequences of seq_len 0: they read no keys, write no cache slot (-1), and their output is
dropped.

With speculative decoding, verification graphs hold batches of decodes that verify proposals:
b sequences of up to q query rows each (b * q rows, and a padding sequence), for q - 1 of 1, 2,
4, ... proposals up to num_speculative_tokens, while b * q is within the speculative token
budget.

Decode graphs of up to LOGITS_IN_GRAPH_MAX_ROWS sequences end with the LM head, whose launch
and graph boundary are a visible share of a small batch's step; not with several ranks, where
the LM head's gather to rank 0 is a collective. Each of them has a twin that also draws and
publishes the tokens, for steps whose rows all draw without filters or log-probabilities.

A graph's first kernel stages its inputs from pinned memory the host wrote
(kernels.stage_inputs), and the draw's last kernel publishes the tokens into pinned memory: no
copy-engine transfer between the steps' kernels. The measured effect of each choice:
docs/performance.md and docs/rejected.md."""
from typing import NamedTuple

import torch

from nanovllm import kernels
from nanovllm.engine.speculative import SPECULATIVE_TOKEN_BUDGET
from nanovllm.engine.worker import synchronize, wait_for
from nanovllm.utils.context import reset_context, set_context

LOGITS_IN_GRAPH_MAX_ROWS = 16


class GraphShape(NamedTuple):
    tokens: int
    seqs: int
    max_seqlen_q: int


class CUDAGraphs:
    """One runner's graphs: none until capture(), none again after clear()."""

    def __init__(self):
        self.graphs: dict[GraphShape, torch.cuda.CUDAGraph] = {}
        self.graph_logits: dict[GraphShape, torch.Tensor] = {}  # the LM head's output of small decode graphs
        self.sample_graphs: dict[GraphShape, torch.cuda.CUDAGraph] = {}  # the twins that also draw

    def __bool__(self) -> bool:
        return bool(self.graphs)

    def clear(self) -> None:
        """Drops the graphs (their memory pool goes with the last), before the NCCL
        communicators they were captured with are destroyed."""
        for held in (self.graphs, self.graph_logits, self.sample_graphs):
            held.clear()

    def capture(self, model, sampler, config, max_blocks_per_seq: int, buffers, workers, tp_size: int) -> None:
        """Captures a graph of every shape the configuration reaches. `buffers` are the runner's
        last_tokens, sampled_host and publish_parity (kernels.publish_tokens), `workers` its
        tensor-parallel ranks or None."""
        self.model, self.sampler, self.workers, self.tp_size = model, sampler, workers, tp_size
        self.last_tokens, self.sampled_host, self.publish_parity = buffers
        max_bs = min(config.max_num_seqs, 512)
        decode = [GraphShape(b, b, 1) for b in sorted({1, 2, 4, 8, *range(16, max_bs + 1, 16), max_bs}) if b <= max_bs]
        max_prefill = min(config.max_num_batched_tokens, config.max_model_len, 8192)
        prefill = [GraphShape(t, 2, t) for t in (16 << i for i in range(10)) if t <= max_prefill]
        self.shapes = decode + prefill + verification_shapes(config, max_bs)
        self._allocate(config, max_blocks_per_seq)
        self._capture()

    def _allocate(self, config, max_blocks_per_seq: int) -> None:
        max_tokens = max(s.tokens for s in self.shapes)
        max_seqs = max(s.seqs for s in self.shapes)
        device = self.last_tokens.device
        # Per token: input ids, positions, slot mapping. Per sequence: seq_lens, cu_seqlens_q,
        # then for the graphs that draw noise seeds and temperatures (float32 bits).
        self.token_rows = torch.zeros(3, max_tokens, dtype=torch.long, device=device)
        self.seq_rows = torch.zeros(4, max_seqs + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_seqs, max_blocks_per_seq, dtype=torch.int32, device=device)
        # Two slots of pinned memory, a replay's staged inputs in one while the host writes the
        # other; the event after each replay says when its slot is free again.
        capacity = kernels.staged_length(max_tokens, max_seqs, max_seqs * max_blocks_per_seq)
        self.staging = torch.zeros(2, capacity, dtype=torch.int32, pin_memory=True)
        self._staging_slots = self.staging.numpy()
        self.staging_parity = torch.zeros(1, dtype=torch.int32, device=device)
        self._staged_events = [torch.cuda.Event(), torch.cuda.Event()]
        self._staged = 0  # replays so far: the next one's slot is _staged % 2
        self.output = torch.zeros(max_tokens, config.hf_config.hidden_size, dtype=config.torch_dtype, device=device)

    def _capture(self) -> None:
        sampling_graphs = kernels.graph_capturable(self.last_tokens.device, sampling=True)
        pool = None
        for shape in sorted(self.shapes, reverse=True):  # largest first: the rest reuse its pool
            self._stage_padding(shape)
            graph = torch.cuda.CUDAGraph()
            self._forward(shape)  # compiles kernels and settles allocations outside capture
            with torch.cuda.graph(graph, pool):
                logits = self._forward(shape)
            pool = graph.pool()
            self.graphs[shape] = graph
            if logits is None:
                continue
            # Kept alive, so no later capture reuses its memory in the graphs' shared pool; graphs
            # captured before it may use that memory for their intermediates, so it is read (by
            # the sampler, on the same stream) before the next replay.
            self.graph_logits[shape] = logits
            if sampling_graphs:
                self._draw(shape, logits)  # the sampler's kernels, compiled outside capture
                self.sample_graphs[shape] = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.sample_graphs[shape], pool):
                    self._draw(shape, self._forward(shape))
        synchronize(self.workers)
        reset_context()
        # the runs before each capture staged and published: both counts start again
        self.staging_parity.zero_()
        self.publish_parity.zero_()
        synchronize(self.workers)

    def _stage_padding(self, shape: GraphShape) -> None:
        """Puts a step of padding sequences of `shape` in both slots, for the run and the
        capture of its graph."""
        tokens, seqs, _ = shape
        values = kernels.staged_values([[0] * tokens, [0] * tokens, [-1] * tokens],
                                       [[0] * (seqs + 1), [*range(seqs), tokens], [0] * (seqs + 1), [0] * (seqs + 1)],
                                       [])
        synchronize(self.workers)  # the run before may still read them
        self._staging_slots[:, :len(values)] = values

    def _forward(self, shape: GraphShape) -> torch.Tensor | None:
        """The forward pass of a graph of `shape`; the LM head's logits where it ends with it."""
        tokens, seqs, max_seqlen_q = shape
        kernels.stage_inputs(self.staging, self.staging_parity, self.last_tokens, self.token_rows, self.seq_rows,
                             self.block_tables, tokens, seqs)
        set_context(cu_seqlens_q=self.seq_rows[1, :seqs + 1], seq_lens=self.seq_rows[0, :seqs],
                    block_tables=self.block_tables[:seqs], slot_mapping=self.token_rows[2, :tokens],
                    max_seqlen_q=max_seqlen_q)
        hidden = self.model(self.token_rows[0, :tokens], self.token_rows[1, :tokens])
        if max_seqlen_q == 1 and tokens <= LOGITS_IN_GRAPH_MAX_ROWS and self.tp_size == 1:
            # The hidden states stay inside: a copy out would be one more kernel in the step.
            return self.model.compute_logits(hidden)
        self.output[:tokens] = hidden
        return None

    def _draw(self, shape: GraphShape, logits: torch.Tensor) -> None:
        seqs = shape.seqs
        temperatures = self.seq_rows[3, :seqs].view(torch.float32)
        tokens = self.sampler(logits, temperatures, self.seq_rows[2, :seqs])[0]
        kernels.publish_tokens(tokens, self.last_tokens, self.sampled_host, self.publish_parity)

    # --- a step ---------------------------------------------------------------------------
    def shape_for(self, step) -> GraphShape | None:
        """The smallest graph that holds `step`, None where none does."""
        if step.max_seqlen_q == 1:
            fits = [s for s in self.shapes if s.max_seqlen_q == 1 and s.seqs >= step.num_seqs]
        elif step.num_seqs == 1 or step.logit_rows is not None:
            # a padding sequence takes the rows left over
            fits = [s for s in self.shapes if s.max_seqlen_q >= step.max_seqlen_q > 1 and s.seqs > step.num_seqs
                    and s.tokens >= step.num_tokens]
        else:
            return None
        return min(fits, default=None)

    def draws(self, shape: GraphShape, step, sampling) -> bool:
        """Whether the graph of `shape` also draws the step's tokens: it has a twin that draws,
        and every one of the step's sequences samples a plain draw (`sampling`: their
        SamplingInputs, None on ranks that do not sample)."""
        return (shape in self.sample_graphs and sampling is not None and len(sampling.seeds) == step.num_seqs
                and sampling.plain)

    def logits(self, shape: GraphShape) -> torch.Tensor | None:
        """The LM head's output of the last replay of `shape`, where its graph ends with it."""
        return self.graph_logits.get(shape)

    def replay(self, step, shape: GraphShape, sampling=None) -> torch.Tensor | None:
        """The step's hidden states, None where the graph ends with the LM head (logits()).
        `sampling`: the step's SamplingInputs where the graph replayed is the twin that also
        draws their tokens."""
        tokens, seqs, _ = shape
        pad_tokens, pad_seqs = tokens - step.num_tokens, seqs - step.num_seqs
        # Padding sequences take one padding row each, the last one all that remain.
        cu = step.cu_seqlens_q + [step.num_tokens + i for i in range(1, pad_seqs)] + [tokens] * (pad_seqs > 0)
        # Padding rows write no cache slot (-1); padding sequences read no keys (seq_len 0).
        token_rows = [step.input_ids + [0] * pad_tokens, step.positions + [0] * pad_tokens,
                      step.slot_mapping + [-1] * pad_tokens]
        seq_rows = [step.seq_lens + [0] * (pad_seqs + 1), cu]
        seq_rows += [[0] * (seqs + 1)] * 2 if sampling is None else sampling.staged_rows(seqs + 1)
        values = kernels.staged_values(token_rows, seq_rows, step.block_tables)
        slot = self._staged % 2
        wait_for(self.workers, self._staged_events[slot])  # the replay two back has read it
        self._staging_slots[slot, :len(values)] = values
        (self.graphs if sampling is None else self.sample_graphs)[shape].replay()
        self._staged_events[slot].record()
        self._staged += 1
        return None if shape in self.graph_logits else self.output[:step.num_tokens]


def verification_shapes(config, max_bs: int) -> list[GraphShape]:
    if config.speculative is None:
        return []
    k = config.speculative.num_speculative_tokens
    widths = sorted({*(1 + (1 << i) for i in range(k.bit_length()) if 1 << i <= k), 1 + k})
    return [GraphShape(b * q, b + 1, q) for q in widths for b in (1 << i for i in range(10))
            if b <= max_bs and b * q <= SPECULATIVE_TOKEN_BUDGET]
