"""Data parallelism: M independent engines (replicas), each in a process of its own and each
possibly tensor-parallel, so M x N GPUs. Both front ends share what is decided here: where a
replica runs (`replica_environments`) and where a request goes (`least_loaded`, weighing each
by `request_load`). LLM's is DataParallelLLM: the user's process only dispatches; generate()
gives each prompt to a replica, waits for every replica's share and returns the outputs in
input order. The server's is entrypoints/engine_loop.py's DataParallelEngine, which streams
and restarts replicas. A replica in its own process keeps the engine code untouched and its
Python work (scheduling, preparing steps) off the other replicas' GIL."""
import atexit
import os
import weakref

import torch
from tqdm.auto import tqdm

from nanovllm.config import Config
from nanovllm.engine.llm_engine import LLMEngine, load_tokenizer
from nanovllm.engine.prompts import split_requests
from nanovllm.engine.worker import Workers, report_failure, serve, start_child
from nanovllm.sampling_params import SamplingParams


class DataParallelLLM:
    """What LLM(model, data_parallel_size=M, ...) returns: generate(), close(), `with`."""

    def __init__(self, model: str, **engine_args):
        self.config = Config(model, **engine_args)  # every check before a process starts
        self.tokenizer = load_tokenizer(model)
        replicas = self.config.data_parallel_size
        envs = replica_environments(self.config)
        args = [(model, {**engine_args, "data_parallel_size": 1}, torch.get_num_threads())] * replicas
        # Not daemons: a replica starts its own tensor-parallel ranks.
        self.replicas = Workers.spawn(replica, args, [f"data-parallel replica {i}" for i in range(replicas)],
                                      daemon=False, envs=envs)
        self._close = weakref.finalize(self, _close, self.replicas)
        atexit.register(self._close)  # after multiprocessing's exit hook, which would wait for the replicas
        try:
            self.replicas.wait_all()
        except BaseException:
            self.close()
            raise

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[dict]:
        """LLMEngine.generate() over the replicas. Each replica checks its share before running
        it; a ValueError it raises comes out once the other replicas have run theirs."""
        prompts, sampling_params = split_requests(prompts, sampling_params)
        # Arrays and tensors travel as lists: multiprocessing would move a tensor through shared memory.
        prompts = [p if isinstance(p, (str, list, tuple)) else p.tolist() for p in prompts]
        shares = self._shares(prompts, sampling_params)
        for replica, indices in shares.items():
            share = [prompts[i] for i in indices], [sampling_params[i] for i in indices]
            self.replicas.send(("generate", *share, False), to=replica)
        outputs = [None] * len(prompts)
        with tqdm(total=len(prompts), desc="Generating", disable=not use_tqdm, dynamic_ncols=True) as bar:
            for replica, share in self.replicas.replies(shares):
                for index, output in zip(shares[replica], share):
                    outputs[index] = output
                bar.update(len(share))
        return outputs

    def _shares(self, prompts, sampling_params) -> dict[int, list[int]]:
        """Prompt indices per replica, by `least_loaded`: the whole batch is in flight at once."""
        loads, shares = [0] * self.config.data_parallel_size, {}
        for index, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            replica = least_loaded(loads)
            shares.setdefault(replica, []).append(index)
            loads[replica] += request_load(self._num_tokens(prompt), params)
        return shares

    def _num_tokens(self, prompt) -> int:
        if isinstance(prompt, str):
            return len(self.tokenizer.encode(prompt)) if self.tokenizer is not None else 0
        return len(prompt)

    def close(self) -> None:
        """Closes every replica (and its tensor-parallel ranks); later calls raise."""
        self._close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def request_load(num_prompt_tokens: int, params) -> int:
    """A request's share of a replica's load: the tokens it may bring, its prompt and max_tokens
    (stops may end it sooner). Counting requests instead balances worse: docs/distributed.md."""
    return num_prompt_tokens + getattr(params or SamplingParams(), "max_tokens", 0)


def least_loaded(loads: list[int]) -> int:
    """The replica a new request goes to, given each one's summed request_load in flight: the
    least loaded, the first of equals. The rule of both data-parallel front ends, LLM's
    DataParallelLLM and the server's DataParallelEngine."""
    return loads.index(min(loads))


def replica_environments(config: Config) -> list[dict] | None:
    """What each replica's process adds to its environment: on CUDA, replica i sees GPUs
    i*N .. i*N+N-1 (N = tensor_parallel_size) as its cuda:0..N-1; elsewhere nothing (None)."""
    if config.torch_device.type != "cuda":
        return None
    ranks = config.tensor_parallel_size
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(torch.cuda.device_count()))))
    visible = visible.split(",")
    return [{"CUDA_VISIBLE_DEVICES": ",".join(visible[i * ranks:(i + 1) * ranks])}
            for i in range(config.data_parallel_size)]


def _close(replicas: Workers) -> None:
    replicas.stop()
    replicas.join(timeout=30.0)


def replica(conn, model: str, engine_args: dict, num_threads: int) -> None:
    """A replica's process: its engine on the GPUs of the CUDA_VISIBLE_DEVICES it started with,
    serving generate() calls until closed."""
    torch.set_num_threads(num_threads)
    start_child()
    try:
        engine = LLMEngine(model, **engine_args)
        conn.send(("ok", "ready"))
        serve(engine, conn, replies=True)
        engine.model_runner.close()
    except BaseException:
        report_failure(conn)
        os._exit(1)
