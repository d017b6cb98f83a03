"""The parent's side of child processes (nanovllm.engine.worker.Workers): an answer that
arrives while the parent only watches for failures is kept, and each child starts with the
environment asked for it."""
import os
import time

from nanovllm.engine.worker import Workers, start_child


def answer_at_once(conn) -> None:
    start_child()
    conn.send(("ok", "ready"))
    conn.recv()  # ("close",)


def test_answer_read_while_watching_is_kept_for_replies():
    workers = Workers.spawn(answer_at_once, [()], ["child"])
    try:
        deadline = time.monotonic() + 60
        while not workers._early[0] and time.monotonic() < deadline:  # as rank 0 does, waiting for its device
            workers.check(timeout=0.1)
        assert workers.wait_all() == ["ready"]
    finally:
        workers.stop()
        workers.join()


def test_each_child_starts_with_its_environment():
    envs = [{"NANOVLLM_TEST_VALUE": "0,1"}, {"NANOVLLM_TEST_VALUE": "2,3"}]
    workers = Workers.spawn(answer_at_once, [(), ()], ["first", "second"], envs=envs)
    try:
        assert workers.wait_all() == ["ready", "ready"]
        # The environment a process was started with: set before any import of the child's.
        # Read once both answered: until a child's exec, /proc shows the parent's initial one.
        initial = [open(f"/proc/{p.pid}/environ", "rb").read().split(b"\0") for p in workers.processes]
        assert [b"NANOVLLM_TEST_VALUE=0,1" in e for e in initial] == [True, False]
        assert [b"NANOVLLM_TEST_VALUE=2,3" in e for e in initial] == [False, True]
        assert "NANOVLLM_TEST_VALUE" not in os.environ
    finally:
        workers.stop()
        workers.join()
