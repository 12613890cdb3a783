"""A node's side of "hash once": the one place a node builds a request's ``PromptRef``
(common/prompt_ref.py) from the wire, with its own model id as the model key and the
request's other keys as they came. Its block hashes are the ones the sender carried when
they check out for this node, else the engine hashes the prompt itself (on the engine
thread, once). Both roles, and a pull's holder, read their prompts here; each request's
fate of the carried hashes is counted (``PromptHashResult``).

Must not hash a whole prompt (``PromptHashes.adopt`` re-hashes two blocks at most).
"""

from __future__ import annotations

from prometheus_client import Counter

from ..common.config import EngineConfig
from ..common.model_metrics import BoundLabels
from ..common.outcomes import PromptHashResult
from ..common.prompt_ref import PromptRef, WirePrompt


def read_prompt(wire: WirePrompt, engine: EngineConfig) -> PromptRef:
    """``wire`` as this node's ``PromptRef``; InvalidRequest("token_ids") when its bytes are
    not u32 token ids."""
    return PromptRef.from_wire(wire, engine.model_id, engine.block_size)


def count_hashes(ref: PromptRef, wire: WirePrompt, counter: BoundLabels[Counter]) -> None:
    """Count what became of the hashes ``wire`` carried for ``ref``: adopted, rehashed (they
    did not check out), or absent (none came). ``counter``: NodeMetrics.prompt_hashes."""
    counter.labels(PromptHashResult.ADOPTED if ref.adopted else PromptHashResult.REHASHED
                   if wire.hashes is not None else PromptHashResult.ABSENT).inc()
