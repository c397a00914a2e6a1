"""The simulated runner: timing model shape, prefix hits shortening prefill, filler tokens."""

from __future__ import annotations

from pathlib import Path

from infergate.engine.core.engine_core import EngineCore
from infergate.engine.core.request import Request
from infergate.engine.core.scheduler import SchedulerConfig
from infergate.engine.interfaces import SamplingParams, ScheduledBatch, ScheduledSeq
from infergate.engine.serve import filler_token_ids
from infergate.engine.sim_runner import SimulatedRunner, TimingModel, default_num_blocks
from infergate.engine.tokenizer import Tokenizer


def seq(n: int, start: int = 0) -> ScheduledSeq:
    return ScheduledSeq("r", [1] * n, start, [], sample=True)


def test_timing_model_grows_with_work() -> None:
    model = TimingModel()
    one_decode = model.step_seconds(ScheduledBatch([seq(1, 100)]))
    assert 0.006 <= one_decode < 0.007
    many_decodes = model.step_seconds(ScheduledBatch([seq(1, 2000) for _ in range(64)]))
    assert many_decodes > one_decode * 1.5  # batch size and KV read both cost
    prefill = model.step_seconds(ScheduledBatch([seq(1024)]))
    cached_prefill = model.step_seconds(ScheduledBatch([seq(24, 1008)]))
    assert prefill > 4 * cached_prefill


def test_default_capacity_is_an_h100_serving_8b() -> None:
    assert 25_000 < default_num_blocks(16) < 30_000


def prefill_seconds(core: EngineCore, runner: SimulatedRunner, request: Request) -> float:
    core.add_request(request)
    before = runner.simulated_seconds
    core.step()  # admits and prefills the whole prompt (budget 2048)
    spent = runner.simulated_seconds - before
    while core.has_work():
        core.step()
    return spent


def test_prefix_hit_shortens_simulated_ttft_and_filler_is_deterministic(
    tiny_model_dir: Path,
) -> None:
    tok = Tokenizer(tiny_model_dir)
    filler = filler_token_ids(tok)
    assert filler and not set(filler) & (tok.eos_token_ids | tok.special_token_ids)
    runner = SimulatedRunner(block_size=16, num_blocks=512, filler_token_ids=filler, sleep=False)
    core = EngineCore(runner, SchedulerConfig(), tokenizer=tok)
    shared = [7 + i % 300 for i in range(1024)]
    params = SamplingParams(max_tokens=8)
    a = Request("a", [*shared, 1, 2], params)
    cold = prefill_seconds(core, runner, a)
    b = Request("b", [*shared, 3, 4], params)
    warm = prefill_seconds(core, runner, b)
    assert b.num_cached_tokens == 1024
    assert warm < cold / 3
    c = Request("c", [*shared, 1, 2], params)
    prefill_seconds(core, runner, c)
    assert c.output_token_ids == a.output_token_ids  # same prompt, same filler
    assert len(set(a.output_token_ids)) > 1
    assert core.kv.pool.num_free_blocks == core.kv.pool.num_blocks
