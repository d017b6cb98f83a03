"""benchmarks/bench_startup.py on the CPU: a cold and a warm run, each in a process of its own,
report the stages of LLM() they went through and write them to startup.json."""
import json
import os
import subprocess
import sys
from pathlib import Path

import benchmarks


def test_cold_and_warm_runs_report_their_stages(tmp_path):
    root = Path(benchmarks.__file__).parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_startup", "--device", "cpu", "--model-config",
                           "qwen3-tiny", "--prompt-tokens", "16", "--warm-runs", "1", "--out", str(tmp_path)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "startup.json").read_text())
    assert result["model"] == "qwen3-tiny" and result["device"] == "cpu"
    assert [run["cache"] for run in result["runs"]] == ["cold", "warm"]
    for run in result["runs"]:
        assert run["stages_s"].keys() == {"model", "kv_cache"}  # no graphs and no sampler warm-up on the CPU
        assert {"imports_s", "llm_ready_s", "first_token_s", "first_request_s"} <= run.keys()
        assert not run["cuda_graphs"]
