"""Ways to run the engine from outside Python: the `nanovllm` command and its OpenAI-compatible
HTTP server (needs the `serve` extra: pip install -e '.[serve]')."""

# The server's limits, here so that the command's flags show them without importing the server.
# A 128k-token prompt is about 0.5 MB of text, 1 MB as token ids, 1.5 MB as \u-escaped CJK.
DEFAULT_MAX_REQUEST_BYTES = 4 << 20
DEFAULT_MAX_ENGINE_RESTARTS = 3
