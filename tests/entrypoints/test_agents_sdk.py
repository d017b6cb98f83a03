"""The OpenAI Agents SDK against the server, on both of its model kinds (Responses and chat
completions): an agent whose first turn must call its function tool (tool_choice "required"),
runs it, and answers from the result on the next turn (the SDK resets tool_choice to auto). The
SDK takes an unfinished answer as an error: stop strings that the forced call (whose argument is
an enum) cannot hold end the random model's answer."""
from typing import Literal

import pytest

from servers import MODEL_NAME, TIMEOUT, RunningServer

agents = pytest.importorskip("agents")
STOP = ["b", "d", "k", "p", "y", "v", "."]


@pytest.fixture(scope="module")
def server(tools_checkpoint):
    running = RunningServer(tools_checkpoint, dict(max_model_len=1024, num_kvcache_blocks=512)).start()
    yield running
    running.stop()


@pytest.mark.parametrize("model_class", ["OpenAIResponsesModel", "OpenAIChatCompletionsModel"])
def test_agent_tool_round_trip(server, model_class):
    from openai import AsyncOpenAI
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def weather(unit: Literal["celsius", "fahrenheit"]) -> str:
        """Today's temperature in Paris."""
        calls.append(unit)
        return f"21 degrees {unit}"

    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
    model = getattr(agents, model_class)(model=MODEL_NAME, openai_client=client)
    agent = agents.Agent(name="forecaster", instructions="Answer with the tool's result.", tools=[weather],
                         model=model, model_settings=agents.ModelSettings(tool_choice="required", extra_body={"stop": STOP}))
    result = agents.Runner.run_sync(agent, "How warm is it in Paris?", max_turns=3)
    assert len(calls) == 1 and calls[0] in ("celsius", "fahrenheit")
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item", kinds
    assert isinstance(result.final_output, str) and result.final_output
