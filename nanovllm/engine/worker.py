"""Processes beside the user's: the other ranks of a tensor-parallel engine (ranks 1..N-1, each
owning a ModelRunner shard) and data-parallel replicas. The parent holds a Connection to each
child (a pipe when it spawned the child, an authenticated socket to a rank torchrun started)
and sends it `(method, *args)` messages, which the child runs in order. A connection delivers
whole messages in order, so a step is never overwritten before a rank has read it. A child
answers ("ok", payload) when it is ready or has a result, ("invalid", ValueError) for a bad
request, or ("error", traceback) before it exits; it exits by itself when the parent is gone."""
import collections
import contextlib
import faulthandler
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import secrets
import signal
import threading
import time
import traceback
from multiprocessing.reduction import ForkingPickler

import torch

from nanovllm import distributed
from nanovllm.config import Config


class WorkerError(RuntimeError):
    """A rank or replica in another process failed or exited; the message holds its traceback."""


class Workers:
    """The parent's side of its children: a Connection each, and the processes it spawned. Once
    a child fails or exits, every later call raises that failure."""

    def __init__(self, conns: list, processes: list, names: list[str]):
        self.conns, self.processes, self.names = conns, processes, names
        self.failure: Exception | None = None
        # Answers check() read while watching for failures, kept for replies() (a rank that
        # finishes building while rank 0 still waits for the device answers early).
        self._early: list[collections.deque] = [collections.deque() for _ in conns]

    @classmethod
    def spawn(cls, target, args_per_child: list[tuple], names: list[str], daemon: bool = True,
              envs: list[dict] | None = None) -> "Workers":
        """Starts target(conn, *args) in a fresh interpreter for each args (the spawn method:
        CUDA cannot be used in a forked child), with each child's `envs` entry added to the
        environment it starts with."""
        context = mp.get_context("spawn")
        conns, processes = [], []
        for args, name, env in zip(args_per_child, names, envs or [{}] * len(names)):
            parent_end, child_end = context.Pipe()
            process = context.Process(target=target, args=(child_end, *args), name=f"nanovllm {name}", daemon=daemon)
            with child_environment(env):
                process.start()
            child_end.close()  # then only the child holds its end: the child's exit reads as EOF here
            conns.append(parent_end)
            processes.append(process)
        return cls(conns, processes, names)

    # --- parent to children ---------------------------------------------------------------
    def send(self, message: tuple, to: int | None = None) -> None:
        """Queues `message` for one child, or for all of them (pickled once)."""
        self.check()
        payload = ForkingPickler.dumps(message)
        try:
            for conn in self.conns if to is None else [self.conns[to]]:
                conn.send_bytes(payload)
        except OSError:
            self.check(timeout=5.0)  # a child that exited: raise its failure rather than a broken pipe
            raise

    def stop(self) -> None:
        """Asks every child to finish (join() waits for them)."""
        for conn in self.conns:
            try:
                conn.send(("close",))
            except OSError:
                pass
        self.failure = self.failure or WorkerError("the engine is closed")

    def join(self, timeout: float = 10.0) -> None:
        """Waits up to `timeout` seconds for the children to exit, then kills those left."""
        deadline = time.monotonic() + timeout
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        for conn in self.conns:
            conn.close()

    # --- children to parent ---------------------------------------------------------------
    def replies(self, indices):
        """Yields (index, payload) as each child in `indices` answers. A child's failure is
        raised at once; a ValueError it reports, once the others have answered."""
        pending, invalid = set(indices), None
        while pending:
            ready = [i for i in pending if self._early[i]] or [
                self.conns.index(conn) for conn in mpc.wait([self.conns[i] for i in pending])]
            for index in ready:
                pending.discard(index)
                try:
                    payload = self._early[index].popleft() if self._early[index] else self._receive(index)
                except ValueError as exc:
                    invalid = invalid or exc
                    continue
                yield index, payload
        if invalid is not None:
            raise invalid

    def wait_all(self) -> list:
        """Every child's next answer, in child order."""
        answers = dict(self.replies(range(len(self.conns))))
        return [answers[i] for i in range(len(self.conns))]

    def check(self, timeout: float = 0.0) -> None:
        """Raises the failure of a child that reported one or exited, waiting up to `timeout`
        seconds for it. An answer read meanwhile waits for replies()."""
        if self.failure is not None:
            raise self.failure
        for conn in mpc.wait(self.conns, timeout):
            index = self.conns.index(conn)
            self._early[index].append(self._receive(index))

    def wait_event(self, event: torch.cuda.Event) -> None:
        """Waits for a CUDA event, watching the children meanwhile: the collectives of a step
        whose other rank is gone never finish, and a plain synchronize would wait forever."""
        while not event.query():
            self.check(timeout=1e-4)

    def fail_after(self, exc: BaseException) -> None:
        """After `exc` broke off work here, the ranks are out of step: raises the failure of a
        child that caused it (a collective fails when a rank exits), else marks the group
        failed and returns for the caller to raise `exc`."""
        if isinstance(exc, Exception):
            self.check(timeout=5.0)
        self.failure = self.failure or WorkerError(f"rank 0 failed ({exc!r}); the ranks are out of step")

    def _receive(self, index: int):
        try:
            kind, payload = self.conns[index].recv()
        except (EOFError, OSError):
            raise self._fail(f"{self.names[index]} exited{self._exit_code(index)}") from None
        if kind == "error":
            raise self._fail(f"{self.names[index]} failed:\n{payload}")
        if kind == "invalid":
            raise payload
        return payload

    def _fail(self, message: str) -> Exception:
        self.failure = self.failure or WorkerError(message)
        return self.failure

    def _exit_code(self, index: int) -> str:
        if not self.processes:
            return ""
        self.processes[index].join(timeout=5.0)
        return f" with code {self.processes[index].exitcode}"


def wait_for(workers: Workers | None, event: torch.cuda.Event) -> None:
    """event.synchronize(), watching the other ranks meanwhile: the collectives of a step
    whose rank is gone never end."""
    if workers:
        workers.wait_event(event)
    event.synchronize()


def synchronize(workers: Workers | None) -> None:
    """Waits for the device; rank 0 of several raises meanwhile if another rank fails."""
    if workers:
        event = torch.cuda.Event()
        event.record()
        wait_for(workers, event)
    torch.cuda.synchronize()


@contextlib.contextmanager
def child_environment(env: dict):
    """os.environ with `env` added, for a child to start with. A variable read when a module is
    imported (CUDA_VISIBLE_DEVICES: the first CUDA call fixes the devices a process sees, and
    importing the kernels makes one) must be set before the child unpickles its target."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


# --- the child's side ---------------------------------------------------------------------
def start_child() -> None:
    """What every child does first: it exits with its parent, and `kill -USR1 PID` prints its
    threads' stacks to stderr (where a rank waits when a group hangs)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    exit_with_parent()


def exit_with_parent() -> None:
    """Ends this process within a second of its parent's death, even while it waits inside a
    collective for a rank that is gone."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="nanovllm-parent-watch", daemon=True).start()


def serve(obj, conn, replies: bool) -> None:
    """Runs the methods the parent sends on `obj`, in order, until it sends "close"; with
    `replies`, answers each with its result. Exits the process if the parent is gone."""
    while True:
        try:
            method, *args = conn.recv()
        except EOFError:
            os._exit(0)
        if method == "close":
            return
        try:
            result = getattr(obj, method)(*args)
        except ValueError as exc:
            if not replies:
                raise
            conn.send(("invalid", exc))
            continue
        if replies:
            conn.send(("ok", result))


def report_failure(conn) -> None:
    """Sends the exception being handled to the parent; the caller exits next."""
    try:
        conn.send(("error", traceback.format_exc()))
    except OSError:
        pass  # the parent is gone


# --- tensor-parallel ranks ------------------------------------------------------------------
def start_ranks(runner_cls, config: Config) -> Workers:
    """Rank 0's start of a tensor-parallel engine: ranks 1..N-1 (spawned here, each building a
    `runner_cls`, or started by torchrun) and the group of all of them, which it joins."""
    size = config.tensor_parallel_size
    names = [f"tensor-parallel rank {rank}" for rank in range(1, size)]
    torchrun = distributed.torchrun_env()
    if torchrun:
        return _connect_torchrun_ranks(config, torchrun[2], names)
    store = distributed.local_store(size)
    args = [(runner_cls, config, rank, store.port, torch.get_num_threads()) for rank in range(1, size)]
    workers = Workers.spawn(tensor_parallel_rank, args, names)
    try:
        workers.wait_all()  # all started: a child that dies now is seen here, not as a hung rendezvous
        distributed.init(0, size, distributed.rank_device(config.torch_device, 0), store)
    except BaseException:
        workers.stop()
        workers.join()
        raise
    return workers


def shutdown_ranks(workers: Workers, graphs) -> None:
    """Rank 0's end of a tensor-parallel engine. `graphs`: its CUDA graphs (a CUDAGraphs),
    captured with the group's communicators."""
    failed = workers.failure is not None
    workers.stop()
    if failed:  # the lost rank's collectives never finish: abort them before anything waits for them
        distributed.destroy(abort=True)
        graphs.clear()
    else:  # NCCL communicators go after the graphs captured with them
        graphs.clear()
        distributed.destroy()
    workers.join()


def tensor_parallel_rank(conn, runner_cls, config: Config, rank: int, store_port: int, num_threads: int) -> None:
    """A spawned rank: joins rank 0's group, builds its shard, then runs the steps rank 0 sends."""
    torch.set_num_threads(num_threads)
    start_child()
    conn.send(("ok", "started"))
    device = distributed.rank_device(config.torch_device, rank)
    run_rank(conn, runner_cls, config, rank, lambda: distributed.init(
        rank, config.tensor_parallel_size, device, distributed.local_store(config.tensor_parallel_size, store_port)))


def run_rank(conn, runner_cls, config: Config, rank: int, join_group) -> None:
    try:
        join_group()
        runner = runner_cls(config, rank)
        conn.send(("ok", "ready"))
        serve(runner, conn, replies=False)
        runner.close()
    except BaseException:
        report_failure(conn)
        os._exit(1)


def _connect_torchrun_ranks(config: Config, local_rank: int, names: list[str]) -> Workers:
    """torchrun started every rank: rank 0 joins the group through its environment, then opens
    a socket for the others' connections (a random key, sent over the group, authenticates them)."""
    distributed.init(0, config.tensor_parallel_size, distributed.rank_device(config.torch_device, local_rank))
    authkey = secrets.token_bytes(32)
    with mpc.Listener(("", 0), authkey=authkey) as listener:
        distributed.broadcast_object((os.environ["MASTER_ADDR"], listener.address[1], authkey))
        conns = [listener.accept() for _ in names]
    ranks = [conn.recv() for conn in conns]
    return Workers([conn for _, conn in sorted(zip(ranks, conns), key=lambda pair: pair[0])], [], names)


def serve_torchrun_rank(runner_cls, config: Config) -> None:
    """Ranks 1..N-1 under torchrun: join the group through its environment, connect to rank 0
    and serve it until it closes."""
    rank, _, local_rank = distributed.torchrun_env()
    distributed.init(rank, config.tensor_parallel_size, distributed.rank_device(config.torch_device, local_rank))
    host, port, authkey = distributed.broadcast_object(None)
    conn = mpc.Client((host, port), authkey=authkey)
    conn.send(rank)
    run_rank(conn, runner_cls, config, rank, join_group=lambda: None)
