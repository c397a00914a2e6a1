"""Prompt sets for ``infergate bench serve``: random, shared-prefix, or a JSONL file.

Prompt lengths are counted in tokens when a tokenizer is given (``--tokenizer DIR``, the
model's ``tokenizer.json``), so ``--input-len 512`` means 512 tokens as in
``vllm bench serve``; without one, prompts are built from words of a small vocabulary and
lengths are approximate (the server's ``usage.prompt_tokens`` is what the metrics use).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "with",
    "was",
    "on",
    "be",
    "by",
    "at",
    "this",
    "from",
    "or",
    "an",
    "are",
    "not",
    "have",
    "which",
    "one",
    "all",
    "were",
    "when",
    "there",
    "can",
    "more",
    "if",
    "out",
    "up",
    "about",
    "into",
    "time",
    "only",
    "some",
    "could",
    "them",
    "these",
    "two",
    "may",
    "then",
    "do",
    "first",
    "any",
    "now",
    "such",
    "like",
    "other",
    "over",
    "new",
    "most",
    "also",
    "made",
    "after",
    "well",
    "model",
    "token",
    "cache",
    "prefix",
    "engine",
    "request",
    "queue",
    "batch",
    "latency",
    "gateway",
    "picker",
    "envoy",
    "pool",
]


@dataclass
class SampleRequest:
    """One request to send: a completion prompt, or chat messages, and how much to generate."""

    prompt: str
    output_len: int
    prompt_len: int | None = None
    """Tokens in ``prompt`` when known locally; else the server's usage decides."""
    system: str | None = None
    """Chat only: a system message (the shared prefix of the shared-prefix dataset)."""
    messages: list[dict[str, Any]] | None = field(default=None)
    group: int | None = None
    model: str | None = None
    """The model to ask for (e.g. a LoRA adapter); None: the benchmark's model."""


class Tokens:
    """Optional exact token counting and random-token prompts via a ``tokenizer.json``."""

    def __init__(self, tokenizer_dir: Path | None) -> None:
        self.tokenizer = None
        if tokenizer_dir is not None:
            from tokenizers import Tokenizer

            path = Path(tokenizer_dir)
            file = path / "tokenizer.json" if path.is_dir() else path
            if not file.is_file():
                raise ValueError(f"no tokenizer.json at {tokenizer_dir}")
            self.tokenizer = Tokenizer.from_file(str(file))

    def count(self, text: str) -> int | None:
        if self.tokenizer is None:
            return None
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def text(self, length: int, rng: random.Random) -> str:
        """About ``length`` tokens of random text (exactly, with a tokenizer)."""
        if length <= 0:
            return ""
        if self.tokenizer is None:
            return " ".join(rng.choice(_WORDS) for _ in range(length))
        vocab = self.tokenizer.get_vocab_size()
        special = {t for t in self.tokenizer.get_added_tokens_decoder()}
        ids = [rng.randrange(vocab) for _ in range(length)]
        ids = [i if i not in special else (i + 1) % vocab for i in ids]
        text = self.tokenizer.decode(ids)
        # Decoding then encoding need not round-trip: trim or pad to the exact length.
        encoded = self.tokenizer.encode(text, add_special_tokens=False).ids
        while len(encoded) < length:
            encoded += [rng.randrange(vocab)]
        return self.tokenizer.decode(encoded[:length])


def _lengths(mean: int, range_ratio: float, n: int, rng: random.Random) -> list[int]:
    if not 0 <= range_ratio < 1:
        raise ValueError("--range-ratio must be in [0, 1)")
    low, high = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
    return [rng.randint(low, high) for _ in range(n)]


def random_dataset(
    num_prompts: int,
    input_len: int,
    output_len: int,
    *,
    range_ratio: float = 0.0,
    tokens: Tokens | None = None,
    seed: int = 0,
) -> list[SampleRequest]:
    """Independent random prompts (no shared prefixes), lengths uniform in ±range_ratio."""
    rng = random.Random(seed)
    tokens = tokens or Tokens(None)
    inputs = _lengths(input_len, range_ratio, num_prompts, rng)
    outputs = _lengths(output_len, range_ratio, num_prompts, rng)
    samples = []
    for index, (n_in, n_out) in enumerate(zip(inputs, outputs, strict=True)):
        # A unique lead word keeps two random prompts from sharing a first block.
        prompt = f"{index}: " + tokens.text(n_in, rng)
        samples.append(SampleRequest(prompt, n_out, tokens.count(prompt)))
    return samples


def shared_prefix_dataset(
    num_prompts: int,
    *,
    num_groups: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    tokens: Tokens | None = None,
    seed: int = 0,
) -> list[SampleRequest]:
    """Groups of requests sharing a long system prompt, interleaved across groups.

    This is the workload where prefix-aware routing pays: a request routed to the engine
    that already holds its group's prefix skips most of its prefill.
    """
    if num_groups < 1:
        raise ValueError("--num-prefix-groups must be at least 1")
    rng = random.Random(seed)
    tokens = tokens or Tokens(None)
    prefixes = [f"System {g}: " + tokens.text(prefix_len, rng) for g in range(num_groups)]
    samples = []
    order = [i % num_groups for i in range(num_prompts)]
    rng.shuffle(order)
    for index, group in enumerate(order):
        question = f"Question {index}: " + tokens.text(suffix_len, rng)
        prompt = prefixes[group] + "\n" + question
        samples.append(
            SampleRequest(
                prompt=question,
                output_len=output_len,
                prompt_len=tokens.count(prompt),
                system=prefixes[group],
                group=group,
            )
        )
    return samples


def jsonl_dataset(
    path: Path, num_prompts: int, default_output_len: int, tokens: Tokens | None = None
) -> list[SampleRequest]:
    """One JSON object per line: ``prompt`` (str) or ``messages`` (chat), optional
    ``output_len``/``max_tokens``. Lines cycle if the file is shorter than --num-prompts."""
    tokens = tokens or Tokens(None)
    rows: list[SampleRequest] = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not JSON ({error.msg})") from None
            if not isinstance(item, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object")
            out_value = item.get("output_len", item.get("max_tokens", default_output_len))
            if not isinstance(out_value, int) or out_value < 1:
                raise ValueError(f"{path}:{number}: output_len must be a positive integer")
            out = out_value
            if isinstance(item.get("messages"), list):
                text = " ".join(str(m.get("content", "")) for m in item["messages"])
                rows.append(SampleRequest(text, out, tokens.count(text), messages=item["messages"]))
            elif isinstance(item.get("prompt"), str):
                rows.append(SampleRequest(item["prompt"], out, tokens.count(item["prompt"])))
            else:
                raise ValueError(f"{path}:{number}: needs a 'prompt' string or 'messages' list")
    if not rows:
        raise ValueError(f"{path} holds no prompts")
    return [rows[i % len(rows)] for i in range(num_prompts)]
