"""The two grammar engines installed, xgrammar and llguidance, on the same JSON schemas with a
real tokenizer (SmolLM2-135M's, 49,152 tokens, from tests/smollm2.py's cached checkpoint, or
--tokenizer DIR). CPU only.

    python -m benchmarks.bench_structured_output [--tokenizer DIR] [--repeat 3]
    python -m benchmarks.bench_structured_output --write-model DIR

Per engine: compile time of each schema, cold (no cache; the tokenizer's preprocessing is done
once, before), as p50 / p99 over the schemas; and the time of one next-token bitmask fill over
a generation driven by the tokens of a valid instance of each schema (the matcher accepts each
token, then fills the mask for the next), as mean / p99 over every token of every schema. Both
engines run with whitespace between JSON tokens bounded, as the engine runs them. Prints one
JSON object.

--write-model DIR: a dummy-weight model folder for bench_serving --json-schema: Qwen3-0.6B's
config (nanovllm/configs/qwen3-0.6b) with SmolLM2's tokenizer (its ids fit Qwen3's vocabulary;
the grammar never allows the others), and DIR/bench_schemas.json holding the schemas above."""
import argparse
import json
import os
import shutil
import statistics
import sys
import time

import numpy as np

from nanovllm.engine.structured_outputs import MAX_JSON_WHITESPACE as MAX_WHITESPACE

_ADDRESS = {"type": "object", "properties": {
    "street": {"type": "string"}, "city": {"type": "string"},
    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "country": {"enum": ["US", "CA", "MX"]}},
    "required": ["street", "city", "zip", "country"], "additionalProperties": False}

# (name, schema, a valid instance): the instances are long enough for ~100-200 tokens each.
SCHEMAS = [
    ("object", {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                 "active": {"type": "boolean"}, "score": {"type": "number"}},
                "required": ["name", "age", "active", "score"]},
     {"name": "Ada Lovelace, Countess of Lovelace, mathematician and writer", "age": 36, "active": True,
      "score": 98.25}),
    ("array", {"type": "array", "items": {"type": "integer"}, "minItems": 1},
     list(range(100, 160))),
    ("enum", {"type": "object", "properties": {"colors": {"type": "array", "items": {
        "enum": ["red", "green", "blue", "cyan", "magenta", "yellow", "black"]}}}, "required": ["colors"]},
     {"colors": ["red", "green", "blue", "cyan", "magenta", "yellow", "black"] * 5}),
    ("nested", {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer"}, "address": _ADDRESS,
        "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["id", "address", "tags"]}},
        "required": ["user"]},
     {"user": {"id": 42, "address": {"street": "1600 Amphitheatre Parkway", "city": "Mountain View",
                                     "zip": "94043", "country": "US"},
               "tags": ["admin", "beta-tester", "early-adopter", "editor", "maintainer"]}}),
    ("anyOf", {"type": "object", "properties": {"items": {"type": "array", "items": {"anyOf": [
        {"type": "object", "properties": {"kind": {"const": "text"}, "text": {"type": "string"}},
         "required": ["kind", "text"]},
        {"type": "object", "properties": {"kind": {"const": "number"}, "value": {"type": "number"}},
         "required": ["kind", "value"]}]}}}, "required": ["items"]},
     {"items": [{"kind": "text", "text": "hello world"}, {"kind": "number", "value": 3.5},
                {"kind": "text", "text": "structured output"}, {"kind": "number", "value": -12}] * 3}),
    ("formats", {"type": "object", "properties": {
        "created": {"type": "string", "format": "date-time"}, "email": {"type": "string", "format": "email"},
        "day": {"type": "string", "format": "date"}, "id": {"type": "string", "format": "uuid"}},
        "required": ["created", "email", "day", "id"]},
     {"created": "2026-11-28T02:30:00Z", "email": "ada.lovelace@example.com", "day": "2026-11-28",
      "id": "123e4567-e89b-12d3-a456-426614174000"}),
    ("integer_ranges", {"type": "object", "properties": {
        "port": {"type": "integer", "minimum": 1, "maximum": 65535},
        "percent": {"type": "integer", "minimum": 0, "maximum": 100},
        "temperature": {"type": "integer", "minimum": -40, "maximum": 50}},
        "required": ["port", "percent", "temperature"]},
     {"port": 8080, "percent": 75, "temperature": -12}),
    ("api_weather", {"type": "object", "properties": {
        "location": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
        "forecast": {"type": "array", "items": {"type": "object", "properties": {
            "date": {"type": "string", "format": "date"}, "high": {"type": "number"}, "low": {"type": "number"},
            "conditions": {"type": "string"}}, "required": ["date", "high", "low", "conditions"]}}},
        "required": ["location", "unit", "forecast"]},
     {"location": "San Francisco, CA", "unit": "celsius", "forecast": [
         {"date": f"2026-12-0{d}", "high": 17.5, "low": 9, "conditions": "partly cloudy"} for d in range(1, 6)]}),
    ("api_order", {"type": "object", "properties": {
        "order_id": {"type": "string"}, "customer": {"type": "object", "properties": {
            "name": {"type": "string"}, "email": {"type": "string", "format": "email"}},
            "required": ["name", "email"]},
        "items": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1},
            "price": {"type": "number", "minimum": 0}}, "required": ["sku", "quantity", "price"]}},
        "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
        "shipping": _ADDRESS, "notes": {"type": ["string", "null"]}},
        "required": ["order_id", "customer", "items", "status", "shipping"], "additionalProperties": False},
     {"order_id": "ORD-2026-000123", "customer": {"name": "Grace Hopper", "email": "grace@example.org"},
      "items": [{"sku": f"SKU-{i:04d}", "quantity": i, "price": 9.99 * i} for i in range(1, 5)],
      "status": "shipped", "shipping": {"street": "1 Navy Way", "city": "Arlington", "zip": "22202", "country": "US"},
      "notes": None}),
    ("api_tool_call", {"type": "object", "properties": {
        "name": {"enum": ["search", "get_weather", "send_email"]},
        "arguments": {"type": "object", "properties": {
            "query": {"type": "string"}, "max_results": {"type": "integer", "minimum": 1, "maximum": 50},
            "filters": {"type": "array", "items": {"type": "string"}}}, "required": ["query"]}},
        "required": ["name", "arguments"]},
     {"name": "search", "arguments": {"query": "structured output with grammar engines in LLM inference",
                                      "max_results": 10, "filters": ["recent", "english", "peer-reviewed"]}}),
    ("api_event", {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 80}, "start": {"type": "string", "format": "date-time"},
        "end": {"type": "string", "format": "date-time"},
        "attendees": {"type": "array", "items": {"type": "object", "properties": {
            "email": {"type": "string", "format": "email"}, "optional": {"type": "boolean"}},
            "required": ["email"]}, "maxItems": 10},
        "recurrence": {"anyOf": [{"type": "null"}, {"enum": ["daily", "weekly", "monthly"]}]}},
        "required": ["title", "start", "end", "attendees", "recurrence"]},
     {"title": "Design review", "start": "2026-12-01T15:00:00Z", "end": "2026-12-01T16:00:00Z",
      "attendees": [{"email": f"person{i}@example.com", "optional": i % 2 == 0} for i in range(6)],
      "recurrence": "weekly"}),
]



def smollm2_tokenizer_dir() -> str:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    import smollm2
    return str(smollm2.checkpoint())


def percentile(values, q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer):
        import xgrammar
        self.xgr = xgrammar
        self.info = xgrammar.TokenizerInfo.from_huggingface(tokenizer)
        self.vocab = self.info.vocab_size

    def compile(self, schema):
        compiler = self.xgr.GrammarCompiler(self.info, cache_enabled=False, max_threads=1)
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=True,
                                            max_whitespace_cnt=MAX_WHITESPACE)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, bitmask):
        matcher.fill_next_token_bitmask(bitmask, 0)

    def accept(self, matcher, token) -> bool:
        return matcher.accept_token(token)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer):
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer)
        self.vocab = self.tokenizer.vocab_size

    def compile(self, schema):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False, "whitespace_pattern": rf"[ \n\t]{{0,{MAX_WHITESPACE}}}"})
        matcher = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matcher(self, compiled):
        return compiled

    def fill(self, matcher, bitmask):
        self.llg.torch.fill_next_token_bitmask(matcher, bitmask, 0)

    def accept(self, matcher, token) -> bool:
        return matcher.consume_token(token)


def measure(engine, tokenizer, repeat: int) -> dict:
    import torch
    compile_ms, fill_us, tokens_driven = [], [], 0
    for name, schema, instance in SCHEMAS:
        text = json.dumps(instance, separators=(",", ":"))
        tokens = tokenizer.encode(text, add_special_tokens=False)
        times = []
        for _ in range(repeat):
            started = time.perf_counter()
            compiled = engine.compile(schema)
            times.append((time.perf_counter() - started) * 1e3)
        compile_ms.append(min(times))  # the least disturbed of the cold compiles
        bitmask = torch.zeros(1, (engine.vocab + 31) // 32, dtype=torch.int32)
        matcher = engine.matcher(compiled)
        for token in tokens:
            started = time.perf_counter()
            engine.fill(matcher, bitmask)
            fill_us.append((time.perf_counter() - started) * 1e6)
            if not (bitmask[0, token // 32] >> (token % 32)) & 1 or not engine.accept(matcher, token):
                raise RuntimeError(f"{engine.name}: {name}'s instance token {token} was refused")
        tokens_driven += len(tokens)
    return {"compile_ms_p50": statistics.median(compile_ms), "compile_ms_p99": percentile(compile_ms, 99),
            "fill_us_mean": statistics.fmean(fill_us), "fill_us_p99": percentile(fill_us, 99),
            "tokens": tokens_driven}


def write_model(out: str) -> None:
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    shutil.copytree(os.path.join(package, "nanovllm", "configs", "qwen3-0.6b"), out, dirs_exist_ok=True)
    from transformers import AutoTokenizer
    AutoTokenizer.from_pretrained(smollm2_tokenizer_dir()).save_pretrained(out)
    with open(os.path.join(out, "bench_schemas.json"), "w") as f:
        json.dump([schema for _, schema, _ in SCHEMAS], f, indent=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", help="a checkpoint folder with a tokenizer (default: SmolLM2-135M)")
    parser.add_argument("--repeat", type=int, default=3, help="cold compiles of each schema; the least is kept")
    parser.add_argument("--write-model", metavar="DIR", help="write the model folder for bench_serving and stop")
    args = parser.parse_args()
    if args.write_model:
        return write_model(args.write_model)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or smollm2_tokenizer_dir())
    results = {"tokenizer_vocab": len(tokenizer), "schemas": [name for name, _, _ in SCHEMAS],
               "max_whitespace": MAX_WHITESPACE, "cpu_count": os.cpu_count()}
    for engine_class in (XGrammar, LLGuidance):
        engine = engine_class(tokenizer)
        results[engine.name] = measure(engine, tokenizer, args.repeat)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
