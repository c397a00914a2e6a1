"""Token sampling: penalties, logit bias, min_tokens, greedy, temperature, top-k, top-p,
min-p, and per-request seeds — each a batched tensor op; Python only builds index lists.

Seeded requests draw their noise from their own generator, re-seeded each step from
(seed, num_generated): a token depends only on the request's own logits, seed and
position — never on which other requests share the batch, and a request recomputed after
preemption samples the same tokens again. Sampling uses the exponential-race form
(argmax of p / E, E ~ Exp(1)), equivalent to drawing from p, with no host sync.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .interfaces import SamplingParams, TokenLogprob

_GREEDY_EPS = 1e-5
_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads (seed, step) over generator seeds


def step_seed(seed: int, step: int) -> int:
    return (seed * _MIX + step) % (1 << 63)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask (to -inf) everything outside each row's top-k and top-p nucleus.

    `top_k` [B] int64 (>= vocab means off), `top_p` [B] float (1.0 means off). Ties at the
    k-th value are all kept; the nucleus always keeps the most likely token.
    """
    if top_k is None and top_p is None:
        return logits
    vals, idx = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        kth = vals.gather(-1, (vocab - top_k.clamp(1, vocab)).unsqueeze(-1))
        vals = vals.masked_fill(vals < kth, float("-inf"))
    if top_p is not None:
        cum = vals.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1.0 - top_p).unsqueeze(-1)
        drop[:, -1] = False
        vals = vals.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, idx, vals)


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Presence, frequency (output tokens) and repetition (prompt + output) penalties.

    Counts come from one scatter_add over the padded id lists of the whole batch (pad =
    an extra vocabulary column, dropped); rows without penalties are no-ops.
    """
    rows = [i for i, p in enumerate(params) if p.needs_history]
    if not rows:
        return logits
    dev, vocab = logits.device, logits.shape[-1]

    def counts(lists: list[Sequence[int]]) -> torch.Tensor:
        width = max((len(x) for x in lists), default=0)
        ids = torch.full((len(lists), max(width, 1)), vocab, dtype=torch.int64)
        for r, x in enumerate(lists):
            if x:
                ids[r, : len(x)] = torch.tensor(list(x), dtype=torch.int64)
        out = torch.zeros(len(lists), vocab + 1, device=dev)
        out.scatter_add_(1, ids.to(dev), torch.ones(ids.shape, device=dev))
        return out[:, :vocab]

    index = torch.tensor(rows, dtype=torch.int64, device=dev)
    sub = logits[index]
    out_counts = counts([outputs[i] for i in rows])
    seen = (out_counts + counts([prompts[i] for i in rows])) > 0
    rep = torch.tensor([params[i].repetition_penalty for i in rows], device=dev).unsqueeze(-1)
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    freq = torch.tensor([params[i].frequency_penalty for i in rows], device=dev).unsqueeze(-1)
    pres = torch.tensor([params[i].presence_penalty for i in rows], device=dev).unsqueeze(-1)
    sub = sub - freq * out_counts - pres * (out_counts > 0).float()
    logits = logits.clone()
    logits[index] = sub
    return logits


def apply_bias_and_blocks(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    blocked: Sequence[Sequence[int]],
) -> torch.Tensor:
    """`logit_bias` (added) and blocked ids (-inf), as one scatter each over the batch."""
    bias_rows, bias_cols, bias_vals, block_rows, block_cols = [], [], [], [], []
    for i, p in enumerate(params):
        for token, value in p.logit_bias:
            bias_rows.append(i)
            bias_cols.append(token)
            bias_vals.append(value)
        for token in blocked[i]:
            block_rows.append(i)
            block_cols.append(token)
    if not bias_rows and not block_rows:
        return logits
    logits = logits.clone()
    dev = logits.device
    if bias_rows:
        r = torch.tensor(bias_rows, dtype=torch.int64, device=dev)
        c = torch.tensor(bias_cols, dtype=torch.int64, device=dev)
        logits.index_put_((r, c), torch.tensor(bias_vals, device=dev), accumulate=True)
    if block_rows:
        r = torch.tensor(block_rows, dtype=torch.int64, device=dev)
        c = torch.tensor(block_cols, dtype=torch.int64, device=dev)
        logits[r, c] = float("-inf")
    return logits


def bad_word_blocks(
    bad_words: Sequence[Sequence[int]], output_ids: Sequence[int]
) -> tuple[int, ...]:
    """Token ids a request may not sample next: for each banned sequence w, its last
    token when ``output[-(len(w)-1):] == w[:-1]`` (always, for a one-token word)."""
    out = []
    for word in bad_words:
        prefix = len(word) - 1
        if prefix == 0 or (
            len(output_ids) >= prefix and list(output_ids[-prefix:]) == list(word[:-1])
        ):
            out.append(word[-1])
    return tuple(out)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero tokens whose probability is under min_p x the row's top probability."""
    top = probs.max(dim=-1, keepdim=True).values
    return probs.masked_fill(probs < min_p.unsqueeze(-1) * top, 0.0)


class Sampler:
    """Samples one token per row; holds per-request generators until `release`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._generators: dict[str, torch.Generator] = {}

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._generators)

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        request_ids: Sequence[str],
        num_generated: Sequence[int],
    ) -> list[int]:
        """logits [B, V] (already through :meth:`process`) → B token ids, row i sampled
        with params[i]'s temperature, top-k, top-p, min-p and seed."""
        logits = logits.float()
        greedy = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if p.temperature > _GREEDY_EPS]
        if not random_rows:
            return greedy.tolist()
        dev = logits.device
        sub = logits[random_rows]
        sub_params = [params[i] for i in random_rows]
        temps = torch.tensor([p.temperature for p in sub_params], device=dev)
        sub = sub / temps.unsqueeze(-1)
        vocab = sub.shape[-1]
        top_k = top_p = None
        if any(0 < p.top_k < vocab for p in sub_params):
            ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in sub_params]
            top_k = torch.tensor(ks, dtype=torch.int64, device=dev)
        if any(p.top_p < 1.0 for p in sub_params):
            top_p = torch.tensor([p.top_p for p in sub_params], device=dev)
        probs = apply_top_k_top_p(sub, top_k, top_p).softmax(dim=-1)
        if any(p.min_p > 0 for p in sub_params):
            probs = apply_min_p(probs, torch.tensor([p.min_p for p in sub_params], device=dev))
        noise = torch.empty_like(probs).exponential_()
        for row, i in enumerate(random_rows):
            seed = params[i].seed
            if seed is not None:
                gen = self._generator(request_ids[i])
                gen.manual_seed(step_seed(seed, num_generated[i]))
                noise[row].exponential_(generator=gen)
        picked = (probs / noise).argmax(dim=-1)
        greedy[random_rows] = picked
        return greedy.tolist()

    @staticmethod
    def process(
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        prompts: Sequence[Sequence[int]] | None = None,
        outputs: Sequence[Sequence[int]] | None = None,
        blocked: Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor:
        """Bias and blocks, then penalties (vLLM's order): the logits temperature divides."""
        logits = logits.float()
        empty: list[Sequence[int]] = [()] * len(params)
        logits = apply_bias_and_blocks(logits, params, blocked or empty)
        return apply_penalties(logits, params, prompts or empty, outputs or empty)

    @staticmethod
    def logprobs(
        logits: torch.Tensor, temperatures: Sequence[float], chosen: Sequence[int], top_n: int
    ) -> list[TokenLogprob]:
        """Logprob, rank and top-`top_n` of `chosen[i]` in row i, over the whole batch at once.

        Rows are scaled by their temperature (greedy rows, temperature ~0, are left raw):
        the distribution sampled from, before top-k/top-p masking.
        """
        if logits.shape[0] == 0:
            return []
        temps = torch.tensor(
            [t if t > _GREEDY_EPS else 1.0 for t in temperatures], device=logits.device
        )
        lp = (logits.float() / temps.unsqueeze(-1)).log_softmax(dim=-1)
        ids = torch.tensor(list(chosen), dtype=torch.int64, device=logits.device).unsqueeze(-1)
        picked = lp.gather(-1, ids)
        ranks = (lp > picked).sum(dim=-1) + 1
        picked_l, ranks_l = picked.squeeze(-1).tolist(), ranks.tolist()
        if top_n > 0:
            vals, idx = lp.topk(min(top_n, lp.shape[-1]), dim=-1)
            tops = [tuple(zip(i, v, strict=True)) for i, v in zip(idx.tolist(), vals.tolist(),
                                                                  strict=True)]  # fmt: skip
        else:
            tops = [() for _ in chosen]
        return [
            TokenLogprob(int(t), float(p), int(r), top)
            for t, p, r, top in zip(chosen, picked_l, ranks_l, tops, strict=True)
        ]

    def _generator(self, request_id: str) -> torch.Generator:
        gen = self._generators.get(request_id)
        if gen is None:
            gen = self._generators[request_id] = torch.Generator(device=self.device)
        return gen
