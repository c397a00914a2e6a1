"""Characters per token, learned per model from the engines' own answers.

The approximate prefix index and the load estimates see prompts as text; the engines
count tokens. GIE assumes 4 characters per token, which is wrong by 2-3x for many
tokenizers and prompt styles (this repo's tiny tokenizer averages ~1.5 on English text,
and chat requests are hashed as JSON). Each completed response reports
``usage.prompt_tokens``; with the length of the text the EPP hashed for that request the
ratio ``chars / prompt_tokens`` is one sample. Per model the estimate is the running mean
of the first ``warmup`` samples, then an exponentially weighted mean (``alpha``), so it
settles fast and still follows a change of prompt style.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_CHARS_PER_TOKEN = 4.0


@dataclass(slots=True)
class _Estimate:
    value: float
    samples: int = 0


@dataclass(slots=True)
class TokenCalibration:
    default: float = DEFAULT_CHARS_PER_TOKEN
    alpha: float = 0.05
    warmup: int = 20
    _models: dict[str, _Estimate] = field(default_factory=dict)

    def chars_per_token(self, model: str) -> float:
        estimate = self._models.get(model)
        return estimate.value if estimate is not None and estimate.samples else self.default

    def tokens(self, model: str, chars: int) -> float:
        """Estimated tokens of ``chars`` characters of this model's prompts."""
        return chars / self.chars_per_token(model)

    def observe(self, model: str, chars: int, prompt_tokens: int) -> None:
        """One response: ``chars`` characters of prompt were ``prompt_tokens`` tokens."""
        if chars <= 0 or prompt_tokens <= 0:
            return
        sample = chars / prompt_tokens
        estimate = self._models.get(model)
        if estimate is None:
            if len(self._models) >= 4096:  # bounded: models are few; drop the oldest
                self._models.pop(next(iter(self._models)))
            self._models[model] = _Estimate(sample, 1)
            return
        estimate.samples += 1
        weight = 1.0 / estimate.samples if estimate.samples <= self.warmup else self.alpha
        estimate.value += weight * (sample - estimate.value)

    def samples(self, model: str) -> int:
        estimate = self._models.get(model)
        return estimate.samples if estimate else 0
