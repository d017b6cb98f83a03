"""Real uvicorn servers on 127.0.0.1 with a port the OS picks, each in a thread of the test
process (its engine in a process of its own), and the settings the server tests share."""
import os
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from nanovllm import LLM

# Role markers as plain text: the tiny tokenizer has no special tokens for them.
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
# Qwen's layout with tools: their JSON in the system turn, calls as <tool_call> JSON (arguments
# rendered with tojson: the server must turn the history's JSON text into dicts), tool results
# in a user turn. Thinking is closed in the prompt unless enable_thinking opens it.
TOOLS_CHAT_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}
{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call one as <tool_call>{"name": NAME, "arguments": ARGS}</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}<|im_start|>assistant
{{ m.content }}
{%- for call in m.tool_calls or [] %}
<tool_call>{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% elif m.role != 'system' or not loop.first %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking %}<think>
{% else %}<think>

</think>

{% endif %}{% endif %}"""
ENGINE_ARGS = dict(device="cpu", dtype="float32", enforce_eager=True, max_model_len=256, kvcache_block_size=16,
                   num_kvcache_blocks=128)
MODEL_NAME = "tiny"
# Engine processes inherit this: the tiny model steps in about a millisecond on one thread, and
# several threads on a busy machine can each wait for a core at every step.
os.environ["OMP_NUM_THREADS"] = "1"
# Bounds every wait on a server, so a hang fails the test instead of stalling the suite.
TIMEOUT = 120.0


def wait_until(predicate, timeout: float = TIMEOUT, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not (result := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)
    return result


class RunningServer:
    """build_app(...) served by uvicorn in a background thread until stop()."""

    def __init__(self, checkpoint: Path, engine_args: dict | None = None, **app_args):
        from nanovllm.entrypoints.api_server import bind_socket, build_app
        self.app = build_app(str(checkpoint), {**ENGINE_ARGS, **(engine_args or {})},
                             served_model_name=MODEL_NAME, **app_args)
        self.sock = bind_socket("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def engine(self):
        return self.app.state.server.engine

    def start(self, wait_ready: bool = True) -> "RunningServer":
        self.thread.start()
        wait_until(lambda: self.server.started, what="uvicorn to start")
        if wait_ready:
            wait_until(lambda: self.app.state.server.ready or self.engine.error, what="the engine to load")
            assert self.engine.error is None, self.engine.error
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(TIMEOUT)
        assert not self.thread.is_alive(), "the server did not stop"
        assert not any(p.is_alive() for p in self.engine.processes), "an engine process outlived the server"

    def metrics(self) -> dict[str, float]:
        """The server's Prometheus samples by name; request_success by name{finished_reason}."""
        from prometheus_client.parser import text_string_to_metric_families
        samples = {}
        for family in text_string_to_metric_families(httpx.get(f"{self.url}/metrics").text):
            for sample in family.samples:
                reason = sample.labels.get("finished_reason")
                samples[sample.name + (f"{{{reason}}}" if reason else "")] = sample.value
        return samples





class FailingEngine(LLM):
    """The first step after a request whose prompt starts with TRIGGER raises, as a device
    error would. Module-level, so the engine process can import it."""
    TRIGGER = 7
    armed = False

    def add_request(self, prompt, params=None):
        self.armed |= prompt[0] == self.TRIGGER
        return super().add_request(prompt, params)

    def step(self):
        if self.armed:
            raise RuntimeError("injected step failure")
        return super().step()
