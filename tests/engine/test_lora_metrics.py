"""``vllm:lora_requests_info`` from a real engine core with waiting and running adapter
requests, read back by the EPP's collector from the rendered text."""

from __future__ import annotations

from pathlib import Path

from infergate.engine.core.engine_core import EngineCore
from infergate.engine.core.request import Request
from infergate.engine.core.scheduler import SchedulerConfig
from infergate.engine.interfaces import SamplingParams
from infergate.engine.lora.manager import LoRAManager
from infergate.engine.metrics import EngineMetrics
from infergate.engine.sim_runner import SimulatedRunner, TimingModel
from infergate.epp.datalayer.dialects import VLLM, parse_metrics


def test_running_and_waiting_adapters_reach_the_epp_collector(tmp_path: Path) -> None:
    runner = SimulatedRunner(block_size=16, num_blocks=64, filler_token_ids=[5], sleep=False,
                             timing=TimingModel())  # fmt: skip
    manager = LoRAManager(max_loras=2, max_lora_rank=8, max_cpu_loras=4)
    runner.lora, runner.lora_load_seconds = manager, 0.05
    metrics = EngineMetrics("base", block_size=16, num_gpu_blocks=64)
    core = EngineCore(runner, SchedulerConfig(max_loras=2), metrics=metrics, lora=manager)
    for name in ("sql", "chat", "math"):
        core.add_lora(name, str(tmp_path / name))  # simulated: the path is never read
    for i, name in enumerate(("sql", "chat", "math", "sql")):
        request = Request(f"r{i}", list(range(1, 40)), SamplingParams(max_tokens=50))
        request.lora = manager.get(name)
        core.add_request(request)
    core.step()
    text = metrics.render()
    assert b'max_lora="2",running_lora_adapters="chat,sql",waiting_lora_adapters="math"' in text
    seen = parse_metrics(text, VLLM)
    assert seen.active_models == {"sql", "chat"}
    assert seen.waiting_models == {"math"}
    assert seen.max_active_models == 2
    # Two adapters came into the slots in that step, at the modelled load cost each.
    assert runner.lora_loads == 2
    from infergate.engine.metrics import SimulatorCollector

    metrics.registry.register(SimulatorCollector(runner))
    assert b"infergate_sim_lora_loads_total 2.0" in metrics.render()
    assert runner.simulated_seconds > 2 * 0.05


def test_a_request_for_an_adapter_unloaded_meanwhile_is_refused(tmp_path: Path) -> None:
    import pytest
    from infergate.engine.lora.errors import LoRAError

    runner = SimulatedRunner(block_size=16, num_blocks=64, filler_token_ids=[5], sleep=False)
    manager = LoRAManager(max_loras=1, max_lora_rank=8)
    runner.lora = manager
    core = EngineCore(runner, SchedulerConfig(max_loras=1), lora=manager)
    adapter = core.add_lora("sql", str(tmp_path))
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=2), lora=adapter)
    core.remove_lora("sql")
    with pytest.raises(LoRAError, match="no longer loaded"):
        core.add_request(request)
    core.add_lora("sql", str(tmp_path))  # same name, new registration: the old one is stale
    with pytest.raises(LoRAError, match="no longer loaded"):
        core.add_request(request)
    busy = Request("b", [1, 2, 3], SamplingParams(max_tokens=2), lora=manager.get("sql"))
    core.add_request(busy)
    with pytest.raises(LoRAError, match="in use by 1 request"):
        core.remove_lora("sql")
    with pytest.raises(KeyError):
        core.remove_lora("nope")
