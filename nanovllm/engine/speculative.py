"""Speculative decoding (docs/speculative_decoding.md): a proposer guesses the next k tokens of a
decoding sequence from what is on the host, the target verifies them in one step (the decode
row and its proposals as one row of k + 1 query tokens), and the scheduler keeps the proposals
equal to the tokens drawn at their positions, plus the draw after them.

Proposals are deterministic, so keeping a proposal exactly when the draw at its position equals
it is rejection sampling: output tokens follow the target's distribution, greedy output is
token for token the same, and a seeded request draws the same tokens with speculation on or off.

How many proposals a sequence verifies adapts, step by step, to the acceptance it has seen (an
exponential moving average) and to the batch: a step verifies at most SPECULATIVE_TOKEN_BUDGET
query tokens, so large batches decode plainly, with steps in flight."""
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from nanovllm.config import SpeculativeConfig
from nanovllm.engine import sampling_inputs
from nanovllm.engine.scheduler import ScheduledBatch
from nanovllm.engine.sequence import PLACEHOLDER, Sequence
from nanovllm.sampling_params import SamplingParams

# Query tokens of the decode rows a verifying step may have at most: beyond it a step is no
# longer bound by reading the weights, and each verified token costs about a decoded one.
SPECULATIVE_TOKEN_BUDGET = 128
# A proposal is worth verifying while the chance that it is reached and accepted, the
# acceptance rate to the power of its place, is at least this.
MIN_PROPOSAL_VALUE = 0.25
# Weight of the last step's acceptance in a sequence's moving average.
ACCEPTANCE_WEIGHT = 0.3
# A sequence that stopped speculating tries one proposal again after this many steps.
PROBE_INTERVAL = 16


def speculates(params: SamplingParams) -> bool:
    """Rows that ask for log-probabilities, structured output or edited logits (penalties,
    biases, bans, min_tokens: they depend on the tokens before each position) decode one token
    a step."""
    return params.logprobs is None and params.structured_outputs is None and not sampling_inputs.edits(params)


@dataclass(slots=True)
class _Acceptance:
    rate: float = 1.0  # moving average of accepted / proposed
    idle_steps: int = 0  # steps since the sequence last verified a proposal


class Speculator:
    """Plans each step's proposals, proposes them (ngram lookup or a draft model) and keeps the
    acceptance statistics."""

    def __init__(self, config: SpeculativeConfig, draft=None):
        self.config, self.draft = config, draft
        self.acceptance: dict[int, _Acceptance] = {}
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0

    def plan(self, running: list[Sequence]) -> dict[int, int]:
        """Request id -> the proposals its next decode may verify, for the sequences that
        speculate this step; empty: a plain step."""
        cap = min(self.config.num_speculative_tokens, SPECULATIVE_TOKEN_BUDGET // max(len(running), 1) - 1)
        if cap <= 0:
            return {}
        self.acceptance = {seq.request_id: self.acceptance.get(seq.request_id) or _Acceptance() for seq in running}
        if self.draft is not None:  # what finished or was aborted
            self.draft.computed = {key: value for key, value in self.draft.computed.items() if key in self.acceptance}
        plan = {}
        for seq in running:
            if not speculates(seq.params):
                continue
            state = self.acceptance[seq.request_id]
            k = 0
            while k < cap and state.rate ** (k + 1) >= MIN_PROPOSAL_VALUE:
                k += 1
            if k == 0 and state.idle_steps >= PROBE_INTERVAL:
                k = 1
            state.idle_steps = 0 if k else state.idle_steps + 1
            if k:
                plan[seq.request_id] = k
        return plan

    def propose(self, batch: ScheduledBatch) -> None:
        """Fills batch.proposals for the rows that reserved room for them and makes each such
        row compute its decode token and its proposals."""
        rows = list(batch.num_speculative)
        seqs = [batch.seqs[row] for row in rows]
        ks = [batch.num_speculative[row] for row in rows]
        if self.draft is not None:
            proposals = self.draft.propose(seqs, ks)
        else:
            proposals = [ngram_proposals(seq.token_ids, k, self.config.prompt_lookup_min,
                                         self.config.prompt_lookup_max) for seq, k in zip(seqs, ks)]
        for row, proposed in zip(rows, proposals):
            if proposed:
                batch.proposals[row] = proposed
                batch.num_new_tokens[row] = 1 + len(proposed)

    def record(self, batch: ScheduledBatch) -> None:
        """After postprocess: counts the step's proposals and acceptances."""
        for row, accepted in batch.num_accepted.items():
            seq, proposed = batch.seqs[row], len(batch.proposals.get(row, ()))
            state = self.acceptance.get(seq.request_id)
            if state is not None:
                rate = accepted / proposed if proposed else 0.0
                state.rate += ACCEPTANCE_WEIGHT * (rate - state.rate)
            if proposed:
                self.num_drafts += 1
                self.num_draft_tokens += proposed
                self.num_accepted_tokens += accepted
                if self.draft is not None:
                    self.draft.accepted(seq, batch.token_positions[batch.sample_rows.index(row)], proposed, accepted)

    def stats(self) -> dict:
        """Counters as vLLM names them, the acceptance rate and the mean accepted length (the
        tokens a verifying row gains: its accepted proposals and the draw after them)."""
        return {"spec_decode_num_drafts": self.num_drafts, "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_acceptance_rate": self.num_accepted_tokens / max(self.num_draft_tokens, 1),
                "spec_decode_mean_accepted_length": 1 + self.num_accepted_tokens / max(self.num_drafts, 1)}


def ngram_proposals(token_ids: list[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """The k tokens that followed the most recent earlier occurrence of the sequence's last n
    tokens, for the longest n in [lookup_min, lookup_max] that occurs; [] if none does."""
    tokens = np.asarray(token_ids)
    for n in range(min(lookup_max, len(tokens) - 1), lookup_min - 1, -1):
        # windows starting at 0 .. len - n - 1: every occurrence but the suffix itself
        windows = sliding_window_view(tokens[:-1], n)
        starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if len(starts):
            # Past the sequence's end the copy reads its own proposals: a repeating
            # stretch shorter than k proposes k tokens of its pattern.
            proposals, source = [], tokens[starts[-1] + n:].tolist()
            for i in range(k):
                proposals.append(source[i] if i < len(source) else proposals[i - len(source)])
            return proposals
    return []


class DraftProposer:
    """A draft model's greedy tokens. Its runner's cache has as many blocks as the target's and
    the sequences' block tables index both: a draft's keys and values for a position live in the
    block the target's do. Each proposal first computes what the draft has not seen of the
    sequence (all of it after admission or preemption), then k - 1 decodes."""

    def __init__(self, runner):
        self.runner = runner
        # request id -> (the block table the draft computed into, tokens it computed)
        self.computed: dict[int, tuple[list[int], int]] = {}
        self.greedy = SamplingParams(temperature=0.0)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        proxies = []
        for seq in seqs:
            table, computed = self.computed.get(seq.request_id, (None, 0))
            proxy = Sequence(seq.request_id, seq.token_ids, self.greedy)
            proxy.block_table = seq.block_table
            proxy.num_computed_tokens = computed if table is seq.block_table else 0
            proxies.append(proxy)
        steps = []
        for step in range(max(ks)):
            rows = [proxy for proxy, k in zip(proxies, ks) if k > step]
            batch = ScheduledBatch(rows, [proxy.num_uncomputed_tokens() for proxy in rows],
                                   sample_rows=list(range(len(rows))))
            steps.append((rows, self.runner.launch(batch)))
            for proxy in rows:  # as Scheduler.launched: the next decode reads the token on the device
                proxy.num_computed_tokens = len(proxy)
                proxy.append_token(PLACEHOLDER)
        proposals = {proxy.request_id: [] for proxy in proxies}
        for rows, sampled in steps:
            for proxy, token in zip(rows, sampled.tolist()):
                proposals[proxy.request_id].append(token)
        return [proposals[seq.request_id] for seq in seqs]

    def accepted(self, seq: Sequence, position: int, proposed: int, accepted: int) -> None:
        """The draft computed the tokens before `position` and its first proposed - 1
        proposals; of those, the accepted ones stay valid."""
        self.computed[seq.request_id] = (seq.block_table, position + min(accepted, proposed - 1))
