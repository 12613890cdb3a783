"""The tokens a simulated node samples (engine/sim_runner.py): a fixed function of the
position, so a client that knows a prompt's length knows the answer a simulated node
gives it, token for token, on any node and any path (a prefill node's first token, a
decode node's later ones, a decode node prefilling alone):

    answer token k of a prompt of n tokens = sim_token(n + k)
    sim_token(p) = 1000 + (p * 7919) mod 20000, stepped past the request's stop ids

Used by the replay's conversations (benchmarks/loadgen/replay/conversation.py), whose
next turn's prompt holds the tokens the node generated. Must not import torch.
"""

from __future__ import annotations

from collections.abc import Collection

_TOKEN_BASE, _TOKEN_SPAN = 1000, 20000  # sampled ids cycle through [1000, 21000)


def sim_token(position: int, stop_ids: Collection[int] = ()) -> int:
    """The token sampled at sequence position ``position`` (the sequence's length before
    it), never one of ``stop_ids``."""
    token = _TOKEN_BASE + (position * 7919) % _TOKEN_SPAN
    while token in stop_ids:
        token += 1
    return token


def sim_answer(prompt_len: int, tokens: int, stop_ids: Collection[int] = ()) -> list[int]:
    """The ``tokens`` ids a simulated node answers a prompt of ``prompt_len`` tokens with."""
    return [sim_token(prompt_len + k, stop_ids) for k in range(tokens)]
