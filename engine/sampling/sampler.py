"""Batched next-token sampling, on whatever device the logits live.

Owns turning one row of logits per request into one token id per request, in this
order (as vLLM by default):

    raw logits --> logprobs (log_softmax of the RAW logits, if requested)
       |
       +--> logit_bias, min_tokens masks (logit_masks.py)
       +--> repetition penalty (prompt + output tokens)
       +--> frequency / presence penalties (output tokens)
       +--> greedy rows: argmax
       +--> random rows: / temperature -> top-k -> top-p -> min-p -> softmax
                         -> argmax(probs / Exponential(1) noise)

Every op runs on the logits' device as batched tensor ops; the host receives one
device-to-host copy per call (the sampled ids, with the logprobs packed in when asked).
``sample`` queues that copy and returns at once (``SampledTokens``: the ids stay on the
device for the next step's inputs); ``SampledTokens.to_host`` waits for it.
Seeded rows draw from their own generators (CPU generators in the engine, so a seed
samples the same tokens on every device) and reach the device in one copy.

Must not know about scheduling, the KV cache, detokenization or stop conditions, and
never mutates its inputs (the logits tensor, the requests or their token lists).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch

from ...common.sampling_params import SamplingParams, TokenLogprobs
from .logit_masks import apply_logit_masks
from ..upload import upload

_NEG_INF = float("-inf")
_TINY = torch.finfo(torch.float32).tiny  # noise floor, see _exponential


class SamplingInput(Protocol):
    """What the sampler reads from a request; the engine's request state has these."""

    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # The request's own generator, seeded from `sampling_params.seed` by the engine;
    # None: the sampler's shared generator.
    generator: torch.Generator | None
    stop_ids: frozenset[int]  # read only for a request with min_tokens (logit_masks.py)


class SamplerOutput(NamedTuple):
    token_ids: list[int]  # [B], one per request, in the order of `reqs`
    logprobs: list[TokenLogprobs | None]  # [B]; None where logprobs were not requested


class SampledTokens:
    """One sampling call's result while the device may still be computing it.

    ``token_ids`` [B] stay on the logits' device (async scheduling feeds them to the next
    step there); the copy to the host was queued when this was made (into pinned memory,
    non-blocking, on a GPU) and ``to_host`` waits for that copy alone."""

    def __init__(self, token_ids: torch.Tensor, packed: torch.Tensor | None,
                 params: list[SamplingParams], lp_rows: list[int]):
        self.token_ids = token_ids  # [B] int64 on the device
        self._params, self._lp_rows = params, lp_rows
        src = token_ids if packed is None else packed  # what the host needs, in one tensor
        self._ready: torch.cuda.Event | None = None
        if src.device.type == "cuda":
            self._host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            self._host.copy_(src, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = src
        self._packed = packed is not None

    def to_host(self) -> SamplerOutput:
        if self._ready is not None:
            self._ready.synchronize()
        values = self._host.tolist()
        if not self._packed:
            return SamplerOutput(values, [None] * len(values))
        return _unpack_logprobs(values, self._params, self._lp_rows)


class Sampler:
    """Samples one token per row of `[B, V]` float32 logits.

    Reproducibility: a request with its own `generator` draws exactly one `[V]`
    block of noise from it per step, so its tokens depend only on its seed, its
    logits and its step, never on the other rows of the batch or their order.
    Requests without a generator share one batched draw from the sampler's own
    generator (one per device, seeded from `seed`, or randomly if None).

    Fast paths: no penalty work unless a row has a penalty (then O(its tokens)
    gathers, not O(V) masks); no sort unless a row has top_p < 1 without a top_k
    (rows with top_k use a topk of the largest k; min-p needs only the row max);
    an all-greedy batch without logprobs is a single argmax.
    """

    def __init__(self, seed: int | None = None):
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}  # device -> shared

    def __call__(self, logits: torch.Tensor, reqs: Sequence[SamplingInput]) -> SamplerOutput:
        """`logits`: [B, V] float32, row i belongs to `reqs[i]`. Params must have
        been validated (`SamplingParams.validate`)."""
        return self.sample(logits, reqs).to_host()

    def sample(self, logits: torch.Tensor, reqs: Sequence[SamplingInput]) -> SampledTokens:
        """As ``__call__``, without waiting for the device."""
        assert logits.dim() == 2 and logits.shape[0] == len(reqs), (logits.shape, len(reqs))
        assert logits.dtype == torch.float32, logits.dtype
        params = [r.sampling_params for r in reqs]
        masked = apply_logit_masks(logits, reqs)  # [B, V]; `logits` itself if no bias or min_tokens
        penalized = apply_penalties(masked, reqs)  # [B, V]; its input itself if no penalty

        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if len(random_rows) == len(reqs):
            token_ids = self._sample(penalized, reqs)  # [B]
        else:
            token_ids = penalized.argmax(dim=-1)  # [B]; ties -> lowest index
            if random_rows:
                at = upload(random_rows, logits.device)  # a device index: a list would stall the stream
                token_ids[at] = self._sample(penalized[at], [reqs[i] for i in random_rows])
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        packed = _pack_logprobs(logits, token_ids, params, lp_rows) if lp_rows else None
        return SampledTokens(token_ids, packed, params, lp_rows)

    @staticmethod
    def skip_step(req: SamplingInput, vocab: int) -> None:
        """Advance ``req.generator`` past one sampling step, as if this sampler had drawn
        its token: a request whose first token was sampled on another node then
        continues the same seeded sequence here."""
        if req.generator is not None and not req.sampling_params.greedy:
            _exponential(torch.empty(vocab, device=req.generator.device), req.generator)

    def _sample(self, logits: torch.Tensor, reqs: Sequence[SamplingInput]) -> torch.Tensor:
        """Random rows only: `logits` [R, V] penalized -> token ids [R] (int64)."""
        params = [r.sampling_params for r in reqs]
        temperature = upload([p.temperature for p in params], logits.device, torch.float32)
        logits = _filter(logits / temperature[:, None], params)  # [R, V]
        probs = logits.softmax(dim=-1)  # [R, V]
        noise = self._exponential_noise(reqs, probs.shape[1], probs.device)  # [R, V]
        return probs.div_(noise).argmax(dim=-1)

    def _exponential_noise(
        self, reqs: Sequence[SamplingInput], vocab: int, device: torch.device
    ) -> torch.Tensor:
        """[R, V] Exponential(1) noise, > 0 (may be inf, which only makes a token
        lose). A seeded row gets one fresh [V] draw from its own generator; the
        other rows share one [S, V] draw from the sampler's generator."""
        noise = torch.empty(len(reqs), vocab, device=device)  # [R, V]
        shared = [i for i, r in enumerate(reqs) if r.generator is None]
        if len(shared) == len(reqs):
            _exponential(noise, self._shared_generator(device))
        elif shared:
            draw = torch.empty(len(shared), vocab, device=device)  # [S, V]
            noise[upload(shared, device)] = _exponential(draw, self._shared_generator(device))
        seeded = [(i, r.generator) for i, r in enumerate(reqs) if r.generator is not None]  # (row, its generator)
        if seeded:
            # each seeded row draws [V] from its own generator, where that generator lives (the
            # engine makes them on the CPU, so a seed gives the same tokens on every device)
            rows = [_exponential(torch.empty(vocab, device=gen.device), gen) for _, gen in seeded]  # [V] each
            noise[upload([i for i, _ in seeded], device)] = upload(torch.stack(rows), device)  # one copy for all
        return noise

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
    Work is O(B * V) for one copy plus O(tokens) gathers and scatters.
    """
    params = [r.sampling_params for r in reqs]
    # rows with a penalty and at least one token to apply it to
    rep_rows = [i for i, (r, p) in enumerate(zip(reqs, params))
                if p.repetition_penalty != 1.0 and (r.prompt_token_ids or r.output_token_ids)]
    freq_rows = [i for i, (r, p) in enumerate(zip(reqs, params))
                 if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0)
                 and r.output_token_ids]
    if not rep_rows and not freq_rows:
        return logits
    logits = logits.clone(memory_format=torch.contiguous_format)
    flat = logits.view(-1)  # [B * V]
    vocab, device = logits.shape[1], logits.device
    if rep_rows:
        ids = _padded([reqs[i].prompt_token_ids + reqs[i].output_token_ids for i in rep_rows],
                      device)  # [R, L]
        pos = _flat_positions(rep_rows, ids.ids, vocab)  # [R, L] indices into `flat`
        penalty = _column([params[i].repetition_penalty for i in rep_rows], device)  # [R, 1]
        values = flat[pos]  # [R, L]; repeated ids read and write the same value
        flat[pos] = torch.where(values > 0, values / penalty, values * penalty)
    if freq_rows:
        ids = _padded([reqs[i].output_token_ids for i in freq_rows], device)  # [F, L]
        counts = torch.zeros(len(freq_rows), vocab, device=device)  # [F, V]
        counts = counts.scatter_add_(1, ids.ids, ids.valid.float()).gather(1, ids.ids)  # [F, L]
        freq = _column([params[i].frequency_penalty for i in freq_rows], device)  # [F, 1]
        presence = _column([params[i].presence_penalty for i in freq_rows], device)  # [F, 1]
        pos = _flat_positions(freq_rows, ids.ids, vocab)  # [F, L]
        flat[pos] = flat[pos] - counts * freq - presence  # every gathered id has count > 0
    return logits


def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Top-k, then top-p over the top-k renormalized probabilities, then min-p, on
    temperature-scaled `logits` [R, V]. Removed tokens become -inf; the most likely
    token always survives. Returns the input when no row filters."""
    vocab = logits.shape[1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]  # vocab: disabled
    if any(k < vocab for k in top_k) or any(p.top_p < 1.0 for p in params):
        logits = _top_k_top_p(logits, top_k, [p.top_p for p in params])
    if any(p.min_p > 0.0 for p in params):
        # p_i < min_p * p_max  <=>  l_i < l_max + log(min_p); log(0) = -inf keeps all
        log_min_p = _column([math.log(p.min_p) if p.min_p > 0 else _NEG_INF for p in params],
                            logits.device)  # [R, 1]
        threshold = logits.max(dim=-1, keepdim=True).values + log_min_p  # [R, 1]
        logits = logits.masked_fill(logits < threshold, _NEG_INF)
    return logits


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """`logits` [R, V]; `top_k` per row (V: disabled); `top_p` per row (1: disabled).

    Candidates are the `width` most likely tokens of each row, best first. When every
    row that filters has a top_k, `width` = its largest top_k and a topk replaces
    the full sort (rows that do not filter are restored from the input):

        candidates [R, width] --top-k: rank >= k--> --top-p: mass before >= p--> kept
    """
    vocab, device = logits.shape[1], logits.device
    active = [k < vocab or p < 1.0 for k, p in zip(top_k, top_p)]
    if all(k < vocab for k, a in zip(top_k, active) if a):
        width = max(k for k, a in zip(top_k, active) if a)
        values, order = logits.topk(width, dim=-1)  # [R, width] each, descending
    else:
        width = vocab
        values, order = logits.sort(dim=-1, descending=True)  # [R, V] each
    ranks = torch.arange(width, device=device)  # [width]
    remove = ranks[None, :] >= upload(top_k, device)[:, None]  # [R, width]
    probs = values.masked_fill(remove, _NEG_INF).softmax(dim=-1)  # renormalized over top-k
    before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely candidates
    p = _column(top_p, device)  # [R, 1]
    remove |= (before >= p) & (p < 1.0)
    kept = torch.full_like(logits, _NEG_INF)  # [R, V]
    kept.scatter_(1, order, values.masked_fill(remove, _NEG_INF))
    if width < vocab and not all(active):
        kept = torch.where(upload(active, device)[:, None], kept, logits)
    return kept


def _pack_logprobs(raw: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams],
                   rows: list[int]) -> torch.Tensor:
    """Token ids [B] plus, for ``rows`` (those that asked), the logprob of the chosen token
    and the top alternatives, from the raw logits ``raw`` [B, V], packed into one float64
    tensor (ids < 2**53 and float32 values convert exactly), so the step still makes one
    device-to-host copy: [B + L + 2 * L * k_max]."""
    at = upload(rows, raw.device)
    logprobs = torch.log_softmax(raw[at], dim=-1)  # [L, V]
    chosen = logprobs.gather(1, token_ids[at][:, None]).squeeze(1)  # [L]
    k_max = min(max(_num_logprobs(params[i]) for i in rows), raw.shape[1])
    top_values, top_ids = logprobs.topk(k_max, dim=-1)  # [L, k_max], best first
    return torch.cat([token_ids.double(), chosen.double(), top_values.double().flatten(),
                      top_ids.double().flatten()])


def _num_logprobs(params: SamplingParams) -> int:
    """Top alternatives a row that asked for logprobs wants (``rows`` hold only those)."""
    assert params.logprobs is not None, "a logprobs row asked for them"
    return params.logprobs


def _unpack_logprobs(packed: list[float], params: list[SamplingParams], rows: list[int]) -> SamplerOutput:
    """The host side of ``_pack_logprobs``."""
    b, n = len(params), len(rows)
    k_max = (len(packed) - b - n) // (2 * n)
    ids = [int(t) for t in packed[:b]]
    chosen_values = packed[b:b + n]
    values_at, ids_at = b + n, b + n + n * k_max
    out: list[TokenLogprobs | None] = [None] * b
    for j, i in enumerate(rows):
        k = _num_logprobs(params[i])
        top_v = packed[values_at + j * k_max: values_at + j * k_max + k]
        top_i = [int(t) for t in packed[ids_at + j * k_max: ids_at + j * k_max + k]]
        out[i] = TokenLogprobs(ids[i], chosen_values[j], list(zip(top_i, top_v)))
    return SamplerOutput(ids, out)


class _Padded(NamedTuple):
    ids: torch.Tensor  # [N, L] int64; row i right-padded with its own first id
    valid: torch.Tensor  # [N, L] bool; False on padding


def _padded(lists: list[list[int]], device: torch.device) -> _Padded:
    """Pad non-empty id lists to one width with each list's first id, so that a
    gather/scatter at a pad position touches a token that row already touches."""
    width = max(len(x) for x in lists)
    ids = upload([x + x[:1] * (width - len(x)) for x in lists], device)
    valid = torch.arange(width, device=device)[None, :] < upload(
        [len(x) for x in lists], device)[:, None]
    return _Padded(ids, valid)


def _flat_positions(rows: list[int], ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Positions of (rows[i], ids[i, j]) in the flattened [B * V] logits: [N, L]."""
    return upload(rows, ids.device)[:, None] * vocab + ids


def _exponential(out: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Fill `out` with Exponential(1) draws -log(U), U ~ Uniform[0, 1) from `gen`
    (on CPU several times faster than `Tensor.exponential_`). Floored at `_TINY`:
    a zero draw would make 0 / 0 = NaN for a filtered token, and argmax picks NaN.
    U = 0 gives inf, which only makes that token lose."""
    return out.uniform_(generator=gen).log_().neg_().clamp_min_(_TINY)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return upload(values, device, torch.float32)[:, None]  # [N, 1]
