"""``n`` samples of one prompt: KV blocks and prefill tokens, forked block table vs not.

Runs the real engine core (scheduler, KV cache manager) on the real tiny model (CPU,
float32) twice over one prompt with ``n`` seeded samples: once as the HTTP layer now
submits them (siblings fork the first sample's block table), once as ``n`` independent
requests (what ``n`` was before: sharing only through the prefix cache, which misses
when all arrive at once). Prints (never asserts) the peak KV blocks in use, the tokens
the model computed, and whether the forked samples' tokens equal the independent ones.
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import replace
from pathlib import Path

from infergate.engine.core.engine_core import EngineCore
from infergate.engine.core.request import Request
from infergate.engine.core.scheduler import SchedulerConfig
from infergate.engine.interfaces import SamplingParams, ScheduledBatch
from infergate.engine.model_runner import TorchModelRunner


def run(
    model_dir: Path, args: argparse.Namespace, forked: bool
) -> tuple[int, int, list[list[int]]]:
    """(peak KV blocks in use, tokens computed, each sample's output tokens)."""
    runner = TorchModelRunner.from_model_dir(
        model_dir, block_size=args.block_size, num_blocks=4096, device="cpu", dtype="float32"
    )
    computed = 0
    execute = runner.execute

    def counting(batch: ScheduledBatch) -> list[int | None]:
        nonlocal computed
        computed += batch.num_tokens
        return execute(batch)

    runner.execute = counting  # type: ignore[method-assign]
    core = EngineCore(runner, SchedulerConfig(max_model_len=args.prompt_tokens + args.max_tokens))
    prompt = [5 + (7 * i) % 300 for i in range(args.prompt_tokens)]
    base = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True)
    reqs = [Request(f"s{j}", prompt, replace(base, seed=100 + j)) for j in range(args.n)]
    if forked:
        for sibling in reqs[1:]:
            sibling.fork_parent = reqs[0]
    for r in reqs:
        core.add_request(r)
    peak = 0
    pool = core.kv.pool
    while core.has_work():
        core.step()
        peak = max(peak, pool.num_blocks - pool.num_free_blocks)
    return peak, computed, [r.output_token_ids for r in reqs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="model dir (default: a fresh tiny model)")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=100)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from infergate.engine.tiny_model import make_tiny_model

            model_dir = make_tiny_model(Path(tmp) / "tiny", arch="llama", seed=0)
        fork_peak, fork_tokens, fork_out = run(model_dir, args, forked=True)
        ind_peak, ind_tokens, ind_out = run(model_dir, args, forked=False)
    bs = args.block_size
    prompt_blocks = -(-args.prompt_tokens // bs)
    per_seq = -(-(args.prompt_tokens + args.max_tokens) // bs)
    print(f"== n={args.n}, prompt {args.prompt_tokens} tokens ({prompt_blocks} blocks of {bs}), "
          f"{args.max_tokens} tokens out per sample ({per_seq} blocks per sequence)")  # fmt: skip
    print(f"{'':<26} {'peak KV blocks':>15} {'tokens computed':>16}")
    print(f"{'forked block table':<26} {fork_peak:>15} {fork_tokens:>16}")
    print(f"{'independent requests':<26} {ind_peak:>15} {ind_tokens:>16}")
    print(f"forked samples' tokens equal the independent ones: {fork_out == ind_out}")


if __name__ == "__main__":
    main()
