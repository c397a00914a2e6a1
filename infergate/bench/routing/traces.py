"""Trace replay for the routing lab: production request traces in Mooncake's format.

A trace (``../shared/traces/README.md``) is JSON lines of ``timestamp`` (ms from the
trace's start), ``input_length``, ``output_length`` and ``hash_ids``: the ids of the
prompt's 512-token blocks, equal ids meaning identical content (the last block may be
partial). The lab replays a window of it: each request is sent at its own timestamp
(divided by ``--trace-speedup``) with a prompt built from its block ids, so two requests
sharing a leading run of ids share exactly that prefix of tokens, and every router gets
the same request list on a fresh fleet.

Prompts are made of *single-token words* of the lab's tokenizer: vocabulary entries
``" word"`` that encode to exactly one id and, being whole pre-tokens of a byte-level
BPE, never merge with their neighbours. A block id seeds the choice of its words, so a
block is always the same ``block_tokens`` tokens, and a prompt of ``n`` tokens is exactly
``n`` tokens in the engines' tokenizer (plus the BOS the engine adds to every prompt).

``--trace-scale F`` replays every length times F (a 512-token block becomes 512·F
tokens) on engines whose timing profile runs at ``--sim-token-scale F``: each simulated
token then costs what 1/F real tokens cost and the KV cache holds F times fewer, so a
request's modelled prefill and decode time, and the prefill-to-decode ratio, are the
full-scale ones, with F times less work for this machine's CPU.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from infergate.bench.datasets import _WORDS, SampleRequest, Tokens
from infergate.bench.routing.workloads import Workload
from infergate.engine.sim_runner import PROFILES, TimingModel
from infergate.options import inherit, option

#: Tokens in one of the trace's blocks (Mooncake's block size).
TRACE_BLOCK_TOKENS = 512
#: The engines' KV block size in a replay (vLLM's default).
ENGINE_BLOCK_SIZE = 16
#: Fewest distinct single-token words a tokenizer must offer for block text.
MIN_WORDS = 16


class TraceError(ValueError):
    """A trace file that is not in the format; the message names the file and line."""


@dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _field_int(row: dict[str, object], name: str, low: int) -> int:
    value = row.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name!r} must be a whole number >= {low}, not {value!r}")
    return value


def parse_line(text: str) -> TraceRequest:
    """One trace line (ValueError saying which field is wrong)."""
    try:
        row = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"not JSON ({error.msg})") from None
    if not isinstance(row, dict):
        raise ValueError("not a JSON object")
    stamp = row.get("timestamp")
    if isinstance(stamp, bool) or not isinstance(stamp, int | float) or stamp < 0:
        raise ValueError(f"'timestamp' must be a number of ms >= 0, not {stamp!r}")
    length = _field_int(row, "input_length", 1)
    output = _field_int(row, "output_length", 0)
    ids = row.get("hash_ids")
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in ids
    ):
        raise ValueError("'hash_ids' must be a list of whole numbers")
    blocks = math.ceil(length / TRACE_BLOCK_TOKENS)
    if len(ids) != blocks:
        raise ValueError(
            f"{len(ids)} hash_ids for {length} input tokens (expected {blocks} blocks "
            f"of {TRACE_BLOCK_TOKENS})"
        )
    return TraceRequest(float(stamp), length, output, tuple(ids))


def read_trace(path: Path) -> list[TraceRequest]:
    """Every request of a trace file, in time order (TraceError naming file and line)."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise TraceError(f"{path}: cannot read the trace ({error})") from None
    requests = []
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            requests.append(parse_line(text))
        except ValueError as error:
            raise TraceError(f"{path}:{number}: {error}") from None
    if not requests:
        raise TraceError(f"{path}: no requests")
    return sorted(requests, key=lambda r: r.timestamp_ms)  # stable: ties keep file order


@dataclass(frozen=True)
class Window:
    """``seconds`` of trace time from ``start_s``; ``seed`` when a seed chose it."""

    start_s: float
    seconds: float
    seed: int | None = None

    @property
    def label(self) -> str:
        return f"{self.start_s:g}s+{self.seconds:g}s"


def parse_windows(items: Sequence[str]) -> list[Window]:
    """``--trace-window START:SECONDS`` values (ValueError naming the bad one)."""
    windows = []
    for item in items:
        start, sep, seconds = item.partition(":")
        try:
            window = Window(float(start), float(seconds))
        except ValueError:
            raise ValueError(f"{item!r} is not START:SECONDS") from None
        if not sep or window.start_s < 0 or window.seconds <= 0:
            raise ValueError(f"{item!r} is not START:SECONDS (START >= 0, SECONDS > 0)")
        windows.append(window)
    return windows


def window_for_seed(trace: Sequence[TraceRequest], seconds: float, seed: int) -> Window:
    """The window a seed picks: a start uniform over the trace's span, from its first
    request to its last (whole ms), so that the window lies inside it; from the first
    request if the trace is shorter than ``seconds``. A trace cut from a longer one keeps
    its timestamps (the first may be minutes in): the span starts at its first request,
    not at 0."""
    first = trace[0].timestamp_ms / 1000.0
    room = max(0.0, trace[-1].timestamp_ms / 1000.0 - first - seconds)
    start = round(first + random.Random(seed).uniform(0.0, room), 3)
    return Window(start, seconds, seed)


def in_window(trace: Sequence[TraceRequest], window: Window) -> list[TraceRequest]:
    low = window.start_s * 1000.0
    high = low + window.seconds * 1000.0
    return [r for r in trace if low <= r.timestamp_ms < high]


def _scale(value: float) -> float:
    if (
        not 0 < value <= 1
        or abs(TRACE_BLOCK_TOKENS * value - round(TRACE_BLOCK_TOKENS * value)) > 1e-9
    ):
        raise ValueError(
            f"{value:g} must be in (0, 1] with {TRACE_BLOCK_TOKENS} x F a whole number "
            "of tokens (1, 0.5, 0.25, 0.125, ...)"
        )
    return value


def _positive(value: float) -> float:
    if not value > 0:
        raise ValueError(f"{value:g} is not > 0")
    return value


@dataclass(frozen=True)
class TraceOptions:
    """``bench routing``'s trace options (joined to the command, declared only here)."""

    trace: Path | None = option(
        "--trace",
        default=None,
        help="Replay a request trace in Mooncake's format (JSON lines of timestamp ms, "
        "input_length, output_length, hash_ids of 512-token blocks) instead of presets.",
    )
    windows: list[str] = option(
        "--trace-window",
        default_factory=list,
        help="A window of the trace to replay, START:SECONDS of trace time (repeat).",
    )
    seeds: list[int] = option(
        "--trace-seed",
        default_factory=list,
        help="A seed that picks one window of --trace-window-seconds at random (repeat). "
        "Without --trace-window or --trace-seed, --trace-windows seeds are drawn and printed.",
    )
    count: int = option(
        "--trace-windows", default=1, min=1, help="How many seeds to draw when none is given."
    )
    window_seconds: float = option(
        "--trace-window-seconds",
        default=60.0,
        convert=_positive,
        help="Length of a window a seed picks, in seconds of trace time.",
    )
    speedup: float = option(
        "--trace-speedup",
        default=1.0,
        convert=_positive,
        help="Send the window this many times faster than traced (timestamps / X).",
    )
    scale: float = option(
        "--trace-scale",
        default=1.0,
        convert=_scale,
        help="Replay every length times F on engines whose tokens each cost 1/F real ones "
        "(--sim-token-scale F): the modelled timing and prefill-to-decode ratio stay those "
        "of full scale, with F times less CPU work. 1 (full scale) by default.",
    )
    max_output: int | None = option(
        "--trace-max-output",
        default=None,
        min=1,
        help="Cap every request's output at N traced tokens (before --trace-scale).",
    )
    profile: str = inherit(
        TimingModel,
        "profile",
        "--gpu-profile",
        default="h100-llama3.1-8b",
        help="The simulated GPU and model of a --trace replay's engines: {help}",
    )


class BlockText:
    """Block ids to prompt text of an exact token count in the lab's tokenizer."""

    def __init__(self, tokens: Tokens, block_tokens: int = TRACE_BLOCK_TOKENS) -> None:
        self.tokens = tokens
        self.block_tokens = block_tokens
        self.words = single_token_words(tokens)
        self._blocks: dict[int, list[str]] = {}

    def block(self, block_id: int) -> list[str]:
        """The block's words (each one token), the same for the same id."""
        words = self._blocks.get(block_id)
        if words is None:
            rng = random.Random(block_id)
            words = rng.choices(self.words, k=self.block_tokens)
            self._blocks[block_id] = words
        return words

    def prompt(self, hash_ids: Sequence[int], n_tokens: int) -> str:
        """``n_tokens`` tokens: whole blocks, then the first tokens of the last one."""
        if not 0 < n_tokens <= len(hash_ids) * self.block_tokens:
            raise ValueError(f"{n_tokens} tokens do not fit {len(hash_ids)} blocks")
        parts: list[str] = []
        left = n_tokens
        for block_id in hash_ids:
            words = self.block(block_id)
            parts.append("".join(words[:left]))
            left -= min(left, self.block_tokens)
        return "".join(parts)


def single_token_words(tokens: Tokens) -> list[str]:
    """``" word"`` strings each encoding to exactly one token (shortest first, so prompts
    stay small in bytes); with no tokenizer the lab counts words, so any word is one."""
    if tokens.tokenizer is None:
        return [" " + w for w in sorted(set(_WORDS))]
    tok = tokens.tokenizer
    found = []
    for token_id in range(tok.get_vocab_size()):
        text = tok.decode([token_id])
        if len(text) < 2 or text[0] != " " or not (text[1:].isascii() and text[1:].isalpha()):
            continue
        if tok.encode(text, add_special_tokens=False).ids == [token_id]:
            found.append(text)
    words = sorted(set(found), key=lambda w: (len(w), w))[:64]
    joined = "".join(words * 2)
    if len(words) < MIN_WORDS or len(tok.encode(joined, add_special_tokens=False).ids) != 2 * len(
        words
    ):
        raise ValueError(
            "the lab's tokenizer has too few single-token words that keep apart when "
            "joined; trace prompts cannot have exact lengths with it"
        )
    return words


@dataclass(frozen=True)
class Replay:
    """How a window is replayed: speed-up, length scale and output cap."""

    speedup: float = 1.0
    scale: float = 1.0
    max_output: int | None = None

    @property
    def block_tokens(self) -> int:
        return round(TRACE_BLOCK_TOKENS * self.scale)

    def lengths(self, request: TraceRequest) -> tuple[int, int]:
        """The replayed (input, output) tokens: every block scaled, the last partial one
        rounded up; the output capped (traced tokens), then scaled (at least 1)."""
        last = request.input_length - (len(request.hash_ids) - 1) * TRACE_BLOCK_TOKENS
        inp = (len(request.hash_ids) - 1) * self.block_tokens + math.ceil(last * self.scale)
        out = request.output_length
        if self.max_output is not None:
            out = min(out, self.max_output)
        return inp, max(1, round(out * self.scale))


def samples(
    requests: Sequence[TraceRequest], replay: Replay, text: BlockText
) -> list[SampleRequest]:
    out = []
    for request in requests:
        inp, output = replay.lengths(request)
        out.append(SampleRequest(text.prompt(request.hash_ids, inp), output, inp))
    return out


def engine_args(profile: str, replay: Replay, max_model_len: int) -> tuple[str, ...]:
    """The engines' flags: the profile at the replay's scale, with vLLM's batching
    defaults for that GPU (the token budget scaled like every length)."""
    gpu = PROFILES[profile].gpu
    return (
        f"--sim-profile={profile}",
        f"--sim-token-scale={replay.scale:g}",
        f"--block-size={ENGINE_BLOCK_SIZE}",
        f"--max-num-batched-tokens={max(ENGINE_BLOCK_SIZE, round(gpu.max_num_batched_tokens * replay.scale))}",
        f"--max-num-seqs={gpu.max_num_seqs}",
        f"--max-model-len={max_model_len}",
    )


def window_workload(
    name: str, trace: Sequence[TraceRequest], window: Window, replay: Replay, profile: str
) -> Workload:
    """One window as a lab workload: its requests at their traced offsets, one rate (the
    window's mean), and engines with the profile at the replay's scale."""
    requests = in_window(trace, window)
    if not requests:
        raise TraceError(f"{name}: no requests in window {window.label}")
    start_ms = window.start_s * 1000.0
    arrivals = tuple((r.timestamp_ms - start_ms) / 1000.0 / replay.speedup for r in requests)
    longest = max(sum(replay.lengths(r)) for r in requests) + 1  # the engine's BOS
    max_len = math.ceil(longest / ENGINE_BLOCK_SIZE) * ENGINE_BLOCK_SIZE

    def build(tokens: Tokens, n: int, seed: int) -> list[SampleRequest]:
        return samples(requests[:n], replay, BlockText(tokens, replay.block_tokens))

    rate = round(len(requests) / (window.seconds / replay.speedup), 2)
    seed = f", seed {window.seed}" if window.seed is not None else ""
    return Workload(
        f"{name}@{window.label}",
        f"{len(requests)} requests of {name} from {window.label}{seed}, scale "
        f"{replay.scale:g}, speed-up {replay.speedup:g}, output cap "
        f"{replay.max_output or 'none'}, {profile}",
        build,
        (rate,),
        num_prompts=len(requests),
        engine_args=engine_args(profile, replay, max_len),
        arrivals=arrivals,
    )


def prefix_ceiling(requests: Sequence[TraceRequest]) -> float:
    """The share of blocks an infinite cache would hit (a block seen before, in order)."""
    seen: set[int] = set()
    hits = total = 0
    for request in requests:
        for block_id in request.hash_ids:
            total += 1
            hits += block_id in seen
            seen.add(block_id)
    return hits / total if total else 0.0
