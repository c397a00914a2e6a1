"""The engine's imports go one way: down the layers below, never back up.

As in vLLM v1: the parts (the ``ModelRunner`` interface, tokenizer, sampler, LoRA
registry, KV events, grammars, tool parsers) know nothing of the engine around them; the
model side (model runners, models, attention, weights) implements the interface; the core
(``engine/core/``: step loop, scheduler, KV manager, block pool, request, queue) drives a
runner through that interface only; the async engine puts the core on its own thread;
the OpenAI server (``entrypoints/``) calls the async engine; ``serve`` wires it all.
Outside itself the engine imports only :mod:`infergate.wire` (the formats it shares with
the EPP), :mod:`infergate.options` (its command-line fields) and ``infergate`` (the
version). docs/engine.md draws the same picture.
"""

from __future__ import annotations

import pytest

from tests.layering import REPO, LayerTable

E = "infergate.engine"
MODEL = (
    f"{E}.attention",
    f"{E}.models",
    f"{E}.weights",
    f"{E}.gguf_model",
    f"{E}.tiny_model",
    f"{E}.lora.layers",
    f"{E}.lora.runner",
    f"{E}.model_runner",
    f"{E}.sim_runner",
)

ENGINE = LayerTable(
    package=E,
    folder=REPO / "engine",
    layers=(
        ("outside", ("infergate.wire", "infergate.options", "=infergate")),
        (
            "parts",
            (
                f"{E}.interfaces",
                f"{E}.tokenizer",
                f"{E}.sampler",
                f"{E}.fetch",
                f"{E}.lora",
                f"{E}.structured_output",
                f"{E}.tool_parsers",
                f"{E}.kv_events",
                f"{E}.completion_events",
                f"{E}.load_reports",
                f"{E}.kv_transfer",  # the transport; blocks and service sit higher
                f"{E}.kernels",  # the CPU decode step's C kernels
            ),
        ),
        ("model", MODEL),
        ("core", (f"{E}.core", f"{E}.metrics", f"{E}.kv_transfer.blocks")),
        ("async", (f"{E}.async_engine", f"{E}.kv_transfer.service")),
        ("entrypoints", (f"{E}.entrypoints",)),
        ("app", (f"{E}.serve", f"{E}.cli", f"{E}.vllm_args")),
    ),
    outside=(
        "outside itself the engine imports only infergate.wire, infergate.options "
        "and infergate (the version)"
    ),
)


def test_every_engine_import_goes_down_the_layers() -> None:
    problems = ENGINE.all_violations()
    assert not problems, "\n".join(problems)


def test_the_core_and_the_server_never_import_the_model_side() -> None:
    """The model layer sits below the core only so the core's table stays a line: the core
    drives a runner through ``interfaces.ModelRunner``, and the HTTP server knows no
    model, so neither imports a runner, a model or the weights."""
    for module in sorted(ENGINE.modules()):
        if ENGINE.layer_name(module) not in ("core", "async", "entrypoints"):
            continue
        for line, target in ENGINE.imports_of(module):
            assert ENGINE.layer_name(target) != "model", f"{module}:{line} {target}"


def test_the_walk_sees_the_whole_engine() -> None:
    names = ENGINE.modules()
    assert {
        f"{E}.core.engine_core",
        f"{E}.core.scheduler",
        f"{E}.core.kv_cache_manager",
        f"{E}.core.block_pool",
        f"{E}.core.request",
        f"{E}.core.waiting_queue",
        f"{E}.entrypoints.protocol",
        f"{E}.entrypoints.protocol_responses",
        f"{E}.kv_transfer.blocks",
        f"{E}.lora.runner",
    } <= names
    assert all(ENGINE.layer_of(m) is not None for m in names - {E})


@pytest.mark.parametrize(
    ("module", "source", "fragment"),
    [
        (
            f"{E}.core.scheduler",
            "from infergate.engine.entrypoints.protocol import CompletionRequest",
            "(core) imports infergate.engine.entrypoints.protocol (entrypoints)",
        ),
        (
            f"{E}.core.block_pool",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from infergate.engine.async_engine import AsyncEngine\n",
            "(core) imports infergate.engine.async_engine (async)",
        ),
        (
            f"{E}.sampler",
            "from .core.request import Request",
            "(parts) imports infergate.engine.core.request (core)",
        ),
        (
            f"{E}.model_runner",
            "def f():\n    from infergate.engine.core import scheduler\n",
            "(model) imports infergate.engine.core.scheduler (core)",
        ),
        (
            f"{E}.entrypoints.serving_chat",
            "from infergate.engine.serve import ServeOptions",
            "(entrypoints) imports infergate.engine.serve (app)",
        ),
        (
            f"{E}.kv_events",
            "from infergate.epp.datalayer.kvevents import decode",
            "imports infergate.epp.datalayer.kvevents; outside itself the engine",
        ),
        (
            f"{E}.serve",
            "from infergate.stack.local import LocalStack",
            "imports infergate.stack.local; outside itself the engine",
        ),
        (f"{E}.newthing", "", "infergate.engine.newthing is in no layer"),
    ],
)
def test_an_import_that_climbs_is_named(module: str, source: str, fragment: str) -> None:
    problems = ENGINE.violations(source, module)
    assert len(problems) == 1 and fragment in problems[0], problems


def test_imports_down_or_across_are_allowed() -> None:
    source = (
        "from infergate.engine.core.request import Request\n"
        "from infergate.engine.interfaces import ScheduledBatch\n"
        "from infergate.engine.kv_transfer.blocks import KVTransfer\n"
        "from infergate.wire.block_hash import block_hashes\n"
        "from infergate import __version__\n"
        "import json\n"
    )
    assert ENGINE.violations(source, f"{E}.core.engine_core") == []
