"""The `nanovllm` command: `nanovllm serve MODEL_DIR` runs the OpenAI-compatible server,
`nanovllm bench` runs bench.py's throughput workload."""
import argparse
import dataclasses
import json
import os
import types

from nanovllm.config import Config
from nanovllm.entrypoints import DEFAULT_MAX_ENGINE_RESTARTS, DEFAULT_MAX_REQUEST_BYTES
from nanovllm.entrypoints.reasoning import REASONING_PARSERS
from nanovllm.entrypoints.tool_parsers import PARSERS


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per engine setting of Config (--max-model-len, --enforce-eager, ...), so the
    flags follow the engine's settings and their defaults."""
    group = parser.add_argument_group("engine", "settings of the engine (see nanovllm.LLM)")
    for field in dataclasses.fields(Config):
        if not field.init or field.name == "model":
            continue
        flag = "--" + field.name.replace("_", "-")
        if field.type is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default)
        elif field.name == "speculative_config":
            group.add_argument(flag, type=json_object, default=None,
                               help='a JSON object, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
        else:
            # An optional setting (str | None) takes its flag's value as the non-None type.
            kind = field.type.__args__[0] if isinstance(field.type, types.UnionType) else field.type
            group.add_argument(flag, type=kind, default=field.default, help=f"(default: {field.default})")


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def engine_args(args: argparse.Namespace) -> dict:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(Config) if f.init and f.name != "model"}


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="checkpoint folder (config.json, safetensors, tokenizer) or .gguf file")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default: loopback only; 0.0.0.0 exposes the server)")
    parser.add_argument("--port", type=int, default=8000, help="port (0: any free port, printed at start)")
    parser.add_argument("--served-model-name", help="the model's name in the API (default: MODEL)")
    parser.add_argument("--api-key", default=os.environ.get("NANOVLLM_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on every path but /health and /metrics "
                             "(default: $NANOVLLM_API_KEY)")
    parser.add_argument("--max-queue", type=int,
                        help="answer 429 while this many requests wait for their first token")
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                        help=f"answer 413 to a request body larger than this (default: {DEFAULT_MAX_REQUEST_BYTES})")
    parser.add_argument("--max-engine-restarts", type=int, default=DEFAULT_MAX_ENGINE_RESTARTS,
                        help="times a dead engine process is restarted before the server exits with code 1 "
                             f"(default: {DEFAULT_MAX_ENGINE_RESTARTS})")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests get to finish on SIGTERM/Ctrl-C (default: 30)")
    parser.add_argument("--enable-docs", action="store_true", help="serve /docs, /redoc and /openapi.json")
    parser.add_argument("--reasoning-parser", choices=[*REASONING_PARSERS, "none"],
                        help="split <think> reasoning into reasoning_content (default: qwen3 for Qwen3 checkpoints)")
    parser.add_argument("--tool-call-parser", choices=list(PARSERS),
                        help="the tool-call format of the model's output (default: by the checkpoint's family)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_engine_args(parser)


def run_serve(args: argparse.Namespace) -> int:
    from nanovllm.entrypoints.api_server import serve
    if args.max_queue is not None and args.max_queue < 0:
        raise SystemExit("nanovllm serve: --max-queue must be >= 0")
    if args.max_request_bytes < 1 or args.max_engine_restarts < 0:
        raise SystemExit("nanovllm serve: --max-request-bytes must be >= 1 and --max-engine-restarts >= 0")
    if args.data_parallel_size < 1:
        raise SystemExit("nanovllm serve: --data-parallel-size must be >= 1")
    return serve(args.model, engine_args(args), host=args.host, port=args.port,
                 served_model_name=args.served_model_name, api_key=args.api_key, max_queue=args.max_queue,
                 shutdown_timeout=args.shutdown_timeout, log_level=args.log_level,
                 max_request_bytes=args.max_request_bytes, max_engine_restarts=args.max_engine_restarts,
                 enable_docs=args.enable_docs, reasoning_parser=args.reasoning_parser,
                 tool_call_parser=args.tool_call_parser)


def run_bench(rest: list[str]) -> int:
    from nanovllm.entrypoints import bench
    bench.main(rest)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nanovllm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    add_serve_args(commands.add_parser("serve", help="run the OpenAI-compatible HTTP server"))
    commands.add_parser("bench", add_help=False, help="run bench.py's throughput workload (its flags follow)")
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        return run_bench(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return run_serve(args)


if __name__ == "__main__":
    raise SystemExit(main())
