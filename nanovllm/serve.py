"""`python -m nanovllm.serve MODEL_DIR [flags]`: the same as `nanovllm serve MODEL_DIR [flags]`."""
import sys

from nanovllm.entrypoints.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["serve", *sys.argv[1:]]))
