"""The request-level engine: validates and tokenizes prompts, queues them, and runs steps of
schedule -> forward + sample -> record until every request is done."""
import dataclasses
import itertools
import json
import os
import time
from collections import deque

from tqdm.auto import tqdm

from nanovllm.config import Config
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.prompts import prompt_token_ids, split_requests
from nanovllm.engine.sampled_tokens import SampledTokens
from nanovllm.engine.scheduler import ScheduledBatch, Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.speculative import DraftProposer, Speculator
from nanovllm.engine.structured_outputs import GrammarCompiler
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.gguf import gguf_tokenizer, is_gguf

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model_dir: str):
    """The checkpoint's tokenizer, or None for a folder without one (dummy-weight benchmarks),
    where prompts must be token ids. A GGUF file carries its own."""
    if is_gguf(model_dir):
        return gguf_tokenizer(model_dir)
    if not any(os.path.isfile(os.path.join(model_dir, name)) for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


def read_generation_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def eos_token_ids(config: Config, generation_config: dict, tokenizer) -> list[int]:
    ids = set(config.hf_config.eos_token_id)
    eos = generation_config.get("eos_token_id")
    ids.update([eos] if isinstance(eos, int) else eos or [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def sampling_defaults(generation_config: dict) -> dict:
    """The checkpoint's recommended sampling: the SamplingParams fields its generation config
    sets. top_k 0 is transformers' "no top-k", -1 here."""
    defaults = {name: generation_config[name] for name in ("temperature", "top_k", "top_p", "min_p")
                if generation_config.get(name) is not None}
    if defaults.get("top_k") == 0:
        defaults["top_k"] = -1
    try:
        SamplingParams(**defaults)
    except ValueError as exc:
        raise ValueError(f"generation_config: generation_config.json's sampling defaults are invalid ({exc}); "
                         "generation_config='none' ignores them") from None
    return defaults


class LLMEngine:
    def __init__(self, model: str, **engine_args):
        self.config = Config(model, **engine_args)
        self.tokenizer = load_tokenizer(model)
        generation_config = read_generation_config(model)
        # SamplingParams(**sampling_defaults) serves requests that bring no SamplingParams.
        self.sampling_defaults = sampling_defaults(generation_config) if self.config.generation_config == "auto" else {}
        self.speculator = None
        if self.config.speculative is not None:
            self.model_runner, self.speculator = self._speculative_runners()
        else:
            self.model_runner = ModelRunner(self.config)
        self.eos_token_ids = eos_token_ids(self.config, generation_config, self.tokenizer)
        self.scheduler = Scheduler(self.config, self.eos_token_ids, self.model_runner.num_kvcache_blocks)
        self._request_ids = itertools.count()
        self._compiler: GrammarCompiler | None = None
        # Outputs of online requests recorded but not yet returned by step(), in order.
        self._undelivered: list[dict] = []
        # Steps launched on the device whose tokens are not recorded yet, oldest first: one stays
        # here between steps while the next is prepared. A step leaves only once recorded, so an
        # interrupt while waiting for its tokens loses nothing.
        self._in_flight: deque[tuple[ScheduledBatch, SampledTokens]] = deque()
        self._prefill_rate = self._decode_rate = 0.0  # tokens/s of the last step of each kind, for tqdm

    def _speculative_runners(self) -> tuple[ModelRunner, Speculator]:
        """The target's runner and the speculator; with a draft model, the draft's runner is
        built first, so that the target's cache is sized with the draft's weights loaded and
        shares its memory with the draft's cache (same block count)."""
        spec = self.config.speculative
        if spec.method != "draft_model":
            return ModelRunner(self.config), Speculator(spec)
        check_draft_tokenizer(self.tokenizer, load_tokenizer(spec.model))
        config = self.config
        # The smallest cache at first (one full-length sequence); graphs after it takes its size.
        draft_config = Config(spec.model, device=config.device, dtype=str(config.torch_dtype).removeprefix("torch."),
                              max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                              max_model_len=config.max_model_len, kvcache_block_size=config.kvcache_block_size,
                              num_kvcache_blocks=-(-config.max_model_len // config.kvcache_block_size),
                              enforce_eager=True, load_format=config.load_format)
        draft = ModelRunner(draft_config)
        try:
            target = ModelRunner(config, draft_block_bytes=draft.block_bytes())
        except BaseException:
            draft.close()
            raise
        draft.resize_kv_cache(target.num_kvcache_blocks, capture_graphs=not config.enforce_eager)
        return target, Speculator(spec, DraftProposer(draft))

    # --- requests --------------------------------------------------------------------------
    def _sampling_params(self, params: SamplingParams | None) -> SamplingParams:
        """The request's SamplingParams, checked against the vocabulary. A top_k of the whole
        vocabulary or more becomes -1: it keeps every token, and the sampler's tensors then
        hold no k beyond the vocabulary."""
        params = params if params is not None else SamplingParams(**self.sampling_defaults)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        vocab = self.config.hf_config.vocab_size
        if not all(t < vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids: token ids must be in [0, {vocab}), got {params.stop_token_ids}")
        if params.logit_bias and not all(t < vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias: token ids must be in [0, {vocab}), got {sorted(params.logit_bias)}")
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words: this model folder has no tokenizer")
        params = dataclasses.replace(params, top_k=-1 if params.top_k >= vocab else params.top_k)
        params.bad_words_token_ids = self._bad_words_token_ids(params.bad_words or [])
        if params.min_tokens:
            params.min_tokens_stop_ids = params.stop_token_ids + ([] if params.ignore_eos else self.eos_token_ids)
        return params

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word's tokens with and without a leading space (vLLM's rule), once each."""
        found = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in found:
                    found.append(ids)
        return found

    def _new_sequence(self, prompt, params: SamplingParams | None) -> Sequence:
        params = self._sampling_params(params)
        seq = Sequence(next(self._request_ids), prompt_token_ids(prompt, self.tokenizer, self.config), params)
        if params.structured_outputs is not None:
            seq.constraint = self._grammar_compiler().constraint(params.structured_outputs, seq.num_prompt_tokens)
        return seq

    def _grammar_compiler(self) -> GrammarCompiler:
        """Built on the first constrained request: reading the vocabulary takes a while."""
        if self.tokenizer is None:
            raise ValueError("structured_outputs: this model folder has no tokenizer to build a grammar's token masks")
        if self._compiler is None:
            self._compiler = GrammarCompiler(self.tokenizer, self.config.hf_config.vocab_size)
        return self._compiler

    def add_request(self, prompt, params: SamplingParams | None = None) -> int:
        """Queues one prompt (a string, a list of token ids or a 1-D integer array or tensor);
        returns its request id. Without `params`, the checkpoint's sampling defaults apply."""
        seq = self._new_sequence(prompt, params)
        self.scheduler.add(seq)
        return seq.request_id

    def abort(self, request_id: int) -> bool:
        """Drops a request and frees its cache blocks; False if it is not queued or running. A
        token of it still in flight on the device is dropped when it arrives."""
        return self.scheduler.abort(request_id) is not None

    def is_finished(self) -> bool:
        return self.scheduler.is_finished() and not self._undelivered and not self._in_flight

    # --- steps -------------------------------------------------------------------------------
    def step(self) -> list[dict]:
        """Queues the next step on the device, then records the one queued before it, so a loop
        of step() calls keeps the device busy as generate() does. Returns an output for every
        request that received a token in the recorded step, after those still undelivered from
        earlier steps (generate() runs online requests too, and leaves their outputs here)."""
        self._advance(set(), {})
        outputs, self._undelivered = self._undelivered, []  # after the step: kept if it raised
        return outputs

    def _advance(self, own: set, finished: dict) -> tuple[int, int]:
        """Launches the next step if one can run, then records every step launched before it:
        step N + 1 is queued before step N's tokens are read, so the device does not wait for
        the host between steps. Requests in `own` (a generate() call's) land in `finished` when
        they finish; every other request that receives a token gets an output in
        `_undelivered`, for step(). Returns the (prefill, decode) tokens of the step launched,
        (0, 0) when none was."""
        speculation = self._plan_speculation(own, finished) if self.speculator is not None else {}
        launched = None if self.scheduler.is_finished() else self._launch(**speculation)
        if launched is None and not self._in_flight and not self.scheduler.is_finished():
            raise RuntimeError("scheduler produced an empty step while requests are pending")
        while len(self._in_flight) > (launched is not None):
            self._collect_oldest(own, finished)
        return launched or (0, 0)

    def _plan_speculation(self, own: set, finished: dict) -> dict:
        """_launch's arguments for the next step's proposals. Proposals need the last tokens on
        the host, and a verifying step's tokens decide where the next step starts: both wait
        for the steps in flight."""
        num_speculative = self.speculator.plan(self.scheduler.running)
        if num_speculative or any(batch.num_speculative for batch, _ in self._in_flight):
            while self._in_flight:
                self._collect_oldest(own, finished)
        return {"num_speculative": num_speculative}

    def _launch(self, num_speculative: dict[int, int] | None = None) -> tuple[int, int] | None:
        """Schedules a batch and queues it on the device; returns its (prefill, decode) tokens,
        or None if nothing can run until the steps in flight are recorded."""
        batch = self.scheduler.schedule(num_speculative)
        if not batch:
            return None
        if batch.num_speculative:
            self.speculator.propose(batch)
        tokens = self._count_tokens(batch)  # before launched() moves the sequences on
        sampled = self.model_runner.launch(batch)
        self.scheduler.launched(batch)
        self._in_flight.append((batch, sampled))
        return tokens

    def _collect_oldest(self, own: set, finished: dict) -> None:
        """Waits for the oldest launched step's tokens and records them. Outputs of `own`
        requests are built only once they finish: copying every running request's tokens
        each step costs."""
        batch, sampled = self._in_flight[0]
        tokens = sampled.tolist()  # the wait: interrupted here, the step stays queued
        self._in_flight.popleft()
        logprobs = sampled.logprobs(tokens)
        if logprobs is not None:  # a row that verifies proposals asks for none
            logprobs = {seq.request_id: entry for seq, entry in zip(batch.draws(), logprobs) if entry is not None}
        received = self.scheduler.postprocess(batch, tokens)
        if batch.num_speculative:
            self.speculator.record(batch)
        for seq, position in received:
            if seq.logprobs is not None:  # a token is received once: preemption neither repeats nor drops it
                seq.logprobs.append(logprobs[seq.request_id])
            if seq.request_id not in own:
                self._undelivered.append(self._output(seq, position))
            elif seq.is_finished:
                finished[seq.request_id] = self._output(seq, position)

    @staticmethod
    def _count_tokens(batch: ScheduledBatch) -> tuple[int, int]:
        decode = sum(n for seq, n in zip(batch.seqs, batch.num_new_tokens)
                     if seq.num_computed_tokens + 1 == len(seq) > seq.num_prompt_tokens)
        return sum(batch.num_new_tokens) - decode, decode

    def _output(self, seq: Sequence, position: int) -> dict:
        """The request's state once its token at `position` is in; "logprobs" is that token's
        {token id: log-probability}, None when the request does not ask."""
        token_ids, finished = seq.token_ids[seq.num_prompt_tokens:position + 1], seq.is_finished
        return {"request_id": seq.request_id, "token_ids": token_ids, "new_token_id": seq.token_ids[position],
                "finished": finished, "finish_reason": seq.finish_reason,
                "text": self.decode(token_ids) if finished else "",
                "logprobs": None if seq.logprobs is None else seq.logprobs[position - seq.num_prompt_tokens]}

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[dict]:
        """Runs every prompt to completion; outputs in input order. `prompts`: one prompt or a
        list of them (see split_prompts). `sampling_params`: one SamplingParams for all, a list
        of one per prompt, or None for the checkpoint's defaults. All prompts are checked
        before any is queued, so a bad one leaves the engine untouched."""
        prompts, sampling_params = split_requests(prompts, sampling_params)
        seqs = [self._new_sequence(p, sp) for p, sp in zip(prompts, sampling_params)]
        for seq in seqs:
            self.scheduler.add(seq)
        outputs, own = {}, {seq.request_id for seq in seqs}
        try:
            self._run_until_done(outputs, own, use_tqdm)
        except BaseException:
            for request_id in own - outputs.keys():  # a failed call leaves nothing queued behind
                self.abort(request_id)
            raise
        return [{**{key: outputs[seq.request_id][key] for key in ("text", "token_ids", "finish_reason")},
                 "logprobs": seq.logprobs} for seq in seqs]

    def _run_until_done(self, outputs: dict, own: set, use_tqdm: bool) -> None:
        """Steps until every request in `own` has finished; online requests run alongside and
        their outputs wait for step()."""
        with tqdm(total=len(own), desc="Generating", disable=not use_tqdm, dynamic_ncols=True) as bar:
            try:
                while len(outputs) < len(own):
                    started = time.perf_counter()
                    launched = self._advance(own, outputs)
                    bar.update(len(outputs) - bar.n)
                    self._show_throughput(bar, launched, time.perf_counter() - started)
            finally:
                while self._in_flight:  # nothing launched is left unrecorded, even on an error
                    self._collect_oldest(own, outputs)

    def _show_throughput(self, bar, launched: tuple[int, int], seconds: float) -> None:
        """Each kind's rate: the tokens of the step a loop turn launched over the turn's time. A
        turn that launched nothing (the last, which only records) leaves the rates as they were."""
        prefill, decode = launched
        if prefill:
            self._prefill_rate = prefill / seconds
        if decode:
            self._decode_rate = decode / seconds
        bar.set_postfix_str(f"prefill {self._prefill_rate:.0f} tok/s, decode {self._decode_rate:.0f} tok/s",
                            refresh=False)

    def memory_stats(self) -> dict:
        manager = self.scheduler.block_manager
        total = len(manager.blocks)
        return {"kv_blocks_total": total, "kv_blocks_used": total - manager.num_free_blocks,
                "kv_blocks_free": manager.num_free_blocks, "prefix_cache_hit_blocks": manager.prefix_cache_hit_blocks,
                "kv_block_size": manager.block_size, "num_preemptions": self.scheduler.num_preemptions,
                **self.model_runner.memory_stats(), **(self.speculator.stats() if self.speculator else {})}


def check_draft_tokenizer(target, draft) -> None:
    """A draft proposes token ids: they must mean what they mean to the target."""
    if (target is None) != (draft is None) or target is not None and target.get_vocab() != draft.get_vocab():
        raise ValueError("speculative_config.model: the draft model's tokenizer differs from the target's")

