"""Ways to run the engine from outside Python: the `nanovllm` command and its OpenAI-compatible
HTTP server (needs the `serve` extra: pip install -e '.[serve]')."""
