"""The engine runs in a process of its own, stepping back to back; the HTTP server talks to it
over a socket pair. A separate process rather than a thread: the server's Python work (HTTP,
JSON, detokenization) would otherwise contend with the engine's host work for the GIL, and
every torch call that releases the GIL could wait a full switch interval to get it back,
stalling the GPU.

Server -> engine: ("add", request_id, prompt_ids, params), ("abort", [request_ids]), ("shutdown",).
Engine -> server: ("ready", info) or ("failed", error) once, then after every step (or batch
of adds and aborts) ("step", outputs, logprobs, accepted, rejected, stats), and ("fatal", error)
if a step raises. Outputs are (request_id, token_id, finish_reason or None) tuples: new requests
and aborts are applied between steps, and each step's tokens travel in one message. `logprobs`
holds (request_id, {token id: log-probability}) for the outputs of requests that asked, in
output order, and is empty otherwise."""
import asyncio
import atexit
import itertools
import logging
import multiprocessing
import pickle
import queue
import signal
import socket
import struct
import threading
import time
import traceback
import weakref

from nanovllm.config import Config
from nanovllm.engine.data_parallel import least_loaded, replica_environments, request_load
from nanovllm.engine.worker import child_environment

_HEADER = struct.Struct("<Q")
REAP_TIMEOUT = 10.0  # seconds an engine process that closed its socket gets to exit before it is killed
logger = logging.getLogger("uvicorn.error")  # uvicorn's log: it configures and prints it


def _frame(message) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload)) + payload


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# --- the engine process ------------------------------------------------------------------------
def engine_main(model: str, engine_args: dict, sock: socket.socket, engine_class=None) -> None:
    """Entry point of the engine process. Signals go to the server process, which shuts the
    engine down in order (Ctrl-C reaches the whole process group); a closed socket means the
    server is gone, and the engine exits."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    inbox = queue.SimpleQueue()
    threading.Thread(target=_receive, args=(sock, inbox), daemon=True, name="engine-inbox").start()
    try:
        if engine_class is None:
            from nanovllm import LLM as engine_class
        engine = engine_class(model, **engine_args)
        info = {"max_model_len": engine.config.max_model_len, "vocab_size": engine.config.hf_config.vocab_size,
                "sampling_defaults": dict(engine.sampling_defaults),
                "eos_token_ids": sorted(engine.scheduler.eos_token_ids),
                "architecture": engine.config.hf_config.architecture}
    except Exception as exc:
        sock.sendall(_frame(("failed", _describe(exc))))
        raise SystemExit(1) from None
    sock.sendall(_frame(("ready", info)))
    try:
        EngineLoop(engine, sock).run(inbox)
    except ConnectionError:  # the server is gone: nobody to tell
        pass
    except Exception as exc:
        traceback.print_exc()
        sock.sendall(_frame(("fatal", _describe(exc))))
        raise SystemExit(1) from None
    finally:
        engine.close()  # a tensor-parallel engine's ranks stop with it


def _receive(sock: socket.socket, inbox: queue.SimpleQueue) -> None:
    """Moves messages from the socket to the inbox, so the server never waits on a busy engine."""
    stream = sock.makefile("rb")
    while len(header := stream.read(_HEADER.size)) == _HEADER.size:
        inbox.put(pickle.loads(stream.read(_HEADER.unpack(header)[0])))
    inbox.put(("shutdown",))


class EngineLoop:
    def __init__(self, engine, sock: socket.socket):
        self.engine, self.sock = engine, sock
        self.request_ids: dict[int, int] = {}  # engine request id -> server request id
        self.engine_ids: dict[int, int] = {}  # server request id -> engine request id

    def run(self, inbox: queue.SimpleQueue) -> None:
        while True:
            messages = [] if not self.engine.is_finished() else [inbox.get()]
            while not inbox.empty():
                messages.append(inbox.get())
            accepted, rejected = [], []
            for message in messages:
                if message[0] == "shutdown":
                    return
                self._apply(message, accepted, rejected)
            outputs, logprobs = ([], []) if self.engine.is_finished() else self._step()
            self.sock.sendall(_frame(("step", outputs, logprobs, accepted, rejected, self._stats())))

    def _apply(self, message: tuple, accepted: list, rejected: list) -> None:
        if message[0] == "add":
            _, request_id, prompt_ids, params = message
            try:
                engine_id = self.engine.add_request(prompt_ids, params)
            except ValueError as exc:
                rejected.append((request_id, str(exc)))
                return
            self.request_ids[engine_id], self.engine_ids[request_id] = request_id, engine_id
            accepted.append(request_id)
        else:  # abort
            for request_id in message[1]:
                engine_id = self.engine_ids.pop(request_id, None)
                if engine_id is not None:
                    del self.request_ids[engine_id]
                    self.engine.abort(engine_id)

    def _step(self) -> tuple[list[tuple[int, int, str | None]], list[tuple[int, dict]]]:
        outputs, logprobs = [], []
        for out in self.engine.step():
            request_id = self.request_ids.get(out["request_id"])
            if request_id is None:  # aborted since its step was launched
                continue
            if out["finished"]:
                del self.request_ids[out["request_id"]], self.engine_ids[request_id]
            outputs.append((request_id, out["new_token_id"], out["finish_reason"] if out["finished"] else None))
            if out["logprobs"] is not None:
                logprobs.append((request_id, out["logprobs"]))
        return outputs, logprobs

    def _stats(self) -> dict:
        scheduler = self.engine.scheduler
        return {"num_running": len(scheduler.running), "num_waiting": len(scheduler.waiting),
                **self.engine.memory_stats()}


# --- the server side ---------------------------------------------------------------------------
class EngineDeadError(RuntimeError):
    pass


class RequestState:
    """One engine request as the server sees it. `event` is shared by the requests of one HTTP
    request (its choices), so a handler wakes once for whatever arrived for any of them.
    `replica`: the engine that runs it, under a DataParallelEngine (request ids are per engine),
    and `load` its request_load there."""
    __slots__ = ("request_id", "event", "replica", "load", "new_token_ids", "new_logprobs", "num_tokens", "accepted",
                 "finish_reason", "error", "arrival", "first_token_time", "last_token_time")

    def __init__(self, request_id: int, event: asyncio.Event):
        self.request_id, self.event, self.replica, self.load = request_id, event, 0, 0
        self.new_token_ids: list[int] = []
        self.new_logprobs: list[dict[int, float]] = []  # one a new token, when the request asked
        self.num_tokens = 0
        self.accepted = False
        self.finish_reason: str | None = None
        self.error: Exception | None = None
        self.arrival = time.perf_counter()
        self.first_token_time = self.last_token_time = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def take(self) -> tuple[list[int], list[dict[int, float]]]:
        """The new token ids and their log-probabilities (empty when the request did not ask)."""
        token_ids, logprobs = self.new_token_ids, self.new_logprobs
        self.new_token_ids = []
        if logprobs:
            self.new_logprobs = []
        return token_ids, logprobs


class AsyncEngine:
    """The server's handle on the engine process. Lives on the server's event loop: add() and
    abort() only queue a message; one supervisor task reads the process's messages, routes each
    step's tokens to the requests' states, and once the process is gone (it raised, crashed or
    was killed) reaps it and starts a new one, up to `max_restarts` times. `metrics`
    (metrics.ServerMetrics) is told of every token. `env` is added to the environment the
    engine process starts with (a replica's CUDA_VISIBLE_DEVICES)."""

    def __init__(self, model: str, engine_args: dict, metrics, engine_class=None, env: dict | None = None,
                 max_restarts: int = 0):
        self.model, self.engine_args, self.engine_class, self.env = model, engine_args, engine_class, env or {}
        self.metrics, self.max_restarts = metrics, max_restarts
        self.info: dict | None = None  # set by each load, kept while a restart loads
        self.error: str | None = None  # why the engine is not running
        self.stats: dict = {}
        self.requests: dict[int, RequestState] = {}
        self.num_waiting = 0  # requests without a first token yet
        self.process = None
        self.restarts = 0
        self.on_ready = None  # called each time the engine is loaded (again)
        self.on_fatal = None  # called with the reason once the engine is gone for good
        self._ids = itertools.count()
        self._reader = self._writer = self._supervisor = None
        self._stopping = False

    @property
    def ready(self) -> bool:
        return self.info is not None and self.error is None

    @property
    def processes(self) -> list:
        return [self.process]

    async def start(self) -> None:
        await self._spawn()
        atexit.register(self._kill)  # runs before multiprocessing's exit hook, which would wait for it
        self._supervisor = asyncio.create_task(self._supervise())

    async def _spawn(self) -> None:
        ours, theirs = socket.socketpair()
        # Not a daemon: a tensor-parallel engine starts processes of its own.
        self.process = multiprocessing.get_context("spawn").Process(
            target=engine_main, args=(self.model, self.engine_args, theirs, self.engine_class), name="nanovllm-engine")
        with child_environment(self.env):
            self.process.start()
        theirs.close()
        self._reader, self._writer = await asyncio.open_connection(sock=ours)
        logger.info("engine process %d is loading %s", self.process.pid, self.model)

    async def _supervise(self) -> None:
        """Runs the engine process until the server stops it or it is gone for good: an engine
        that failed its first load is not restarted (its settings are wrong); one that died later
        is, while restarts are left. The process is always reaped. `info` stays that of the last
        load meanwhile: a restart loads the same model with the same settings."""
        try:
            while True:
                reported = await self._read(self._reader)
                self._writer.close()
                await asyncio.get_running_loop().run_in_executor(None, self._reap)
                if self._stopping:
                    return
                reason = reported or f"the engine process exited (exit code {self.process.exitcode})"
                if self.info is None or self.restarts >= self.max_restarts:
                    self.give_up(reason if self.info is None else
                                 f"{reason}; no restarts left (--max-engine-restarts {self.max_restarts})")
                    return
                self.restarts += 1
                self.fail(f"{reason}; restarting it ({self.restarts} of {self.max_restarts})")
                logger.warning("%s", self.error)
                await self._spawn()
        except Exception as exc:  # a server that can no longer run an engine must not answer 503 forever
            logger.exception("the engine's supervisor failed")
            self.give_up(f"the engine's supervisor failed: {_describe(exc)}")

    def _reap(self) -> None:
        self.process.join(REAP_TIMEOUT)
        self._kill()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the engine process: in order if it answers within `timeout`, else killed."""
        if self._supervisor is None:
            return
        self._stopping = True
        self.fail("the server is shutting down")
        if not self._writer.is_closing():
            self._send(("shutdown",))
        done, _ = await asyncio.wait({self._supervisor}, timeout=timeout)
        if not done:  # a killed process closes its socket: the supervisor reaps it
            self.process.kill()
            await self._supervisor
        atexit.unregister(self._kill)

    def _kill(self) -> None:
        """Ends the engine process if it still runs (a server that exits without shutdown())."""
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

    def add(self, prompt_ids: list[int], params, event: asyncio.Event) -> RequestState:
        if self.error is not None:
            raise EngineDeadError(self.error)
        state = RequestState(next(self._ids), event)
        self.requests[state.request_id] = state
        self.num_waiting += 1
        self._send(("add", state.request_id, prompt_ids, params))
        return state

    def abort(self, states: list[RequestState]) -> None:
        """Stops the states' requests that have not finished; their cache blocks are freed
        before the engine's next step."""
        aborted = [s.request_id for s in states if self._forget(s.request_id)]
        if aborted and self.error is None:
            self._send(("abort", aborted))

    def _send(self, message) -> None:
        self._writer.write(_frame(message))

    def _forget(self, request_id: int) -> RequestState | None:
        state = self.requests.pop(request_id, None)
        if state is not None and state.first_token_time is None:
            self.num_waiting -= 1
        return state

    async def _read(self, reader: asyncio.StreamReader) -> str | None:
        """Handles the engine process's messages until its socket closes; returns the error it
        reported, if any."""
        reported = None
        try:
            while True:
                size = _HEADER.unpack(await reader.readexactly(_HEADER.size))[0]
                message = pickle.loads(await reader.readexactly(size))
                if message[0] == "step":
                    self._on_step(*message[1:])
                elif message[0] == "ready":
                    self.info, self.error = message[1], None
                    if self.on_ready is not None:
                        self.on_ready()
                else:  # failed or fatal: the requests in flight learn at once
                    reported = f"the engine {'failed to start' if message[0] == 'failed' else 'failed'}: {message[1]}"
                    self.fail(reported)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        return reported

    def _on_step(self, outputs, logprobs, accepted, rejected, stats) -> None:
        now = time.perf_counter()
        for request_id, entry in logprobs:  # first: a finished request's state is dropped with its token
            if (state := self.requests.get(request_id)) is not None:
                state.new_logprobs.append(entry)
        for request_id in accepted:
            if (state := self.requests.get(request_id)) is not None:
                state.accepted = True
                state.event.set()
        for request_id, message in rejected:
            if (state := self._forget(request_id)) is not None:
                state.error = ValueError(message)
                state.event.set()
        for request_id, token_id, finish_reason in outputs:
            state = self.requests.get(request_id)
            if state is None:
                continue
            if state.first_token_time is None:
                state.first_token_time = now
                self.num_waiting -= 1
                self.metrics.first_token(now - state.arrival)
            else:
                self.metrics.inter_token(now - state.last_token_time)
            state.last_token_time = now
            state.new_token_ids.append(token_id)
            state.num_tokens += 1
            if finish_reason is not None:
                state.finish_reason = finish_reason
                del self.requests[request_id]
            state.event.set()
        self.metrics.generation_tokens(len(outputs))
        self.stats = stats

    def fail(self, message: str) -> None:
        """Marks the engine not running: every request in flight gets EngineDeadError, new ones
        are refused until it is loaded again; `message` says why."""
        self.error = message
        for state in self.requests.values():
            state.error = EngineDeadError(message)
            state.event.set()
        self.requests.clear()
        self.num_waiting = 0

    def give_up(self, message: str) -> None:
        """The engine is gone for good: fails what is in flight and tells on_fatal, once."""
        self.fail(message)
        on_fatal, self.on_fatal = self.on_fatal, None
        if on_fatal is not None:
            on_fatal(message)


class DataParallelEngine:
    """M AsyncEngines (replicas, each possibly tensor-parallel) behind AsyncEngine's interface.
    An HTTP request's engine requests (its prompts and choices, which share its event) all go
    to one replica, so its choices share one prefix cache: the least loaded by the requests it
    has in flight (data_parallel.least_loaded, the rule LLM's replicas share).
    While a replica is down (`error` set: /health answers 503, new requests are refused) its
    requests get its error and the others' run to their end; each replica restarts on its own,
    and once one is gone for good, so is the server."""

    def __init__(self, model: str, engine_args: dict, metrics, engine_class=None, max_restarts: int = 0):
        self.model, self.engine_args = model, engine_args
        self.replicas = [AsyncEngine(model, {**engine_args, "data_parallel_size": 1}, metrics, engine_class,
                                     max_restarts=max_restarts) for _ in range(engine_args["data_parallel_size"])]
        for replica in self.replicas:
            replica.on_ready, replica.on_fatal = self._replica_ready, self.give_up
        self.on_ready = self.on_fatal = None
        self._replica_of = weakref.WeakKeyDictionary()  # an HTTP request's event -> its replica

    @property
    def ready(self) -> bool:
        return all(replica.ready for replica in self.replicas)

    @property
    def error(self) -> str | None:
        return next((replica.error for replica in self.replicas if replica.error is not None), None)

    @property
    def info(self) -> dict | None:
        """Replica 0's, once every replica has loaded (they load the same model and settings)."""
        return self.replicas[0].info if all(replica.info is not None for replica in self.replicas) else None

    @property
    def stats(self) -> dict:
        """Each count summed over the replicas (so KV-cache usage is that of all their blocks)."""
        keys = dict.fromkeys(key for replica in self.replicas for key in replica.stats)
        block_size = {"kv_block_size": self.replicas[0].stats["kv_block_size"]} if "kv_block_size" in keys else {}
        return {**{key: sum(r.stats.get(key, 0) for r in self.replicas) for key in keys}, **block_size}

    @property
    def num_waiting(self) -> int:
        return sum(replica.num_waiting for replica in self.replicas)

    @property
    def processes(self) -> list:
        return [replica.process for replica in self.replicas]

    async def start(self) -> None:
        """Checks the settings once for all replicas (N x M GPUs), then starts them, replica i on
        its slice of the GPUs."""
        try:
            config = Config(self.model, **self.engine_args)
        except ValueError as exc:
            self.give_up(f"the engine failed to start: {_describe(exc)}")
            return
        for replica, env in zip(self.replicas, replica_environments(config) or [{}] * len(self.replicas)):
            replica.env = env
            await replica.start()

    async def shutdown(self, timeout: float = 10.0) -> None:
        await asyncio.gather(*(replica.shutdown(timeout) for replica in self.replicas))

    def add(self, prompt_ids: list[int], params, event: asyncio.Event) -> RequestState:
        if (error := self.error) is not None:
            raise EngineDeadError(error)
        index = self._replica_of.get(event)
        if index is None:
            loads = [sum(state.load for state in replica.requests.values()) for replica in self.replicas]
            index = self._replica_of[event] = least_loaded(loads)
        state = self.replicas[index].add(prompt_ids, params, event)
        state.replica, state.load = index, request_load(len(prompt_ids), params)
        return state

    def abort(self, states: list[RequestState]) -> None:
        for index, replica in enumerate(self.replicas):
            if mine := [state for state in states if state.replica == index]:
                replica.abort(mine)

    def fail(self, message: str) -> None:
        for replica in self.replicas:
            replica.fail(message)

    def give_up(self, message: str) -> None:
        self.fail(message)
        on_fatal, self.on_fatal = self.on_fatal, None
        if on_fatal is not None:
            on_fatal(message)

    def _replica_ready(self) -> None:
        if self.ready and self.on_ready is not None:
            self.on_ready()
