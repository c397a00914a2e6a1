"""A runner that fails: in-flight requests get a 500, then /health and new requests 503."""

from __future__ import annotations

from pathlib import Path

import httpx
from infergate.engine.async_engine import AsyncEngine
from infergate.engine.core import EngineCore
from infergate.engine.interfaces import ScheduledBatch
from infergate.engine.scheduler import SchedulerConfig
from infergate.engine.server import ServerConfig, build_app
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
