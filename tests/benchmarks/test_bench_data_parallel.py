"""benchmarks/bench_data_parallel.py on the CPU: both balancing rules run the same workload over
two replicas, each replica's share is reported, and together the shares are the workload."""
import json
import os
import subprocess
import sys
from pathlib import Path

import benchmarks


def test_both_rules_run_the_whole_workload_over_both_replicas():
    root = Path(benchmarks.__file__).parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_data_parallel", "--num-seqs", "6", "--repeats", "1"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["num_seqs"] == 6 and result["data_parallel_size"] == 2
    shares = {rule: result[rule]["replicas"] for rule in ("tokens", "requests")}
    assert [share["requests"] for share in shares["requests"]] == [3, 3]
    for replicas in shares.values():
        assert len(replicas) == 2 and sum(share["requests"] for share in replicas) == 6
        assert all(share["seconds"] > 0 for share in replicas)
    totals = {(sum(s["prompt_tokens"] for s in replicas), sum(s["max_tokens"] for s in replicas))
              for replicas in shares.values()}
    assert len(totals) == 1  # the same workload under both rules
