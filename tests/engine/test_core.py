"""EngineCore: detokenization, stop strings / tokens, EOS, abort — with a scripted runner."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from infergate.engine.core.engine_core import EngineCore, RequestOutput
from infergate.engine.core.request import Request
from infergate.engine.core.scheduler import SchedulerConfig
from infergate.engine.interfaces import SamplingParams, ScheduledBatch
from infergate.engine.tokenizer import Tokenizer


class ScriptedRunner:
    """'Generates' a fixed token script: output token i is script[i]."""

    block_size = 16
    num_blocks = 64

    def __init__(self, script: list[int]) -> None:
        self.script = script
        self.released: list[str] = []

    def execute(self, batch: ScheduledBatch) -> list[int | None]:
        return [
            self.script[s.num_generated % len(self.script)] if s.sample else None
            for s in batch.seqs
        ]

    def release(self, request_id: str) -> None:
        self.released.append(request_id)


@pytest.fixture
def tok(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer(tiny_model_dir)


def run(tok: Tokenizer, script: list[int], **params: Any) -> tuple[list[RequestOutput], EngineCore]:
    core = EngineCore(ScriptedRunner(script), SchedulerConfig(max_model_len=512), tokenizer=tok)
    request = Request(
        "r",
        tok.encode("Tell me."),
        SamplingParams(**params),
        eos_token_ids=tok.eos_token_ids,
    )
    core.add_request(request)
    outputs: list[RequestOutput] = []
    while core.has_work():
        outputs += core.step()
    assert core.kv.pool.num_free_blocks == core.kv.pool.num_blocks
    return outputs, core


def text(outputs: list[RequestOutput]) -> str:
    return "".join(o.new_text for o in outputs)


def test_text_streams_in_deltas_and_ends_at_max_tokens(tok: Tokenizer) -> None:
    script = tok.encode("Hello world, how are you today?", add_special_tokens=False)
    outputs, core = run(tok, script, max_tokens=len(script))
    assert text(outputs) == "Hello world, how are you today?"
    assert outputs[-1].finished and outputs[-1].finish_reason == "length"
    assert [o.finished for o in outputs[:-1]] == [False] * (len(outputs) - 1)
    assert outputs[-1].num_output_tokens == len(script)
    assert core.runner.released == ["r"]  # type: ignore[attr-defined]


def test_stop_string_truncates_and_is_held_back_while_streaming(tok: Tokenizer) -> None:
    script = tok.encode("Hello world, how are you today?", add_special_tokens=False)
    outputs, _ = run(tok, script, max_tokens=40, stop=("are you",))
    assert text(outputs) == "Hello world, how "
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == ("stop", "are you")
    # No delta ever contained a piece of the stop string that had to be taken back.
    assert all("are" not in o.new_text for o in outputs)


def test_stop_string_wins_over_a_simultaneous_length_limit(tok: Tokenizer) -> None:
    script = tok.encode("Hello world", add_special_tokens=False)
    outputs, _ = run(tok, script, max_tokens=len(script), stop=("world",))
    assert outputs[-1].finish_reason == "stop" and "world" not in text(outputs)


def test_eos_and_stop_token_ids_end_without_their_text(tok: Tokenizer) -> None:
    words = tok.encode("Hello world", add_special_tokens=False)
    eos = min(tok.eos_token_ids)
    outputs, _ = run(tok, [*words, eos, *words], max_tokens=50)
    assert text(outputs) == "Hello world" and outputs[-1].finish_reason == "stop"
    assert outputs[-1].stop_reason is None and outputs[-1].num_output_tokens == len(words) + 1
    ignoring, _ = run(tok, [*words, eos, *words], max_tokens=2 * len(words) + 1, ignore_eos=True)
    assert ignoring[-1].finish_reason == "length" and text(ignoring) == "Hello worldHello world"
    stopped, _ = run(tok, words, max_tokens=50, stop_token_ids=(words[-1],))
    assert stopped[-1].stop_reason == words[-1]
    assert text(stopped) == tok.decode(words[:-1])


def test_abort_finishes_and_frees(tok: Tokenizer) -> None:
    core = EngineCore(ScriptedRunner([50, 60]), SchedulerConfig(), tokenizer=tok)
    core.add_request(Request("a", list(range(5, 45)), SamplingParams(max_tokens=100)))
    core.step()
    assert core.kv.usage() > 0
    core.abort("a")
    assert not core.has_work() and core.kv.usage() == 0
    assert core.runner.released == ["a"]  # type: ignore[attr-defined]
