"""A node's side of "hash once": a request's prompt block hashes are the ones the
router carried (common/protocol.py ``PromptHashes``) when they check out for this
node, else the engine hashes the prompt itself. Both roles take a request's hashes
from here, and each prompt's fate is counted (``PromptHashResult``).

Must not hash a whole prompt (``PromptHashes.adopt`` re-hashes two blocks at most).
"""

from __future__ import annotations

from prometheus_client import Counter

from ..common.config import EngineConfig
from ..common.model_metrics import BoundLabels
from ..common.outcomes import PromptHashResult
from ..common.protocol import PromptHashes


def adopt_prompt_hashes(carried: PromptHashes | None, prompt: list[int], engine: EngineConfig,
                        counter: BoundLabels[Counter], cache_salt: str | None = None) -> list[int] | None:
    """``carried`` as ints when they are ``prompt``'s for this node's block size and
    model and the request's ``cache_salt`` (counted adopted); else None, and the engine
    hashes the prompt with that salt (counted rehashed, or absent when none was carried).
    ``counter``: NodeMetrics.prompt_hashes."""
    hashes = (carried.adopt(prompt, engine.block_size, engine.model_id, cache_salt)
              if carried is not None else None)
    result = (PromptHashResult.ADOPTED if hashes is not None else PromptHashResult.REHASHED
              if carried is not None else PromptHashResult.ABSENT)
    counter.labels(result).inc()
    return hashes
