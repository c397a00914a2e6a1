"""A request under a grammar shares the batch without disturbing the others: both
finish, and the unconstrained request's tokens are exactly those it gets alone."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
from infergate.engine.core.engine_core import EngineCore
from infergate.engine.core.request import Request
from infergate.engine.core.scheduler import SchedulerConfig
from infergate.engine.interfaces import SamplingParams
from infergate.engine.model_runner import TorchModelRunner
from infergate.engine.structured_output import GrammarSpec
from infergate.engine.structured_output.compiler import GrammarCompiler
from infergate.engine.structured_output.matcher import GrammarState
from infergate.engine.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                   "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 4}},
    "required": ["n", "tags"],
    "additionalProperties": False,
}  # fmt: skip


def _run(model_dir: Path, requests: list[Request]) -> dict[str, tuple[list[int], str, str]]:
    runner = TorchModelRunner.from_model_dir(model_dir, device="cpu", dtype="float32",
                                             num_blocks=64)  # fmt: skip
    core = EngineCore(runner, SchedulerConfig(max_model_len=512), tokenizer=Tokenizer(model_dir))
    for r in requests:
        core.add_request(r)
    out: dict[str, tuple[list[int], str, str]] = {r.request_id: ([], "", "") for r in requests}
    while core.has_work():
        for o in core.step():
            ids, text, _ = out[o.request_id]
            out[o.request_id] = (ids + o.new_token_ids, text + o.new_text, o.finish_reason or "")
    return out


def test_grammar_request_does_not_disturb_a_plain_one(tiny_model_dir: Path) -> None:
    tok = Tokenizer(tiny_model_dir)
    plain = SamplingParams(temperature=1.0, seed=11, max_tokens=40, ignore_eos=True)
    prompt = tok.encode("Once upon a time")
    alone = _run(tiny_model_dir, [Request("plain", prompt, plain)])["plain"]

    compiler = GrammarCompiler(tok, tok.vocab_size)
    compiled = compiler.compile_sync(GrammarSpec("json", json.dumps(SCHEMA), "test"))
    compiler.shutdown()
    guided = Request("json", tok.encode("Give JSON"), SamplingParams(temperature=1.0, seed=3,
                     max_tokens=200), eos_token_ids=tok.eos_token_ids,
                     grammar=GrammarState(compiled))  # fmt: skip
    together = _run(tiny_model_dir, [Request("plain", prompt, plain), guided])
    assert together["plain"][0] == alone[0] and len(alone[0]) == 40
    _, text, finish = together["json"]
    assert finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
