"""`python bench.py`: the engine's throughput benchmark, nanovllm.entrypoints.bench (also
`nanovllm bench`); `python bench.py --help` lists the workload flags."""
from nanovllm.entrypoints.bench import main

if __name__ == "__main__":
    main()
