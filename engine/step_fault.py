"""``--fault step_error`` (tests only): an engine whose step raises twice, each time it computes a
prompt while another request runs: a bug in one step, not a rank's death (engine_thread.py
fails that step's requests and goes on).

The first error is raised as the forward begins (before any of its collectives), the second as
it enters the model's last MoE layer (the model's forward again on a dense model): on a
data-parallel rank, after the forward's first collectives (``begin_forward`` and the earlier
MoE layers' exchange), where its peers wait in the next one. ranks/data_parallel.py: how the
failing rank completes the forward either way. Must not: run unless asked (the node arms it
from its ``--fault``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .runner import Runner
    from .scheduler import Scheduler

class InjectedStepError(RuntimeError):
    """What the armed step raises (an ordinary exception: not a ``TPFailure``)."""


def arm_step_fault(runner: Runner, scheduler: Scheduler) -> None:
    """Make an engine's next two forwards (its ``runner``'s) of more than one token, while two or
    more requests are in its ``scheduler``, raise ``InjectedStepError``: the first before the
    forward begins, the second inside it. Call before the engine thread owns the engine: the
    hooks run on that thread."""
    from .model_runner import ModelRunner
    from .models.moe import MoEBlock

    assert isinstance(runner, ModelRunner), "--fault step_error: a simulated node runs no forward"
    model = runner.model
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    fired = 0  # errors raised so far

    def hook(error: int):
        def raise_once(module, args) -> None:
            nonlocal fired
            if fired == error and args[0].shape[0] > 1 and len(scheduler.requests) >= 2:
                fired += 1
                raise InjectedStepError(f"injected step error {fired} of 2 (--fault step_error)")
        return raise_once

    model.register_forward_pre_hook(hook(0))
    (blocks[-1] if blocks else model).register_forward_pre_hook(hook(1))
