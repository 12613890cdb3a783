"""The runner interface: what EngineCore asks of whatever computes a step, a ModelRunner
(the model on a device; rank 0 of a tensor-parallel node) or a SimRunner (a timing model),
and what both read of a step the same way.

Owns: the contract (``Runner``), a launched step and its landed result, and the split of
a step's rows into the forward's two kinds (``split``). Must not: schedule, sample, or
know which runner it serves.

A step's rows, as a forward lays them out (step_inputs.py)::

    decodes  rows computing one token: one query row each (the decode attention path,
             the static decode buckets of decode_graphs.py)
    chunks   rows computing several: a prompt's chunk, or a row verifying proposed tokens
             (its drafts ride in its queries: attention over its context, causal)

Each row's last ``num_verify`` tokens are sampled (scheduler.py ``Row``), so the number of
tokens a row lands is the scheduler's, not the runner's.
"""

from typing import Callable, NamedTuple, Protocol, Sequence

import torch

from ..common.sampling_params import PromptLogprob, TokenLogprobs
from .kv.cache_manager import KVCacheManager
from .models.config import ModelConfig
from .request import Request
from .sampling.sampler import SampledTokens
from .scheduler import Row, SchedulerOutput


class StepRows(NamedTuple):
    decodes: list[Row]  # rows computing one token, running order
    chunks: list[Row]  # rows computing several, running order


def split(out: SchedulerOutput) -> StepRows:
    """The step's rows by the forward path that computes them (module docstring)."""
    return StepRows([r for r in out.rows if r.num_tokens == 1], [r for r in out.rows if r.num_tokens > 1])


def prompt_tokens(out: SchedulerOutput) -> int:
    """Prompt tokens the step computes (the prefill its time measures the recompute rate by)."""
    return sum(n for req, n in out.scheduled if req.num_computed_tokens < len(req.prompt_token_ids))


class StepResult(NamedTuple):
    # each verifying row with its num_verify sampled tokens and their logprobs
    sampled: list[tuple[Row, list[int], list[TokenLogprobs | None]]]
    num_tokens: int  # tokens computed this step
    # (request, first position, values) of the chunks whose requests asked for prompt logprobs
    prompt_logprobs: Sequence[tuple[Request, int, list[PromptLogprob]]] = ()


class LaunchedStep(NamedTuple):
    """A step queued on the device; ``result()`` waits for its sampled tokens."""
    rows: list[Row]  # those that verify (num_verify > 0), in the order of ``tokens``
    tokens: SampledTokens | None  # each row's num_verify ids, row after row; None when no row verifies
    num_tokens: int
    prompt_logprobs: Sequence[tuple[Request, int, list[PromptLogprob]]] = ()

    @property
    def requests(self) -> list[Request]:
        """The requests of ``rows``."""
        return [r.request for r in self.rows]

    def result(self) -> StepResult:
        if self.tokens is None:
            return StepResult([], self.num_tokens, self.prompt_logprobs)
        out = self.tokens.to_host()
        sampled, at = [], 0
        for row in self.rows:
            sampled.append((row, out.token_ids[at:at + row.num_verify], out.logprobs[at:at + row.num_verify]))
            at += row.num_verify
        return StepResult(sampled, self.num_tokens, self.prompt_logprobs)


class Runner(Protocol):
    """Computes the steps of one engine; the engine thread alone calls it, one step at a time."""

    model_config: ModelConfig  # the model it serves (a simulated node: with the profile's context)
    num_blocks: int  # KV blocks the block pool hands out (a runner's scratch block is beyond them)
    # [num_layers, 2 (K, V), blocks, block_size, kv_heads, head_dim]: what transfers and tiers read and write
    kv_caches: torch.Tensor
    overrun_s: float  # wall seconds its steps ran beyond their modelled time (a simulated node; 0 else)

    def expert_load(self) -> dict[int, float]:
        """MoE layer -> max / mean tokens per expert in its latest forward (models/moe.py); {} for a
        dense or simulated model. Copies from the device, waiting for the queued step: call it seldom."""
        ...

    def launch(self, out: SchedulerOutput, kv: KVCacheManager,
               ready: Callable[[], None] | None = None) -> LaunchedStep:
        """Queue one forward over ``out.rows`` and the sampling of every row's last
        ``num_verify`` tokens; return without waiting for them unless the runner cannot
        overlap (``LaunchedStep.result()`` waits). The step's lower-tier loads
        (``kv.take_loads()``) are its own to issue before the forward reads them; a step of
        no rows only issues them (a prompt loading a long run, nothing else to run:
        scheduler.py). ``ready`` is called before the forward, where what it queues finds the
        blocks the step reads in place, loaded ones included."""
        ...
