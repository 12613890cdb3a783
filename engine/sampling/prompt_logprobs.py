"""Prompt logprobs (vLLM's ``prompt_logprobs``): how likely the model found each prompt
token given the tokens before it, computed from the prefill's own logits.

    prompt:     t0   t1   t2   ...  t(n-1)
    position:   0    1    2         n-1
    logits row at position p predicts t(p+1); the last row (p = n-1) predicts the
    first generated token and is the sampler's, not ours.

    request.prompt_logprobs = [None, lp(t1 | t0), lp(t2 | t0 t1), ...]   (n entries)

A chunk of positions [start, start + m) fills entries start + 1 .. start + m. A
chunk recomputed after a preemption rewrites its entries, so the list is right
whatever order chunks run in. Prefix-cached blocks have no logits: the scheduler
admits such requests without the prefix cache (scheduler.py).

Cost: the chunk's rows go through the LM head too, so a chunk of C tokens holds
[C, V] float32 logits and their log-softmax at once (the prefill chunk size bounds it:
512 x 128k vocabulary is 256 MiB each).

Must not know about HTTP or scheduling; it turns logits rows into `PromptLogprob`s
with one device-to-host copy per chunk.
"""

from __future__ import annotations

import torch

from ...common.sampling_params import PromptLogprob


def wanted_positions(prompt_len: int, start: int, n: int) -> int:
    """How many of the positions [start, start + n) predict a prompt token (< prompt_len - 1)."""
    return max(0, min(start + n, prompt_len - 1) - start)


def compute(logits: torch.Tensor, targets: list[int], k: int) -> list[PromptLogprob]:
    """`logits` [m, V] float32 at m consecutive positions; `targets` [m] the prompt tokens
    they predict. Logprob, rank (1 = most likely; ties share the best rank) and top k."""
    logprobs = torch.log_softmax(logits, dim=-1)  # [m, V]
    ids = torch.tensor(targets, device=logits.device)[:, None]  # [m, 1]
    chosen = logprobs.gather(1, ids)  # [m, 1]
    rank = (logprobs > chosen).sum(dim=-1, keepdim=True) + 1  # [m, 1]
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (chosen[:, :0], ids[:, :0])  # [m, k]
    packed = torch.cat([chosen.double(), rank.double(), top_values.double(), top_ids.double()],
                       dim=1).tolist()  # [m, 2 + 2k]: the one device-to-host copy
    return [PromptLogprob(row[0], int(row[1]), [(int(t), v) for t, v in zip(row[2 + k:], row[2:2 + k])])
            for row in packed]

