"""A reference for ``max_mean_load``: how evenly an online balancer that knows
everything up to the moment of each decision could spread a trace's prefill work.

    greedy_max_mean   each request, in trace order, goes to the prefill node whose busy
                      time would be least with it: that node's busy seconds so far plus
                      the request's exact prefill time there (the profile's timing, with
                      the leading blocks that node's cache holds, an LRU of the
                      profile's KV pool in whole trace blocks keyed by prefix); the result is max/mean
                      of the nodes' busy seconds at the end

It knows what no router does (every node's exact busy time, no heartbeat delay) and
weighs cache hits only as the time they save, so it shows how far the trace lets
any online policy even the work out: when single requests take about as long as a
node's whole share (the 130k-token prompts of the long-context preset take 10 s of
an H100 against ~10 s of work per node on the 240-second trace at 64 nodes), even it
stays far from 1. It is no lower bound (a policy that kept nodes free for the big
requests to come could do better), only the classic greedy list scheduler.
Must not talk to a cluster.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from splitserve.deploy.planner.sim_profiles import SimProfile
from splitserve.common.trace import HASH_BLOCK, TraceRequest, prefix_keys


def greedy_max_mean(requests: Sequence[TraceRequest], nodes: int, profile: SimProfile,
                    hash_block: int = HASH_BLOCK) -> float:
    """max/mean busy seconds of the greedy balancer above over ``nodes`` prefill nodes."""
    capacity = max(1, profile.kv_pool_tokens // hash_block)  # whole trace blocks per node
    caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(nodes)]
    busy = [0.0] * nodes
    for r, keys in zip(requests, prefix_keys(requests)):
        full = profile.prefill_seconds(r.input_length)
        best, best_end = 0, busy[0] + full
        for n, cache in enumerate(caches):
            held = _leading(cache, keys)
            seconds = full if not held else profile.prefill_seconds(
                r.input_length, min(held * hash_block, r.input_length - 1))
            if busy[n] + seconds < best_end:
                best, best_end = n, busy[n] + seconds
        busy[best] = best_end
        cache = caches[best]
        for key in keys:  # the whole prompt is in the node's cache once computed
            cache[key] = None
            cache.move_to_end(key)
        while len(cache) > capacity:
            cache.popitem(last=False)
    mean = sum(busy) / nodes
    return round(max(busy) / mean, 3) if mean else 1.0


def _leading(cache: OrderedDict[int, None], keys: Sequence[int]) -> int:
    """How many of ``keys``, from the first, ``cache`` holds."""
    held = 0
    for key in keys:
        if key not in cache:
            break
        held += 1
    return held
