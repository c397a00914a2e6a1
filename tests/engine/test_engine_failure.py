"""A runner that fails: in-flight requests get a 500, then /health and new requests 503."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from infergate.engine.async_engine import AsyncEngine
from infergate.engine.core.engine_core import EngineCore
from infergate.engine.core.scheduler import SchedulerConfig
from infergate.engine.entrypoints.api_server import build_app
from infergate.engine.entrypoints.config import ServerConfig
from infergate.engine.interfaces import ScheduledBatch
from infergate.engine.tokenizer import Tokenizer


class BrokenRunner:
    block_size = 16
    num_blocks = 64

    def execute(self, batch: ScheduledBatch) -> list[int | None]:
        raise RuntimeError("device fell off the bus")

    def release(self, request_id: str) -> None:
        pass


async def test_runner_failure_is_reported_not_hung(tiny_model_dir: Path) -> None:
    tok = Tokenizer(tiny_model_dir)
    engine = AsyncEngine(
        EngineCore(BrokenRunner(), SchedulerConfig(max_model_len=512), tokenizer=tok)
    )
    app = build_app(engine, tok, ServerConfig(["m"], str(tiny_model_dir), 512, tok.vocab_size))
    engine.start()
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            assert (await client.get("/health")).status_code == 200
            body = {"model": "m", "prompt": "hello", "max_tokens": 2}
            res = await client.post("/v1/completions", json=body)
            assert res.status_code == 500
            assert "device fell off the bus" in res.json()["error"]["message"]
            health = await client.get("/health")
            assert health.status_code == 503 and health.json()["error"]["code"] == 503
            res = await client.post("/v1/completions", json=body)
            assert res.status_code == 503
    finally:
        engine.shutdown()


async def test_a_request_the_core_refuses_fails_alone(tiny_model_dir: Path) -> None:
    from infergate.engine.core.request import Request
    from infergate.engine.interfaces import SamplingParams
    from infergate.engine.serve import filler_token_ids
    from infergate.engine.sim_runner import SimulatedRunner

    tok = Tokenizer(tiny_model_dir)
    runner = SimulatedRunner(block_size=16, num_blocks=64, filler_token_ids=filler_token_ids(tok))
    core = EngineCore(runner, SchedulerConfig(), tokenizer=tok)
    add = core.add_request

    def picky_add(request: Request) -> None:  # stands in for a bug in admission
        if request.request_id == "bad":
            raise RuntimeError("cannot admit")
        add(request)

    core.add_request = picky_add  # type: ignore[method-assign]
    engine = AsyncEngine(core)
    engine.start()
    try:
        params = SamplingParams(max_tokens=20)
        good = engine.generate(Request("good", [5, 6, 7], params))
        with pytest.raises(ValueError, match="already in flight"):
            engine.generate(Request("good", [8], params))
        bad = [out async for out in engine.generate(Request("bad", [8, 9], params))]
        assert bad[-1].finished and "cannot admit" in (bad[-1].error or "")
        outs = [out async for out in good]
        assert outs[-1].finished and outs[-1].error is None and len(outs) == 20
        assert engine.healthy
    finally:
        engine.shutdown()
