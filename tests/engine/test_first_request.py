"""The engine's first streamed request runs the same code as every later one.

Starlette streams a response inside an anyio task group, and anyio imports its asyncio
backend on first use. Left to the first streamed request, that import held the event
loop for 150-350 ms on the routing lab's machine (every engine's first request took
330-500 ms, later ones 146). The app's startup loads it instead. Run in a fresh
interpreter: pytest's own plugins may already have loaded the backend in this one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import asyncio, json, sys
import httpx
from infergate.engine.async_engine import AsyncEngine
from infergate.engine.core.engine_core import EngineCore
from infergate.engine.core.scheduler import SchedulerConfig
from infergate.engine.entrypoints.api_server import build_app
from infergate.engine.entrypoints.config import ServerConfig
from infergate.engine.serve import filler_token_ids
from infergate.engine.sim_runner import SimulatedRunner
from infergate.engine.tokenizer import Tokenizer


async def main(model_dir: str) -> None:
    tok = Tokenizer(__import__("pathlib").Path(model_dir))
    runner = SimulatedRunner(
        block_size=16, num_blocks=64, filler_token_ids=filler_token_ids(tok), sleep=False
    )
    engine = AsyncEngine(EngineCore(runner, SchedulerConfig(max_model_len=512), tokenizer=tok))
    app = build_app(engine, tok, ServerConfig(["m"], model_dir, 512, tok.vocab_size))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            assert (await client.get("/health")).status_code == 200
            before = set(sys.modules)
            body = {"model": "m", "prompt": "hello there", "max_tokens": 4, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as res:
                assert res.status_code == 200
                lines = [line async for line in res.aiter_lines() if line.startswith("data:")]
            assert lines[-1] == "data: [DONE]", lines
    print(json.dumps(sorted(set(sys.modules) - before)))


asyncio.run(main(sys.argv[1]))
"""


def test_first_streamed_request_imports_nothing(tiny_model_dir: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_model_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    imported = json.loads(done.stdout.strip().splitlines()[-1])
    assert imported == [], f"the first streamed request imported {imported}"
