"""The routing lab's workloads: seeded request sets plus the fleet they need.

Each preset names a question a user asks before choosing a router:

* ``tight-prefix`` — shared-prefix groups whose prefixes do not all fit in every engine's
  KV cache (12 groups × 2,500 tokens against 600 blocks × 16 tokens per engine): routing
  decides whether caches hold their groups or thrash.
* ``ample-prefix`` — the same groups with the engines' default (large) KV cache.
* ``no-sharing`` — independent prompts: pure load balancing.
* ``multi-turn`` — chat sessions whose prefix grows every turn (a session's turns are sent
  in order, each with the earlier turns and filler assistant answers).
* ``multi-turn-responses`` / ``multi-turn-chat-sessions`` — the same sessions (``multi-turn``'s
  lengths), closed-loop: each turn waits for the previous answer. Through
  ``/v1/responses`` a turn sends only its new input and ``previous_response_id``, so it
  must land on the engine holding the conversation (the lab reports the fraction that
  did); through chat completions it re-sends the whole history.
* ``long-short`` — a few long prompts (3,500 tokens; the tiny model's 4,096-position limit
  rules out 8k) among many short ones.
* ``bursty`` — ``tight-prefix`` with gamma-distributed arrivals of shape 0.25.
* ``heterogeneous`` — ``ample-prefix`` on a fleet whose first engine is 2× slower.
* ``many-adapters`` — requests for 16 LoRA adapters (Zipf-like popularity) on engines with
  4 adapter slots each; bringing an adapter into a slot costs ``--sim-lora-load-ms``
  (25 ms) of step time, and a batch holds at most 4 adapters, so routing decides how
  often engines swap adapters and how long requests wait for a slot.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from infergate.bench.datasets import SampleRequest, Tokens, random_dataset, shared_prefix_dataset

Builder = Callable[[Tokens, int, int], list[SampleRequest]]


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    build: Builder  # (tokens, num_prompts, seed) -> samples
    rates: tuple[float, ...]
    num_prompts: int = 300
    kv_blocks: int | None = None
    burstiness: float = 1.0
    slow_engines: int = 0
    endpoint: str = "/v1/completions"
    extra: dict[str, str] = field(default_factory=dict)
    lora: int = 0  # adapters served by every engine (lora-0 …); requests name them
    max_loras: int = 2  # adapter slots per engine
    engines: int | None = None  # fleet size; None: the lab's --engines
    engine_args: tuple[str, ...] = ()  # extra flags for every engine (e.g. a slower timing model)
    #: "chat" or "responses": the samples are sessions (``group``), sent closed-loop through
    #: that API (:mod:`infergate.bench.routing.sessions`); "": open-loop samples.
    session_api: str = ""
    #: Send offsets (s) of the samples, in order (a trace's timestamps); empty: Poisson
    #: (or gamma, ``burstiness``) arrivals at the row's rate.
    arrivals: tuple[float, ...] = ()


def _shared_prefix(groups: int, prefix: int, suffix: int, output: int) -> Builder:
    def build(tokens: Tokens, n: int, seed: int) -> list[SampleRequest]:
        return shared_prefix_dataset(
            n,
            num_groups=groups,
            prefix_len=prefix,
            suffix_len=suffix,
            output_len=output,
            tokens=tokens,
            seed=seed,
        )

    return build


def _no_sharing(tokens: Tokens, n: int, seed: int) -> list[SampleRequest]:
    return random_dataset(n, 1000, 32, range_ratio=0.5, tokens=tokens, seed=seed)


def _long_short(tokens: Tokens, n: int, seed: int) -> list[SampleRequest]:
    rng = random.Random(seed)
    samples = []
    for index in range(n):
        length = 3500 if rng.random() < 0.15 else 200
        prompt = f"{index}: " + tokens.text(length, rng)
        samples.append(SampleRequest(prompt, 32, tokens.count(prompt)))
    return samples


def _multi_turn(tokens: Tokens, n: int, seed: int) -> list[SampleRequest]:
    """Sessions of up to 8 turns; turn k carries the system prompt and turns 1..k-1."""
    rng = random.Random(seed)
    turns_per_session = 8
    sessions = max(1, n // turns_per_session)
    histories: list[list[dict[str, str]]] = [
        [{"role": "system", "content": f"Session {s}: " + tokens.text(800, rng)}]
        for s in range(sessions)
    ]
    # Interleave sessions: each round sends every live session's next turn.
    samples: list[SampleRequest] = []
    for turn in range(turns_per_session):
        for s in range(sessions):
            if len(samples) >= n:
                break
            history = histories[s]
            history.append({"role": "user", "content": f"Turn {turn}: " + tokens.text(120, rng)})
            samples.append(SampleRequest("", 32, messages=[dict(m) for m in history], group=s))
            history.append({"role": "assistant", "content": tokens.text(32, rng)})
    return samples


SESSION_TURNS = 8


def _sessions(tokens: Tokens, n: int, seed: int) -> list[SampleRequest]:
    """Sessions of 8 turns as ``multi-turn`` has them (an 800-token system prompt, 120-token
    user turns, 32-token answers), one sample per turn with only the turn's own text: the
    session runner carries the history (chat) or chains the turns (responses)."""
    rng = random.Random(seed)
    samples: list[SampleRequest] = []
    for s in range(max(1, n // SESSION_TURNS)):
        system = f"Session {s}: " + tokens.text(800, rng)
        for turn in range(SESSION_TURNS):
            prompt = f"Turn {turn}: " + tokens.text(120, rng)
            samples.append(SampleRequest(prompt, 32, system=system, group=s))
    return samples


def _many_adapters(adapters: int) -> Builder:
    """Independent 200-400-token prompts, each for adapter ``lora-k`` with probability
    proportional to ``1 / (k + 1)`` (a few popular adapters, a long tail)."""

    def build(tokens: Tokens, n: int, seed: int) -> list[SampleRequest]:
        rng = random.Random(seed)
        weights = [1.0 / (k + 1) for k in range(adapters)]
        samples = []
        for index in range(n):
            (k,) = rng.choices(range(adapters), weights)
            prompt = f"{index}: " + tokens.text(rng.randint(200, 400), rng)
            samples.append(SampleRequest(prompt, 32, tokens.count(prompt), model=f"lora-{k}"))
        return samples

    return build


TIGHT_RATES = (10.0, 20.0, 30.0)

WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            "tight-prefix",
            "12 groups sharing 2,500-token prefixes, 600 KV blocks per engine",
            _shared_prefix(12, 2500, 32, 32),
            TIGHT_RATES,
            kv_blocks=600,
        ),
        Workload(
            "ample-prefix",
            "12 groups sharing 2,500-token prefixes, default KV cache",
            _shared_prefix(12, 2500, 32, 32),
            TIGHT_RATES,
        ),
        Workload(
            "no-sharing",
            "independent 500-1,500-token prompts (pure load balancing)",
            _no_sharing,
            (10.0, 20.0, 30.0),
        ),
        Workload(
            "multi-turn",
            "chat sessions of 8 turns, 800-token system prompt, +150 tokens a turn",
            _multi_turn,
            (10.0, 20.0, 30.0),
            endpoint="/v1/chat/completions",
        ),
        Workload(
            "multi-turn-responses",
            "sessions of 8 turns chained with previous_response_id (/v1/responses), each "
            "turn sent after the previous answer",
            _sessions,
            (10.0, 20.0),
            num_prompts=240,
            endpoint="/v1/responses",
            session_api="responses",
        ),
        Workload(
            "multi-turn-chat-sessions",
            "the same sessions through /v1/chat/completions, each turn re-sending the history",
            _sessions,
            (10.0, 20.0),
            num_prompts=240,
            endpoint="/v1/chat/completions",
            session_api="chat",
        ),
        Workload(
            "long-short",
            "15 % 3,500-token prompts among 200-token ones, no sharing",
            _long_short,
            (10.0, 20.0, 30.0),
        ),
        Workload(
            "bursty",
            "tight-prefix with bursty arrivals (gamma shape 0.25)",
            _shared_prefix(12, 2500, 32, 32),
            TIGHT_RATES,
            kv_blocks=600,
            burstiness=0.25,
        ),
        Workload(
            "heterogeneous",
            "ample-prefix on a fleet whose first engine is 2x slower",
            _shared_prefix(12, 2500, 32, 32),
            TIGHT_RATES,
            slow_engines=1,
        ),
        Workload(
            "many-adapters",
            "16 LoRA adapters (Zipf-like popularity), 4 adapter slots per engine",
            _many_adapters(16),
            (10.0, 20.0, 30.0),
            lora=16,
            max_loras=4,
        ),
    )
}
