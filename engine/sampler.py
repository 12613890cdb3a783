"""Batched next-token sampling, on whatever device the logits live.

Owns turning one row of logits per request into one token id per request, in this
order (as vLLM by default):

    raw logits --> logprobs (log_softmax of the RAW logits, if requested)
       |
       +--> repetition penalty (prompt + output tokens)
       +--> frequency / presence penalties (output tokens)
       +--> greedy rows: argmax
       +--> random rows: / temperature -> top-k -> top-p -> min-p -> softmax
                         -> argmax(probs / Exponential(1) noise)

Must not know about scheduling, the KV cache, detokenization or stop conditions, and
never mutates its inputs (the logits tensor, the requests or their token lists).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch

from splitserve.common.sampling_params import SamplingParams, TokenLogprobs

_NEG_INF = float("-inf")
# Noise floor: Exponential(1) draws can be exactly 0, and 0/0 would be NaN (which
# argmax picks). With this floor every probs / noise is finite in float32.
_TINY = torch.finfo(torch.float32).tiny


class SamplingInput(Protocol):
    """What the sampler reads from a request; the engine's request state has these."""

    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # The request's own generator, seeded from `sampling_params.seed` by the engine;
    # None: the sampler's shared generator.
    generator: torch.Generator | None


class SamplerOutput(NamedTuple):
    token_ids: list[int]  # [B], one per request, in the order of `reqs`
    logprobs: list[TokenLogprobs | None]  # [B]; None where logprobs were not requested


class Sampler:
    """Samples one token per row of `[B, V]` float32 logits.

    Reproducibility: a request with its own `generator` draws exactly one `[V]`
    block of noise from it per step, so its tokens depend only on its seed, its
    logits and its step, never on the other rows of the batch or their order.
    Requests without a generator share one batched draw from the sampler's own
    generator (one per device, seeded from `seed`, or randomly if None).

    Fast paths: no penalty work unless a row has a penalty; no sort unless a row
    has top_p < 1 (top-k alone uses topk, min-p needs only the row max); an
    all-greedy batch without logprobs is a single argmax.
    """

    def __init__(self, seed: int | None = None):
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}  # device -> shared

    def __call__(self, logits: torch.Tensor, reqs: Sequence[SamplingInput]) -> SamplerOutput:
        """`logits`: [B, V] float32, row i belongs to `reqs[i]`. Params must have
        been validated (`SamplingParams.validate`)."""
        assert logits.dim() == 2 and logits.shape[0] == len(reqs), (logits.shape, len(reqs))
        assert logits.dtype == torch.float32, logits.dtype
        params = [r.sampling_params for r in reqs]
        penalized = apply_penalties(logits, reqs)  # [B, V]; `logits` itself if no penalty

        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if len(random_rows) == len(reqs):
            token_ids = self._sample(penalized, reqs)  # [B]
        else:
            token_ids = penalized.argmax(dim=-1)  # [B]; ties -> lowest index
            if random_rows:
                sampled = self._sample(penalized[random_rows], [reqs[i] for i in random_rows])
                token_ids[random_rows] = sampled
        return SamplerOutput(token_ids.tolist(), _logprobs(logits, token_ids, params))

    def _sample(self, logits: torch.Tensor, reqs: Sequence[SamplingInput]) -> torch.Tensor:
        """Random rows only: `logits` [R, V] penalized -> token ids [R] (int64)."""
        params = [r.sampling_params for r in reqs]
        temperature = torch.tensor([p.temperature for p in params], device=logits.device)
        logits = _filter(logits / temperature[:, None], params)  # [R, V]
        probs = logits.softmax(dim=-1)  # [R, V]
        noise = self._exponential_noise(reqs, probs.shape[1], probs.device)  # [R, V]
        return probs.div_(noise).argmax(dim=-1)

    def _exponential_noise(
        self, reqs: Sequence[SamplingInput], vocab: int, device: torch.device
    ) -> torch.Tensor:
        """[R, V] Exponential(1) noise, floored at `_TINY`. A seeded row gets one
        fresh [V] draw from its own generator; the other rows share one draw."""
        noise = torch.empty(len(reqs), vocab, device=device)  # [R, V]
        shared = [i for i, r in enumerate(reqs) if r.generator is None]
        if shared:
            gen = self._shared_generator(device)
            if len(shared) == len(reqs):
                noise.exponential_(generator=gen)
            else:
                noise[shared] = torch.empty(len(shared), vocab, device=device).exponential_(
                    generator=gen
                )
        for i, req in enumerate(reqs):
            gen = req.generator
            if gen is not None:
                row = torch.empty(vocab, device=gen.device).exponential_(generator=gen)  # [V]
                noise[i] = row.to(device)
        return noise.clamp_min_(_TINY)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed)
            self._generators[device] = gen
        return gen


def apply_penalties(logits: torch.Tensor, reqs: Sequence[SamplingInput]) -> torch.Tensor:
    """Repetition, then frequency and presence penalties; `logits` is [B, V].

    Returns `logits` itself when no row has a penalty, else a new tensor:
      repetition (HF/CTRL), tokens in prompt + output: l / r if l > 0 else l * r
      frequency / presence (OpenAI), output tokens:   l - count * f - (count > 0) * p
    """
    params = [r.sampling_params for r in reqs]
    rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    freq_rows = [
        i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
    ]
    if not rep_rows and not freq_rows:
        return logits
    logits = logits.clone()
    vocab, device = logits.shape[1], logits.device
    if rep_rows:
        ids = _padded([reqs[i].prompt_token_ids + reqs[i].output_token_ids for i in rep_rows],
                      pad=vocab, device=device)  # [R, L]; pad id V lands in a dropped column
        seen = torch.zeros(len(rep_rows), vocab + 1, dtype=torch.bool, device=device)
        seen = seen.scatter_(1, ids, True)[:, :vocab]  # [R, V]
        penalty = _column([params[i].repetition_penalty for i in rep_rows], device)  # [R, 1]
        rows = logits[rep_rows]  # [R, V]
        penalized = torch.where(rows > 0, rows / penalty, rows * penalty)
        logits[rep_rows] = torch.where(seen, penalized, rows)
    if freq_rows:
        ids = _padded([reqs[i].output_token_ids for i in freq_rows], pad=vocab, device=device)
        counts = torch.zeros(len(freq_rows), vocab + 1, device=device)  # [F, V + 1]
        counts = counts.scatter_add_(1, ids, torch.ones(ids.shape, device=device))[:, :vocab]
        freq = _column([params[i].frequency_penalty for i in freq_rows], device)  # [F, 1]
        presence = _column([params[i].presence_penalty for i in freq_rows], device)  # [F, 1]
        logits[freq_rows] -= counts * freq + (counts > 0).float() * presence
    return logits


def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Top-k, then top-p, then min-p on temperature-scaled `logits` [R, V]: removed
    tokens become -inf. The most likely token always survives. May return the input."""
    num_rows, vocab = logits.shape
    device = logits.device
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]  # vocab: disabled
    need_k = any(k < vocab for k in top_k)
    need_p = any(p.top_p < 1.0 for p in params)
    if need_p:  # one descending sort serves both top-k and top-p
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [R, V] each
        ranks = torch.arange(vocab, device=device)  # [V]
        remove = ranks[None, :] >= torch.tensor(top_k, device=device)[:, None]  # [R, V]
        probs = sorted_logits.masked_fill(remove, _NEG_INF).softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # [R, V] mass of strictly more likely tokens
        top_p = _column([p.top_p for p in params], device)  # [R, 1]; 1.0 rows keep all
        remove |= (before >= top_p) & (top_p < 1.0)
        remove = torch.zeros_like(remove).scatter_(1, order, remove)  # back to vocab order
        logits = logits.masked_fill(remove, _NEG_INF)
    elif need_k:  # top-k alone: threshold at the k-th largest logit, no full sort
        k_max = max(k for k in top_k if k < vocab)
        ks = torch.tensor(top_k, device=device)  # [R]
        top_values = logits.topk(k_max, dim=-1).values  # [R, k_max], descending
        kth = top_values.gather(1, (ks.clamp(max=k_max) - 1)[:, None])  # [R, 1]
        kth = kth.masked_fill((ks == vocab)[:, None], _NEG_INF)  # disabled rows keep all
        logits = logits.masked_fill(logits < kth, _NEG_INF)
    if any(p.min_p > 0.0 for p in params):
        # p_i < min_p * p_max  <=>  l_i < l_max + log(min_p); log(0) = -inf keeps all
        log_min_p = _column([math.log(p.min_p) if p.min_p > 0 else _NEG_INF for p in params],
                            device)  # [R, 1]
        threshold = logits.max(dim=-1, keepdim=True).values + log_min_p  # [R, 1]
        logits = logits.masked_fill(logits < threshold, _NEG_INF)
    return logits


def _logprobs(
    raw: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams]
) -> list[TokenLogprobs | None]:
    """Logprobs of the chosen tokens and the top alternatives, from the raw logits
    `raw` [B, V]; `token_ids` [B]. None for rows that did not ask."""
    out: list[TokenLogprobs | None] = [None] * len(params)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return out
    logprobs = torch.log_softmax(raw[rows], dim=-1)  # [L, V]
    chosen_ids = token_ids[rows]  # [L]
    chosen = logprobs.gather(1, chosen_ids[:, None]).squeeze(1).tolist()  # [L]
    k_max = min(max(params[i].logprobs for i in rows), raw.shape[1])
    top_values, top_ids = logprobs.topk(k_max, dim=-1)  # [L, k_max], best first
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    for j, (i, token_id) in enumerate(zip(rows, chosen_ids.tolist())):
        k = params[i].logprobs
        out[i] = TokenLogprobs(token_id, chosen[j], list(zip(top_ids[j][:k], top_values[j][:k])))
    return out


def _padded(lists: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """[N, max(1, longest)] int64, each list right-padded with `pad`."""
    width = max(1, max(len(x) for x in lists))
    return torch.tensor([x + [pad] * (width - len(x)) for x in lists], device=device)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)[:, None]  # [N, 1]
