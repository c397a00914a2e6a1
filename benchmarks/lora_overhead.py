"""CPU cost of batched multi-LoRA in the real runner: the same steps with no adapter,
and with every sequence on one of 4 resident adapters (rank 16, all 7 projections).

A mid-sized random model (hidden 512, 4 layers, dummy weights; the tiny model's ops are
too short to show anything) runs a 512-token prefill and decode steps of 32 sequences.
Prints the fastest ms per step (interleaved runs) and the LoRA/base ratio; asserts
nothing. The base runs go through the same wrapped model with no adapter in the batch.

    python benchmarks/lora_overhead.py [--repeat 20]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from infergate.engine.interfaces import ScheduledBatch, ScheduledSeq
from infergate.engine.lora.runner import attach_torch_lora
from infergate.engine.lora.tiny import make_tiny_lora
from infergate.engine.model_runner import TorchModelRunner
from infergate.engine.tiny_model import make_tiny_model

SHAPE = {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64}  # fmt: skip
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build(root: Path) -> tuple[Path, list[Path]]:
    model = make_tiny_model(root / "model")
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(SHAPE)
    (model / "config.json").write_text(json.dumps(cfg))
    adapters = [make_tiny_lora(model, root / f"a{i}", seed=i, rank=16, target_modules=ALL)
                for i in range(4)]  # fmt: skip
    return model, adapters


def timed(runner: TorchModelRunner, batches: list[ScheduledBatch], repeat: int) -> list[float]:
    """Fastest ms per step of each batch, the batches interleaved so that the load of a
    shared machine falls on all of them alike."""
    best = [float("inf")] * len(batches)
    for batch in batches:
        runner.compute_logits(batch)  # warm-up (and slot loads)
    for _ in range(repeat):
        for i, batch in enumerate(batches):
            start = time.perf_counter()
            runner.compute_logits(batch)
            best[i] = min(best[i], (time.perf_counter() - start) * 1000)
    return best


def steps(names: list[str | None]) -> dict[str, ScheduledBatch]:
    prefill = ScheduledBatch([ScheduledSeq("p", [1 + i % 300 for i in range(512)], 0, list(range(32)), True,
                                           lora_name=names[0])])  # fmt: skip
    decode = ScheduledBatch([
        ScheduledSeq(f"d{i}", [7], 100, list(range(32 + 8 * i, 40 + 8 * i)), True,
                     lora_name=names[i % len(names)])
        for i in range(32)
    ])  # fmt: skip
    return {"prefill 512 tokens": prefill, "decode 32 seqs": decode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model, adapters = build(Path(tmp))
        runner = TorchModelRunner.from_model_dir(model, num_blocks=512, device="cpu",
                                                 load_format="dummy", max_model_len=2048)  # fmt: skip
        lora = attach_torch_lora(runner, max_loras=4, max_lora_rank=16, max_cpu_loras=4)
        for i, path in enumerate(adapters):
            lora.manager.add(f"a{i}", str(path))
        plain, mixed = steps([None]), steps([f"a{i}" for i in range(4)])
        results = {k: timed(runner, [plain[k], mixed[k]], args.repeat) for k in plain}
    print(
        f"threads={torch.get_num_threads()}  (ms per step; LoRA: 4 adapters, rank 16, all projections)"
    )
    for key, (base, with_lora) in results.items():
        print(f"{key:>20}: base {base:7.2f}  lora {with_lora:7.2f}  ratio {with_lora / base:.2f}")


if __name__ == "__main__":
    main()
