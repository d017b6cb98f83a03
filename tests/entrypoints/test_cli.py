"""The `nanovllm` command: its help, and `python -m nanovllm.serve` as a process: it says when it
is ready, finishes the request in flight on SIGTERM, ends the streams still running at
--shutdown-timeout with an error event and [DONE], exits 0 and leaves no engine process behind;
an engine that fails to load ends it with exit code 1, one that dies is restarted until
--max-engine-restarts runs out, which ends it with exit code 1; a --data-parallel-size below 1
is refused."""
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from servers import ENGINE_ARGS, TIMEOUT, wait_until

ROOT = Path(__file__).resolve().parents[2]


def engine_flags() -> list[str]:
    flags = []
    for name, value in ENGINE_ARGS.items():
        flag = "--" + name.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return flags


class ServeProcess:
    """`python -m nanovllm.serve MODEL --port 0 ...` with its output read line by line."""

    def __init__(self, model, *flags):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self.process = subprocess.Popen([sys.executable, "-m", "nanovllm.serve", str(model), "--port", "0",
                                         *engine_flags(), *flags], env=env, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line)

    def wait_for(self, pattern: str) -> re.Match:
        while True:
            try:
                line = self.lines.get(timeout=TIMEOUT)
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r} in:\n{''.join(self.output)}") from None
            self.output.append(line)
            if match := re.search(pattern, line):
                return match

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(TIMEOUT)


def test_help_lists_the_subcommands():
    out = subprocess.run([sys.executable, "-m", "nanovllm", "--help"], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=TIMEOUT)
    assert out.returncode == 0 and "serve" in out.stdout and "bench" in out.stdout
    out = subprocess.run([sys.executable, "-m", "nanovllm", "serve", "--help"], capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=TIMEOUT)
    for flag in ("--api-key", "--max-queue", "--max-model-len", "--enforce-eager", "--load-format", "--host"):
        assert flag in out.stdout


def test_sigterm_finishes_the_request_in_flight_and_exits_0(chat_checkpoint):
    server = ServeProcess(chat_checkpoint, "--shutdown-timeout", "60")
    try:
        url = server.wait_for(r"on (http://127\.0\.0\.1:\d+)").group(1)
        engine_pid = int(server.wait_for(r"engine process (\d+)").group(1))
        wait_until(lambda: httpx.get(f"{url}/health").status_code == 200, what="the server to be ready")
        body = {"prompt": [3, 4, 5], "max_tokens": 60, "ignore_eos": True, "stream": True, "return_token_ids": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            server.process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]
        assert server.process.wait(TIMEOUT) == 0
        try:
            os.kill(engine_pid, 0)
            raise AssertionError("the engine process outlived the server")
        except ProcessLookupError:
            pass
    finally:
        server.stop()


def test_sigterm_past_the_shutdown_timeout_ends_streams_with_an_error_then_done(chat_checkpoint):
    """A stream of 8,000 tokens outlives a shutdown timeout of 1 s."""
    server = ServeProcess(chat_checkpoint, "--shutdown-timeout", "1", "--max-model-len", "8192",
                          "--num-kvcache-blocks", "520")
    try:
        url = server.wait_for(r"ready on (http://127\.0\.0\.1:\d+)").group(1)
        body = {"prompt": [3, 4, 5], "max_tokens": 8000, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            server.process.send_signal(signal.SIGTERM)
            try:
                for line in lines:
                    events += [line] if line.startswith("data: ") else []
            except httpx.RemoteProtocolError:  # the stream was cut
                pass
        assert events[-1] == "data: [DONE]", events[-3:]
        assert json.loads(events[-2].removeprefix("data: "))["error"]["message"] == "the server is shutting down"
        assert server.process.wait(TIMEOUT) == 0
    finally:
        server.stop()


def test_a_dead_engine_is_restarted_until_the_restarts_run_out(chat_checkpoint):
    server = ServeProcess(chat_checkpoint, "--max-engine-restarts", "1")
    try:
        for restart in range(2):
            engine_pid = int(server.wait_for(r"engine process (\d+) is loading").group(1))
            url = server.wait_for(r"nanovllm serve: ready on (http://127\.0\.0\.1:\d+)").group(1)
            assert httpx.get(f"{url}/health").status_code == 200
            response = httpx.post(f"{url}/v1/completions", json={"prompt": [3, 4], "max_tokens": 2}, timeout=TIMEOUT)
            assert response.status_code == 200
            os.kill(engine_pid, signal.SIGKILL)
            if restart == 0:  # the log says why; the dead process is reaped before the next starts
                server.wait_for(r"the engine process exited \(exit code -9\); restarting it \(1 of 1\)")
                wait_until(lambda: not os.path.exists(f"/proc/{engine_pid}"), what="the dead engine to be reaped")
        assert server.process.wait(TIMEOUT) == 1
        server.wait_for(r"exit code -9\); no restarts left \(--max-engine-restarts 1\); shutting down")
    finally:
        server.stop()


def test_an_engine_that_fails_to_load_ends_the_server(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    server = ServeProcess(tmp_path)
    try:
        assert server.process.wait(TIMEOUT) == 1
        server.wait_for(r"failed to start: ValueError: model: architecture 'GPT2LMHeadModel' is not supported")
    finally:
        server.stop()


def test_data_parallel_size_below_1_names_the_flag(chat_checkpoint):
    from nanovllm.entrypoints.cli import main
    with pytest.raises(SystemExit, match="--data-parallel-size must be >= 1"):
        main(["serve", str(chat_checkpoint), "--data-parallel-size", "0"])
