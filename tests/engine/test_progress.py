"""generate()'s progress bar: the rates it shows count each launched step's tokens once."""
import re
from types import SimpleNamespace

from nanovllm.engine import llm_engine

PROMPTS = [[5, 17, 3, 99, 42, 7], [200, 201, 33, 61, 9, 120]]


def test_rates_come_from_the_steps_each_loop_turn_launched(llm, greedy, monkeypatch, capsys):
    """A clock that moves one second a launch, as on a CPU, where the forward runs inside it:
    every turn that launches a step lasts one second and shows that step's tokens a second. The
    last turn only records the last step; it must not count that step's tokens again."""
    clock = SimpleNamespace(now=0.0)
    launch = llm.model_runner.launch

    def timed_launch(batch):
        clock.now += 1.0
        return launch(batch)

    monkeypatch.setattr(llm.model_runner, "launch", timed_launch)
    monkeypatch.setattr(llm_engine, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    llm.generate(PROMPTS, greedy(4), use_tqdm=True)
    shown = re.findall(r"prefill (\d+) tok/s, decode (\d+) tok/s", capsys.readouterr().err)
    assert shown[-1] == ("12", "2")  # both prompts in one step; then one token of each a step
