"""Per-request edits of the logits before penalties and sampling: ``logit_bias`` and
``min_tokens``.

    raw logits [B, V] --> + logit_bias[token] (rows that give one)
                      --> -inf at EOS and stop_token_ids (rows with fewer than
                          min_tokens output tokens, unless nothing else is left: a
                          structured output that is complete allows only EOS, and ends)
                      --> penalties, sampling (sampler.py)

The sampler's logprobs stay those of the raw logits (vLLM's default), so a bias
changes which token is chosen, not the reported probabilities.

Must not mutate its inputs or know about scheduling; the work is one clone and one
scatter per kind of edit, over the entries the requests name (never an O(B * V) mask
built on the host).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from ...common.sampling_params import SamplingParams
from ..upload import upload

_NEG_INF = float("-inf")


class MaskInput(Protocol):
    """What the masks read from a request; the engine's request state has these."""

    sampling_params: SamplingParams
    output_token_ids: list[int]
    stop_ids: frozenset[int]  # EOS (unless ignore_eos) and stop_token_ids


def apply_logit_masks(logits: torch.Tensor, reqs: Sequence[MaskInput]) -> torch.Tensor:
    """`logits` [B, V] float32, row i for ``reqs[i]``. Returns `logits` itself when no
    row has a bias or an unmet min_tokens, else an edited copy."""
    vocab = logits.shape[1]
    bias_rows, bias_cols, bias_values = [], [], []
    min_rows, min_cols = [], []
    for i, r in enumerate(reqs):
        p = r.sampling_params
        for token, value in p.logit_bias.items():  # ids < vocab: checked at admission
            bias_rows.append(i)
            bias_cols.append(token)
            bias_values.append(value)
        if len(r.output_token_ids) < p.min_tokens:
            for token in r.stop_ids:
                if token < vocab:  # a stop id outside the vocabulary is never sampled anyway
                    min_rows.append(i)
                    min_cols.append(token)
    if not bias_rows and not min_rows:
        return logits
    logits = logits.clone()
    device = logits.device
    if bias_rows:
        index = upload([bias_rows, bias_cols], device)  # [2, N]
        values = upload(bias_values, device, logits.dtype)  # [N]
        logits.index_put_((index[0], index[1]), values, accumulate=True)
    if min_rows:
        index = upload([min_rows, min_cols], device)  # [2, M]
        rows = upload(sorted(set(min_rows)), device)
        before = logits[rows]  # [R, V] a copy: put back where masking would leave no token
        logits[index[0], index[1]] = _NEG_INF
        dead = torch.isneginf(logits[rows]).all(dim=1)  # [R]
        logits[rows] = torch.where(dead[:, None], before, logits[rows])
    return logits
