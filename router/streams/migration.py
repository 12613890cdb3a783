"""Mid-stream migration (``--migration-limit N``): what continues a generation on
another decode node when its node dies, in the same client stream.

A decode node breaks a request's token stream when the connection fails or is
reset, the body ends before the finishing frame, a frame is bad, or no frame comes
for ``--node-read-timeout`` (`NodeUnavailable`). The generation (generation.py)
then, in one straight line::

    Generation.pieces      the leg's stream raises NodeUnavailable
    Generation._migrate    under the limit? build the continuation (here)
    Generation.new_leg     end the broken leg (stream closed, an abort sent in case the
                           node is only hung, slots freed, decision settled as failed),
                           record its node as failed, open the continuation through
                           the normal dispatch path (Dispatcher.open: policy, prefill
                           node, KV transfer) avoiding every failed node, make it the
                           current leg
    Generation.pieces      reads on from the new leg

The continuation of the k-th migration::

    prompt      = the client's prompt + every token already received
    max_tokens  = the original max_tokens - those tokens
    request id  = "<choice's id>~m<k>" (fresh on every node)
    structured outputs: the grammar resumes past those tokens (``resume_token_ids``)
    everything else in SamplingParams unchanged

The `Generation` keeps its detokenizer, counts and client stream: the client sees
one stream (same id, one role chunk, no token twice, usage counting every token of
every leg, the prompt's cached tokens those of the first leg), and a stop string
split across the boundary still matches. At most ``limit`` migrations per
generation; after that, or when no node takes the new leg, the stream ends with the
clean mid-stream error as without migration. A node that reports a failure itself
(an error frame) is not migrated from: the request, not the node, may be at fault.

What holds for the continuation (the tokens after the migration point):
- greedy: the greedy continuation of prompt + the tokens received, which equals the
  uninterrupted output as far as the prefill of those tokens computes the same
  logits as their decode steps did (fp32 on CPU: token-exact in
  tests/test_migration.py; lower precisions may flip a near tie).
- ``seed``: reproducible for the same migration point, but not the uninterrupted
  run's tokens: the new node seeds the request's generator afresh instead of
  continuing its draws.
- ``presence_penalty`` / ``frequency_penalty`` count output tokens only, so after a
  migration they no longer see the tokens before it (they are prompt tokens now);
  ``repetition_penalty`` covers prompt + output and is unaffected.

Owns the continuation rule. Must not choose nodes (dispatch.py), hold a generation's
state or detokenize (generation.py).
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec

from ...common.sampling_params import SamplingParams
from ..prompt import Prompt


class Continuation(NamedTuple):
    """The request a generation's next leg sends to its decode node."""

    request_id: str
    prompt: Prompt
    params: SamplingParams


def continuation(request_id: str, k: int, prompt: Prompt, params: SamplingParams,
                 output_ids: list[int]) -> Continuation | None:
    """The request of the ``k``-th migration (k >= 1) of the generation ``request_id``
    of ``prompt`` with ``params``, after it received ``output_ids``. None when every
    token already arrived (only the finishing frame did not): nothing to continue."""
    remaining = params.max_tokens - len(output_ids)
    if remaining < 1:
        return None
    new = msgspec.structs.replace(params, max_tokens=remaining)
    so = params.structured_outputs
    if so is not None:  # the new node's grammar starts past the tokens already streamed
        new.structured_outputs = msgspec.structs.replace(
            so, resume_token_ids=so.resume_token_ids + output_ids)
    return Continuation(f"{request_id}~m{k}", prompt.extended(output_ids), new)
