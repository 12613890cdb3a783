"""Mid-stream migration (``--migration-limit N``): a generation whose decode node dies
continues on another decode node, in the same client stream.

When a decode node breaks a request's token stream (the connection fails or is
reset, the body ends before the finishing frame, a bad frame, or no frame for
``--node-read-timeout``: `NodeUnavailable`), `Migrator.migrate` ends that leg (its
stream closed, an abort sent in case the node is only hung, its slots freed, its
routing decision settled as failed) and routes a new request through the normal
dispatch path (`Dispatcher.open`: policy, prefill node, KV transfer), the failed
node excluded::

    prompt      = the client's prompt + every token already received from the old leg
    max_tokens  = the original max_tokens - those tokens
    request id  = "<choice's id>~m<k>" for the k-th migration (fresh on every node)
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

Must not choose nodes (dispatch.py) or detokenize (generation.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec

from ..common.sampling_params import SamplingParams
from .errors import ApiError
from .generation import Generation, Leg
from .metrics import RouterMetrics
from .node_client import NodeUnavailable
from .prompt import Prompt

log = logging.getLogger(__name__)

# (request id, prompt, params, loop time sent, decode node ids to avoid) -> the new leg
OpenLeg = Callable[[str, Prompt, SamplingParams, float, frozenset[str]], Awaitable[Leg]]


@dataclass(frozen=True, slots=True)
class Migrator:
    open_leg: OpenLeg  # Dispatcher.open
    limit: int  # migrations per generation (>= 1; 0 is no Migrator at all)
    metrics: RouterMetrics

    async def migrate(self, gen: Generation, error: NodeUnavailable) -> bool:
        """Move ``gen`` to a new leg after its current one failed with ``error``.
        False when the limit is reached, every token already arrived, or no node
        took the new leg: the caller then fails the generation (its close() ends
        whatever leg it holds)."""
        failed = gen.leg.decision.decode
        if gen.migrations >= self.limit:
            log.warning("router: %s: not migrated (limit %d reached): %s", gen.request_id,
                        self.limit, error)
            return False
        remaining = gen.params.max_tokens - gen.completion_tokens
        if remaining < 1:  # every token arrived, only the finishing frame did not
            return False
        gen.end_leg()
        gen.failed_nodes += (failed.node_id,)
        request_id = f"{gen.request_id}~m{gen.migrations + 1}"
        params = msgspec.structs.replace(gen.params, max_tokens=remaining)
        so = gen.params.structured_outputs
        if so is not None:  # the new node's grammar starts past the tokens already streamed
            params.structured_outputs = msgspec.structs.replace(
                so, resume_token_ids=so.resume_token_ids + gen.output_ids)
        try:
            leg = await self.open_leg(request_id, gen.prompt.extended(gen.output_ids), params,
                                      asyncio.get_running_loop().time(), frozenset(gen.failed_nodes))
        except ApiError as e:
            log.warning("router: %s: migration off %s failed (%s) after: %s", gen.request_id,
                        failed.node_id, e.message, error)
            return False
        gen.migrations += 1
        gen.leg = leg
        self.metrics.migrations.inc()
        log.info("router: %s migrated from %s to %s after %d tokens (%s)", gen.request_id,
                 failed.node_id, leg.decision.decode.node_id, gen.completion_tokens, error)
        return True
