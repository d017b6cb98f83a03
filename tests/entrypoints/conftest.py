"""Fixtures for the server tests: a tiny checkpoint whose tokenizer has a chat template, and the
server most tests share (servers.py)."""
import json
from pathlib import Path

import pytest

from checkpoints import build_checkpoint, copy_checkpoint
from servers import CHAT_TEMPLATE, ENGINE_ARGS, TOOLS_CHAT_TEMPLATE, RunningServer, TIMEOUT


def edit_json(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}, indent=2))


@pytest.fixture(scope="session")
def chat_checkpoint(tmp_path_factory) -> Path:
    """The tiny Qwen3 checkpoint with a chat template. Its generation_config.json asks for
    greedy sampling, so a request that leaves temperature out is greedy only if the server
    takes the checkpoint's defaults."""
    path = build_checkpoint(tmp_path_factory.mktemp("chat_checkpoint"))
    edit_json(path / "tokenizer_config.json", chat_template=CHAT_TEMPLATE)
    edit_json(path / "generation_config.json", temperature=0.0)
    return path


@pytest.fixture(scope="session")
def plain_checkpoint(chat_checkpoint, tmp_path_factory) -> Path:
    """The same checkpoint without a chat template."""
    path = copy_checkpoint(chat_checkpoint, tmp_path_factory.mktemp("plain_checkpoint"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def server(chat_checkpoint):
    """The server a module's tests share: the chat checkpoint served as "tiny". One per module,
    not per session: a session's server would still run during tests elsewhere that count
    their child processes."""
    running = RunningServer(chat_checkpoint).start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="session")
def llm(chat_checkpoint):
    """An in-process engine on the same checkpoint, for the outputs the server must match."""
    from nanovllm import LLM
    return LLM(str(chat_checkpoint), **ENGINE_ARGS)


@pytest.fixture(scope="session")
def tools_checkpoint(chat_checkpoint, tmp_path_factory) -> Path:
    """The chat checkpoint (Qwen3, so hermes tool calls and qwen3 reasoning by default) with a
    Qwen-style template that renders tools, calls, tool results and thinking."""
    path = copy_checkpoint(chat_checkpoint, tmp_path_factory.mktemp("tools_checkpoint"))
    edit_json(path / "tokenizer_config.json", chat_template=TOOLS_CHAT_TEMPLATE)
    return path
