"""The lower tiers' load-vs-recompute policy: the rates measured below the device, what they
make a load cost, and whether a load pays.

Owns ``TierPolicy``: the measured rates, each a moving average (``RATE_EWMA``) of what the tier
store measured (loads out of each lower tier, stores into host memory), of what the engine
measured (its prefill's tokens/s, the duration of a step of the running batch alone), or on a
simulated node of what its runner priced (tier_spec.py ``TierSpec.timed_by_runner``); and the
three answers the tier store and the scheduler take from them. Must not: move or measure
anything itself, or touch blocks or tensors.

::

    seconds to load one block found in HOST   block_bytes / host rate
                                       DISK   block_bytes / disk rate + block_bytes / host rate
                                              (read from its file, then copied on as a host block)
    load_tokens(tier)       those seconds x the prefill rate: the prompt tokens the engine computes
                            meanwhile (a rate not measured yet prices its move as recomputing the
                            block, block_size tokens); the scheduler draws a step's loads from its
                            prefill budget in these tokens (kv/cache_manager.py ``lower_plan``)
    load_pays(run)          a lookup's run is taken only when loading it all is expected to take
                            less than recomputing its tokens (nothing measured yet: it pays)
    hidden_load_tokens()    what a step of the running batch hides of its loads, in prompt tokens:
                            its measured duration (loads overlap the forward layer by layer)
"""

from __future__ import annotations

from collections.abc import Sequence

from ...common.kv_events import Tier

RATE_EWMA = 0.2  # weight of the newest measurement in a rate


class _Rate:
    """Bytes (or tokens) per second, a moving average of measurements."""

    def __init__(self) -> None:
        self.value = 0.0  # 0: nothing measured yet

    def add(self, amount: float, seconds: float) -> None:
        if amount <= 0 or seconds <= 0:
            return
        rate = amount / seconds
        self.value = rate if self.value == 0 else (1 - RATE_EWMA) * self.value + RATE_EWMA * rate


class _Mean:
    """Seconds, a moving average of measurements."""

    def __init__(self) -> None:
        self.value = 0.0  # 0: nothing measured yet

    def add(self, seconds: float) -> None:
        if seconds > 0:
            self.value = seconds if self.value == 0 else (1 - RATE_EWMA) * self.value + RATE_EWMA * seconds


class TierPolicy:
    """The rates of one engine's lower tiers and the prices made of them (module docstring)."""

    def __init__(self, block_size: int, block_bytes: int):
        """``block_bytes``: one block of the KV cache, every layer's K and V (what a move carries)."""
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.rates = {Tier.HOST: _Rate(), Tier.DISK: _Rate()}  # loads towards the device, bytes/s
        self.store_rate = _Rate()  # device -> host, bytes/s
        self.prefill_rate = _Rate()  # the engine's, tokens/s
        self.batch_s = _Mean()  # a step of the running batch alone: the loads it hides (``hidden_load_tokens``)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A step computed ``tokens`` prompt tokens in ``seconds``: the recompute rate."""
        self.prefill_rate.add(tokens, seconds)

    def observe_batch(self, seconds: float) -> None:
        """A step of the running batch alone (no prompt tokens, no loads) took ``seconds``."""
        self.batch_s.add(seconds)

    def observe_load(self, tier: Tier, nbytes: int, seconds: float) -> None:
        """A load's move out of ``tier`` took ``seconds`` (a simulated node's runner: the time
        it priced the move at)."""
        self.rates[tier].add(nbytes, seconds)

    def hidden_load_tokens(self) -> float:
        """What a step of the running batch hides of its loads, in prompt tokens: its measured
        duration (loads overlap the forward layer by layer, so loads that take no longer than
        it lengthen it by a layer's share at most); inf while either is unmeasured."""
        if self.batch_s.value == 0 or self.prefill_rate.value == 0:
            return float("inf")
        return self.batch_s.value * self.prefill_rate.value

    def load_tokens(self, tier: Tier) -> float:
        """What loading one block found in ``tier`` costs, in prompt tokens the engine computes
        in the same time: its moves (a disk block is read, then copied on as a host block is)
        at the measured rates times the measured prefill rate. A rate not measured yet prices
        its move as recomputing the block (``block_size`` tokens) until it is."""
        prefill = self.prefill_rate.value
        if prefill == 0:
            return float(self.block_size)
        tokens = 0.0
        for t in (Tier.HOST, Tier.DISK) if tier is Tier.DISK else (Tier.HOST,):
            rate = self.rates[t].value
            tokens += self.block_size if rate == 0 else self.block_bytes / rate * prefill
        return tokens

    def load_pays(self, tiers: Sequence[Tier]) -> bool:
        """Whether loading a run of blocks found in ``tiers`` (one each) is expected to take
        less than recomputing their tokens, by the measured rates (nothing measured yet:
        loading is assumed to pay)."""
        prefill = self.prefill_rate.value
        if not tiers or prefill == 0:
            return bool(tiers)
        load_s = 0.0
        for tier in tiers:
            rates = [self.rates[Tier.HOST].value] + ([self.rates[Tier.DISK].value] if tier is Tier.DISK else [])
            if any(r == 0 for r in rates):
                return True
            load_s += sum(self.block_bytes / r for r in rates)
        return load_s < len(tiers) * self.block_size / prefill
