"""The same script on every rank under torchrun (2 CPU processes): rank 0's LLM() is the engine,
rank 1's serves it and exits; tokens equal one process's."""
import json
import subprocess
import sys

from parallel_testing import ENGINE, TIMEOUT_S
from nanovllm import LLM, SamplingParams

PROMPTS = [[5, 17, 3, 99, 42] * 4, [200, 201, 7]]
PARAMS = dict(temperature=0.0, max_tokens=8, ignore_eos=True)

SCRIPT = """
import json, sys, torch
from nanovllm import LLM, SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, **json.loads(sys.argv[2]))
outputs = llm.generate(json.loads(sys.argv[3]), SamplingParams(**json.loads(sys.argv[4])), use_tqdm=False)
print("tokens:", json.dumps([o["token_ids"] for o in outputs]), flush=True)
llm.close()
"""


def test_torchrun_ranks(checkpoint, tmp_path):
    script = tmp_path / "generate.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), str(checkpoint), json.dumps(ENGINE), json.dumps(PROMPTS), json.dumps(PARAMS)],
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("tokens:")]
    assert len(lines) == 1  # rank 1's LLM() never returned
    expected = LLM(str(checkpoint), **ENGINE).generate(PROMPTS, SamplingParams(**PARAMS), use_tqdm=False)
    assert json.loads(lines[0].removeprefix("tokens:")) == [o["token_ids"] for o in expected]
