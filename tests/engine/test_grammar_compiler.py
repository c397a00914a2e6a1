"""The grammar compiler: cached by grammar, shared while in flight, errors not cached,
and the event loop keeps running while a compile is on the worker thread."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest
import xgrammar as xgr
from infergate.engine.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from infergate.engine.structured_output import GrammarSpec, GrammarSpecError, spec_from_request
from infergate.engine.structured_output.compiler import GrammarCompiler
from infergate.engine.tokenizer import Tokenizer
from infergate.engine.tool_parsers import get_parser
from infergate.engine.tool_parsers.choice import plan_tools


@pytest.fixture
def compiler(tiny_model_dir: Path) -> GrammarCompiler:
    tok = Tokenizer(tiny_model_dir)
    return GrammarCompiler(tok, tok.vocab_size)


async def test_identical_grammars_compile_once(compiler: GrammarCompiler) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    a = GrammarSpec("json", json.dumps(schema, sort_keys=True), "guided_json")
    b = GrammarSpec("json", json.dumps(schema, sort_keys=True), "response_format")
    threads: list[str] = []
    compile_sync = compiler.compile_sync

    def recording(spec: GrammarSpec) -> object:
        threads.append(threading.current_thread().name)
        return compile_sync(spec)

    compiler.compile_sync = recording  # type: ignore[method-assign,assignment]
    first = await asyncio.gather(compiler.compile(a), compiler.compile(b), compiler.compile(a))
    assert compiler.compiles == 1 and first[0] is first[1] is first[2]
    # Off the event loop's thread (and so off the engine's step loop too).
    assert len(threads) == 1 and threads[0].startswith("grammar-compile")
    await compiler.compile(GrammarSpec("regex", "[0-9]+", "guided_regex"))
    assert compiler.compiles == 2
    compiler.shutdown()


async def test_bad_grammar_is_named_and_not_cached(compiler: GrammarCompiler) -> None:
    bad = GrammarSpec("grammar", "root ::= missing", "guided_grammar")
    for _ in range(2):
        with pytest.raises(GrammarSpecError) as info:
            await compiler.compile(bad)
        assert info.value.param == "guided_grammar" and "missing" in info.value.message
    assert compiler.compiles == 2
    compiler.shutdown()


def test_same_schema_from_different_fields_shares_a_key() -> None:
    chat = ChatCompletionRequest.model_validate({
        "messages": [], "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"b": 1, "a": 2}}}})  # fmt: skip
    completion = CompletionRequest.model_validate(
        {"prompt": "x", "guided_json": '{"a": 2, "b": 1}'}
    )
    one, two = spec_from_request(chat), spec_from_request(completion)
    assert one is not None and two is not None and one.key == two.key
    assert (one.param, two.param) == ("response_format", "guided_json")


@pytest.mark.parametrize(
    "field",
    [{"response_format": {"type": "json_object"}}, {"structured_outputs": {"json_object": True}}],
)
def test_json_object_admits_an_object_and_nothing_else(
    compiler: GrammarCompiler, field: dict[str, object]
) -> None:
    """OpenAI's JSON mode promises an object; an array, a string or a number at the top
    level is refused by the grammar itself (one rejected character is enough)."""
    spec = spec_from_request(ChatCompletionRequest.model_validate({"messages": [], **field}))
    assert spec is not None and spec.kind == "json_object"
    grammar = compiler.compile_sync(spec)
    for refused in ("[", '"', "1", "t", "n"):
        assert not xgr.GrammarMatcher(grammar).accept_string(refused), refused
    matcher = xgr.GrammarMatcher(grammar)
    assert matcher.accept_string('{"a": [1, {"b": null}], "c": "d"}')
    assert matcher.is_completed()  # the object may end here
    compiler.shutdown()


def _accepts(compiled: xgr.CompiledGrammar, text: str) -> bool:
    return bool(xgr.GrammarMatcher(compiled).accept_string(text))


@pytest.mark.parametrize("parallel", [True, False])
def test_auto_tool_choice_leaves_text_free_but_calls_name_offered_tools(
    compiler: GrammarCompiler, parallel: bool
) -> None:
    """tool_choice=auto with hermes markup: prose is free; after ``<tool_call>`` only an
    offered function with schema-valid arguments fits; one call unless parallel."""
    fns = [{"name": n, "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                      "required": ["city"]}} for n in ("get_weather", "get_time")]  # fmt: skip
    plan = plan_tools([{"type": "function", "function": f} for f in fns], "auto", parallel, True)
    tag = plan.auto_structural_tag(get_parser("hermes"))
    assert tag is not None
    compiled = compiler.compile_sync(GrammarSpec("structural_tag", json.dumps(tag), "tools"))
    call = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert _accepts(compiled, "Two plus two is four.")
    assert _accepts(compiled, "Let me check. " + call)
    assert not _accepts(compiled, '<tool_call>\n{"name": "get_total_score"')
    assert not _accepts(compiled, '<tool_call>\n{"name": "get_time", "arguments": {"town": 1')
    assert _accepts(compiled, call + "\n" + call) is parallel
    # Parsers without fixed markup, and other modes, stay unconstrained.
    assert plan_tools([], "none", None, True).auto_structural_tag(get_parser("hermes")) is None
    assert plan.auto_structural_tag(get_parser("llama3_json")) is None
    compiler.shutdown()
