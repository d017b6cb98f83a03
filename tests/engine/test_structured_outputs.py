"""SamplingParams.structured_outputs through the engine: a random model's outputs follow each
kind of constraint (JSON schema features, JSON object, regex, choice, grammar), compile errors
are refused before anything is queued, compiled grammars are cached, matchers follow their
sequences through preemption, and reasoning_end holds the constraint back until its text."""
import json
import re

import jsonschema
import pytest
import torch

from nanovllm import SamplingParams, StructuredOutputsParams

# A random model picks among the allowed tokens about uniformly: strings, arrays and objects
# are bounded (maxLength, maxItems, additionalProperties false) so that every output completes
# well within max_tokens.
SCHEMAS = {
    "object": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}, "active": {"type": "boolean"},
        "score": {"type": "number"}}, "required": ["name", "age", "active", "score"], "additionalProperties": False},
    "array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 1,
              "maxItems": 5},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                              "size": {"enum": ["S", "M", 3, None]}},
             "required": ["color", "size"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer"}, "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 6}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["id", "address"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "anyOf": {"type": "object", "properties": {"value": {"anyOf": [
        {"type": "integer"}, {"type": "string", "maxLength": 5},
        {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"], "additionalProperties": False}]}},
        "required": ["value"], "additionalProperties": False},
    "formats": {"type": "object", "properties": {
        "when": {"type": "string", "format": "date-time"}, "ip": {"type": "string", "format": "ipv4"},
        "id": {"type": "string", "format": "uuid"}}, "required": ["when", "ip", "id"], "additionalProperties": False},
    "integer_ranges": {"type": "object", "properties": {
        "port": {"type": "integer", "minimum": 1, "maximum": 65535},
        "percent": {"type": "integer", "minimum": 0, "maximum": 100},
        "delta": {"type": "integer", "exclusiveMinimum": -10, "exclusiveMaximum": 10}},
        "required": ["port", "percent", "delta"], "additionalProperties": False},
}
ENGINE = dict(max_model_len=512, num_kvcache_blocks=4000, max_num_seqs=256)
pytestmark = pytest.mark.usefixtures("one_torch_thread")
MAX_TOKENS = 300
RFC3339_DATE_TIME = re.compile(r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])T([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)"
                               r"(\.\d+)?(Z|[+-]([01]\d|2[0-3]):[0-5]\d)", re.IGNORECASE)


@pytest.fixture(scope="module")
def engine(checkpoint, new_llm):
    return new_llm(checkpoint("qwen3_tied"), **ENGINE)


def sampled(constraint: dict, max_tokens: int = MAX_TOKENS, **more) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, structured_outputs=constraint, **more)


def validate(schema: dict, text: str) -> None:
    value = json.loads(text)
    jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())
    if "when" in value:  # jsonschema checks date-time only with an optional package
        assert RFC3339_DATE_TIME.fullmatch(value["when"]), value["when"]


def test_json_schema_features_always_validate(engine):
    """100 draws of each schema, in one batch of them all: every output completes (the
    grammar's end finishes it) and validates."""
    names = [name for name in SCHEMAS for _ in range(100)]
    prompts = [[2 + i % 200, 3 + i % 97, 5] for i in range(len(names))]
    outputs = engine.generate(prompts, [sampled({"json": SCHEMAS[name]}, seed=i) for i, name in enumerate(names)],
                              use_tqdm=False)
    for name, out in zip(names, outputs):
        assert out["finish_reason"] == "stop", (name, out["text"])
        validate(SCHEMAS[name], out["text"])


def test_json_object_regex_choice_and_grammar(engine):
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    cases = [({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
             ({"regex": r"[a-c]{2,5}-[0-9]{3}"}, lambda t: re.fullmatch(r"[a-c]{2,5}-[0-9]{3}", t)),
             ({"choice": ["yes", "no", "maybe so"]}, lambda t: t in ("yes", "no", "maybe so")),
             ({"grammar": grammar}, lambda t: re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", t))]
    params = [sampled(c, max_tokens=400, seed=i) for c, _ in cases for i in range(20)]
    outputs = engine.generate([[7, 8, 9]] * len(params), params, use_tqdm=False)
    for i, out in enumerate(outputs):
        constraint, check = cases[i // 20]
        if "json_object" in constraint and out["finish_reason"] == "length":
            continue  # any object: nothing bounds it
        assert out["finish_reason"] == "stop" and check(out["text"]), (constraint, out["text"])


def test_invalid_constraints_are_refused_before_queueing(engine):
    for constraint in ({"regex": "a(b"}, {"json": {"type": "nothing"}}, {"json": "{not json"},
                       {"grammar": 'root ::= "a" missing'}):
        with pytest.raises(ValueError, match=r"^structured_outputs\."):
            engine.generate([[5, 6], [7, 8]], [SamplingParams(), sampled(constraint)], use_tqdm=False)
        assert engine.scheduler.is_finished()


def test_compiled_grammars_are_cached_with_a_bound(engine, monkeypatch):
    from nanovllm.engine import structured_outputs
    compiler = structured_outputs.GrammarCompiler(engine.tokenizer, 320)
    monkeypatch.setattr(structured_outputs, "COMPILED_CACHE_SIZE", 2)
    first = compiler.compile(StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}))
    # the same schema as text, keys in another order: the same entry
    again = compiler.compile(StructuredOutputsParams(json='{"properties": {"a": {"type": "integer"}}, "type": "object"}'))
    assert again is first
    compiler.compile(StructuredOutputsParams(regex="x+"))
    compiler.compile(StructuredOutputsParams(choice=["a"]))
    assert len(compiler._compiled) == 2
    assert compiler.compile(StructuredOutputsParams(regex="x+")) is compiler._compiled[("regex", "x+")]
    assert ("json", json.dumps(SCHEMAS["object"], sort_keys=True)) not in compiler._compiled


def test_json_whitespace_is_bounded_and_eos_waits_for_the_end(engine):
    from nanovllm.engine.structured_outputs import MAX_JSON_WHITESPACE, bitmask_words, fill_bitmask
    tokenizer = engine.tokenizer
    compiler = engine._grammar_compiler()
    constraint = compiler.constraint(StructuredOutputsParams(json_object=True), num_prompt_tokens=0)
    space, eos = tokenizer.convert_tokens_to_ids("\u0120"), tokenizer.eos_token_id  # byte-level " "
    bitmask = torch.zeros(1, bitmask_words(320), dtype=torch.int32)

    def allowed(token: int) -> bool:
        fill_bitmask([constraint], bitmask)
        return bool(bitmask[0, token // 32] >> (token % 32) & 1)

    assert not allowed(eos)
    constraint.accept(tokenizer.encode("{", add_special_tokens=False) + [space] * MAX_JSON_WHITESPACE)
    assert not allowed(space) and not allowed(eos)
    constraint.accept(tokenizer.encode("}", add_special_tokens=False))
    assert constraint.terminated


def test_constraints_survive_preemption(checkpoint, new_llm):
    """Too few KV blocks for the batch: sequences are preempted and recomputed, their matchers
    keep their place."""
    llm = new_llm(checkpoint("qwen3_tied"), max_model_len=128, num_kvcache_blocks=12, max_num_seqs=8)
    schema = SCHEMAS["enum"]
    outputs = llm.generate([[3 + i] * 40 for i in range(8)], [sampled({"json": schema}, max_tokens=88, seed=i)
                                                               for i in range(8)], use_tqdm=False)
    assert llm.scheduler.num_preemptions > 0
    for out in outputs:
        assert out["finish_reason"] == "stop"
        validate(schema, out["text"])


def test_max_tokens_cuts_the_output(engine):
    out = engine.generate([[4, 5]], sampled({"json": SCHEMAS["nested"]}, max_tokens=5, seed=1), use_tqdm=False)[0]
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 5 and out["text"].startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(out["text"])


def test_reasoning_end_starts_the_constraint(engine):
    """The matcher itself: tokens before the end text pass (the mask allows every token), the
    grammar takes the tokens after the one that completes it."""
    from nanovllm.engine.structured_outputs import bitmask_words, fill_bitmask
    tokenizer = engine.tokenizer
    params = StructuredOutputsParams(choice=["yes", "no"], reasoning_end="</think>")
    constraint = engine._grammar_compiler().constraint(params, num_prompt_tokens=3)
    bitmask = torch.zeros(1, bitmask_words(320), dtype=torch.int32)
    thinking = tokenizer.encode("hmm </thi", add_special_tokens=False)
    constraint.accept(thinking)
    fill_bitmask([constraint], bitmask)
    assert (bitmask == -1).all() and not constraint.active and constraint.position == 3 + len(thinking)
    constraint.accept(tokenizer.encode("nk>", add_special_tokens=False))  # the end text across tokens
    assert constraint.active
    fill_bitmask([constraint], bitmask)
    allowed = [t for t in range(320) if bitmask[0, t // 32] >> (t % 32) & 1]
    assert allowed and all("yes".startswith(tokenizer.decode([t])) or "no".startswith(tokenizer.decode([t]))
                           for t in allowed)
    constraint.accept(tokenizer.encode("no", add_special_tokens=False))
    assert constraint.terminated


def test_reasoning_end_in_the_engine(engine):
    """Greedy, so the unconstrained start is known: reasoning_end is the text of the third
    token the model emits on its own. The output keeps those three tokens, then a choice."""
    tokenizer = engine.tokenizer
    for first in range(10, 60):  # a prompt whose third token's text is new there
        prompt = [first, first + 1, first + 2]
        free = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                               use_tqdm=False)[0]["token_ids"]
        end = tokenizer.decode(free[2:3])
        if end.strip() and end not in tokenizer.decode(free[:2]):
            break
    else:
        pytest.fail("no prompt found")
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs={"choice": ["alpha", "beta"],
                                                                              "reasoning_end": end})
    out = engine.generate([prompt], params, use_tqdm=False)[0]
    assert out["token_ids"][:3] == free[:3] and out["finish_reason"] == "stop"
    assert tokenizer.decode(out["token_ids"][3:]) in ("alpha", "beta")


@pytest.mark.gpu
def test_structured_outputs_on_gpu(checkpoint):
    """CUDA graphs for the forward pass, the eager sampler for constrained rows, beside plain rows."""
    from nanovllm import LLM
    llm = LLM(str(checkpoint("qwen3_tied")), device="cuda", dtype="bfloat16", max_model_len=512, max_num_seqs=64)
    try:
        names = [name for name in SCHEMAS for _ in range(8)]
        params = [sampled({"json": SCHEMAS[name]}, seed=i) for i, name in enumerate(names)]
        params += [SamplingParams(temperature=1.0, max_tokens=32, seed=1)] * 8
        outputs = llm.generate([[2 + i % 200, 7] for i in range(len(params))], params, use_tqdm=False)
        for name, out in zip(names, outputs):
            assert out["finish_reason"] == "stop", (name, out["text"])
            validate(SCHEMAS[name], out["text"])
    finally:
        llm.close()
