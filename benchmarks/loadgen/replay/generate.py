"""A generator of multi-tenant shared-prefix traffic in the trace format
(``splitserve make-trace``): system prompts x users x multi-turn conversations.

    tenant t: a system prompt of 1..max_system_blocks whole hash blocks (ids shared by
              every conversation of the tenant; popularity Zipf(zipf_s) over tenants)
    user u:   one of users_per_tenant, with a profile of user_blocks blocks (ids shared
              by every conversation of that user) after the system prompt
    conversation: a user of a tenant; turns ~ Geometric(mean mean_turns); each turn
              sends system prompt + profile + the whole history + a new user message;
              the next turn comes once the answer has streamed (output_length x
              answer_tpot_s) and the user has thought (exponential, mean mean_think_s)
    history blocks: ids private to the conversation and stable across turns, so turn
              k+1 lists turn k's ids (its last, partial block then longer) plus new ones
    documents: with probability doc_share a conversation starts (after the system
              prompt and profile) with one of ``docs`` long documents (whole blocks,
              lognormal around mean_doc_tokens, ids shared by every conversation that
              reads it: a tool-use file or retrieved context)
    tool results: with probability tool_share a turn carries a tool result of
              lognormal(mean_tool_tokens) tokens besides the user message, so
              prompts grow fast over the turns

        turn 1   [sys][sys][usr][c0 ]                 input = sys + profile + user1
        turn 2   [sys][sys][usr][c0 ][c1 ][c2]        ... + user1 + answer1 + user2

Conversations start as a Poisson process (``rate`` per second) for ``duration_s``;
one whose next turn would not fit ``max_context`` tokens ends. Deterministic in
``seed``. Message lengths are lognormal around their means. With ``closed_loop`` each
line also names its conversation and (later turns) the think time before it
(TraceRequest.conversation, think_ms): the replay then sends a turn that long after the
previous answer ended, with the answer's real tokens in its prompt (conversation.py);
the lines are the same either way.

``PRESETS`` names the specs of ``make-trace --preset``, this generator's and the
prefix-group generator's (groups.py), and ``generate`` runs either.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from .groups import GroupSpec, generate_groups
from splitserve.common.trace import HASH_BLOCK, TraceRequest


@dataclass(frozen=True, slots=True)
class TraceSpec:
    tenants: int = 16
    max_system_blocks: int = 4  # system prompts of 1..this many blocks of 512 tokens
    zipf_s: float = 1.0  # tenant popularity ~ 1 / rank**zipf_s
    users_per_tenant: int = 50
    user_blocks: int = 1  # blocks of a user's profile (0: none)
    rate: float = 1.0  # new conversations per second
    duration_s: float = 600.0  # conversations start within this window
    mean_turns: float = 4.0
    mean_user_tokens: int = 300
    mean_output_tokens: int = 150
    mean_think_s: float = 30.0  # between the end of an answer and the next turn
    answer_tpot_s: float = 0.05  # seconds per answer token assumed for the answer's duration
    max_context: int = 7680  # prompt + output tokens of one request at most
    docs: int = 0  # long documents shared between conversations (0: none)
    doc_share: float = 0.0  # share of conversations that start with a document
    mean_doc_tokens: int = 16000
    tool_share: float = 0.0  # share of turns that carry a tool result
    mean_tool_tokens: int = 2000
    length_sigma: float = 0.5  # lognormal sigma of message lengths (documents: twice this)
    seed: int = 0
    closed_loop: bool = False  # write conversation ids and think times (module docstring)

    def __post_init__(self):
        if self.answer_tpot_s < 0:
            raise ValueError(f"answer_tpot_s: must be >= 0, got {self.answer_tpot_s}")
        for name in ("tenants", "max_system_blocks", "users_per_tenant", "mean_user_tokens",
                     "mean_output_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("rate", "duration_s", "mean_think_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if not (0 <= self.doc_share <= 1 and 0 <= self.tool_share <= 1):
            raise ValueError("doc_share and tool_share: must be within [0, 1]")
        if self.doc_share and self.docs < 1:
            raise ValueError("docs: must be >= 1 when doc_share > 0")
        if self.user_blocks < 0:
            raise ValueError(f"user_blocks: must be >= 0, got {self.user_blocks}")
        if self.mean_turns < 1:
            raise ValueError(f"mean_turns: must be >= 1, got {self.mean_turns}")
        if self.max_context < (self.max_system_blocks + self.user_blocks + 2) * HASH_BLOCK:
            raise ValueError(f"max_context: must leave room for a system prompt and a turn, "
                             f"got {self.max_context}")


def generate(spec: TraceSpec | GroupSpec) -> list[TraceRequest]:
    """The trace of ``spec``, sorted by timestamp."""
    if isinstance(spec, GroupSpec):
        return generate_groups(spec)
    rng = np.random.default_rng(spec.seed)
    ids = itertools.count()
    system = [[next(ids) for _ in range(int(rng.integers(1, spec.max_system_blocks + 1)))]
              for _ in range(spec.tenants)]
    profiles: dict[tuple[int, int], list[int]] = {}  # (tenant, user) -> profile ids
    weights = 1.0 / np.arange(1, spec.tenants + 1) ** spec.zipf_s
    weights /= weights.sum()

    def lognormal(mean: float, sigma: float = spec.length_sigma) -> int:
        return max(1, int(rng.lognormal(math.log(mean) - sigma ** 2 / 2, sigma)))

    docs = [[next(ids) for _ in range(-(-lognormal(spec.mean_doc_tokens, 2 * spec.length_sigma) // HASH_BLOCK))]
            for _ in range(spec.docs)]

    out: list[TraceRequest] = []
    t = float(rng.exponential(1.0 / spec.rate))
    conversations = itertools.count()
    while t < spec.duration_s:
        conversation = next(conversations)
        tenant = int(rng.choice(spec.tenants, p=weights))
        user = (tenant, int(rng.integers(spec.users_per_tenant)))
        if user not in profiles:
            profiles[user] = [next(ids) for _ in range(spec.user_blocks)]
        blocks = system[tenant] + profiles[user]  # the conversation's hash ids so far
        if docs and rng.random() < spec.doc_share:
            blocks = blocks + docs[int(rng.integers(len(docs)))]
        length = len(blocks) * HASH_BLOCK  # tokens so far (system prompt, profile, document, history)
        turns = int(rng.geometric(1.0 / spec.mean_turns))
        at, think = t, 0.0
        for _ in range(turns):
            message, answer = lognormal(spec.mean_user_tokens), lognormal(spec.mean_output_tokens)
            if spec.tool_share and rng.random() < spec.tool_share:
                message += lognormal(spec.mean_tool_tokens, 2 * spec.length_sigma)
            prompt = length + message
            if prompt + answer > spec.max_context:
                break
            while len(blocks) * HASH_BLOCK < prompt:
                blocks.append(next(ids))
            out.append(TraceRequest(timestamp=round(at * 1000, 3), input_length=prompt,
                                    output_length=answer, hash_ids=blocks[:-(-prompt // HASH_BLOCK)],
                                    conversation=conversation if spec.closed_loop else None,
                                    think_ms=round(think * 1000, 3) if spec.closed_loop else 0.0))
            length = prompt + answer
            think = float(rng.exponential(spec.mean_think_s))
            at += answer * spec.answer_tpot_s + think
        t += float(rng.exponential(1.0 / spec.rate))
    out.sort(key=lambda r: r.timestamp)
    return out


# Named presets of ``make-trace --preset``. long-context: the input lengths of the
# published long-context production traces (p50 7-12k, p90 27-39k, max ~128k):
# multi-turn conversations whose prompts grow, shared system prompts, shared
# documents and tool results. prefix-groups: ~15k-token prompts in groups sharing 97%
# of them, reused minutes apart, a working set ~3x 16 H100s' KV pools (groups.py).
# chat: below.
PRESETS: dict[str, TraceSpec | GroupSpec] = {
    "default": TraceSpec(),
    # seeds 0 / 1: input p50 10.6k / 9.6k, p90 34.7k / 31.7k, max 92k / 127k tokens
    "long-context": TraceSpec(tenants=16, max_system_blocks=8, users_per_tenant=50, rate=0.5,
                              duration_s=600.0, mean_turns=3.5, mean_user_tokens=400,
                              mean_output_tokens=300, mean_think_s=30.0, max_context=131072,
                              docs=200, doc_share=0.55, mean_doc_tokens=9000, tool_share=0.2,
                              mean_tool_tokens=8000, length_sigma=0.6),
    "prefix-groups": GroupSpec(),
    # chat: multi-turn conversations replayed closed-loop (each turn after the previous answer,
    # whose generated tokens its prompt holds): long chats over short system prompts, some
    # tool results; what a decode node that keeps a conversation's turns can reuse
    "chat": TraceSpec(tenants=16, max_system_blocks=4, users_per_tenant=50, rate=1.0, duration_s=600.0,
                      mean_turns=6.0, mean_user_tokens=200, mean_output_tokens=200, mean_think_s=15.0,
                      max_context=16384, tool_share=0.2, mean_tool_tokens=800, closed_loop=True),
}

