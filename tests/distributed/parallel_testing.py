"""Helpers of the tensor- and data-parallel tests: CPU processes joined by gloo, one torch
thread each (the CI machine has 2 cores), and checks that no process outlives its test."""
import os
import signal
import threading
import time
from pathlib import Path

ENGINE = dict(device="cpu", dtype="float32", enforce_eager=True, max_model_len=256, kvcache_block_size=16,
              num_kvcache_blocks=64)
# A hang fails the test instead of the suite; far above what any call here takes.
TIMEOUT_S = 120


def child_pids() -> set[int]:
    """Live (not zombie) processes whose parent is this one, but multiprocessing's resource
    tracker, which the first spawned process starts for the rest of the parent's life."""
    pids = set()
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            command = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:  # not a process, or gone
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == os.getpid() and state != "Z" and b"resource_tracker" not in command:
            pids.add(int(entry))
    return pids


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def call_with_timeout(fn, *args, timeout: float = TIMEOUT_S, **kwargs):
    """fn(*args, **kwargs) in a thread: its result, or the exception it raised, returned; a
    call still running after `timeout` seconds fails the test."""
    box = {}

    def target():
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["result"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        for pid in child_pids():  # children print their stacks to the test's stderr (worker.start_child)
            os.kill(pid, signal.SIGUSR1)
        time.sleep(1.0)
    assert not thread.is_alive(), f"{getattr(fn, '__name__', fn)} did not return within {timeout} s"
    return box["result"]


def engine(**engine_args):
    """LLM(**engine_args), whose start, if it hangs, fails the test with every rank's stack printed."""
    from nanovllm import LLM
    result = call_with_timeout(LLM, **engine_args)
    if isinstance(result, BaseException):
        raise result
    return result
