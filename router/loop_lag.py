"""How late the router's event loop runs: the one figure that shows a stall of every
stream at once (a long synchronous step on the loop delays every request's tokens).

A task sleeps ``LAG_PERIOD_S`` again and again and observes how much later than asked
it woke (``splitserve:router_event_loop_lag_seconds``). Owns nothing else; must not
do work on the loop beyond one timer per period.
"""

from __future__ import annotations

import asyncio

from prometheus_client import Histogram

LAG_PERIOD_S = 0.05
# Seconds late. A healthy loop stays under a few ms; 100 ms and more is a stall clients see.
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


async def watch_loop_lag(lag: Histogram, period_s: float = LAG_PERIOD_S) -> None:
    """Observe the loop's lag into ``lag`` every ``period_s``, until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        t0 = loop.time()
        await asyncio.sleep(period_s)
        lag.observe(max(0.0, loop.time() - t0 - period_s))
