"""A fleet of simulated nodes in one process (``splitserve sim-nodes``).

Each node is the real prefill or decode server (HTTP API, KV transport, node registry
heartbeat, prefix-index publisher) over a real engine whose forward pass is the
timing model of ``EngineConfig.sim`` (engine/sim_runner.py). A simulated step is
a sleep on the node's engine thread, so dozens of nodes share one process and one
event loop: how one machine runs 64+ replicas against a real router and Redis.
SIGTERM drains every node of the process as it drains a real node (node/app.py
``drain``: 503 to new work, deregistered, in-flight requests finish within the
drain grace), so a planner scales a simulated pool down as it would a real one.

Owns: one NodeConfig per node (ids ``sim-prefill-<i>``, ``sim-decode-<i>``, plus a
prefix to tell fleets apart; prefill and decode nodes may copy different templates,
e.g. a TP4 prefill profile and a TP8 decode one; the prefix cache's lower tiers sized
in the modelled model's bytes, as the KV cache is, each node's disk tier in a folder of
its own under ``kv_offload_dir``) and their start and stop. Prints
``READY <n> nodes`` once every node serves, then one ``NODE <role> <node_id>
<http_addr>`` line each.
"""

import asyncio
import dataclasses
import logging
import os
from collections.abc import Callable

from aiohttp import web

from ..common.config import NodeConfig, NodeRole
from ..engine.sim_runner import standin_tiers
from .app import RUNTIME, drain, run_until_signal, start_site

log = logging.getLogger(__name__)
AppBuilder = Callable[[NodeConfig], web.Application]  # a node's config -> its role's app (cli.py)


def fleet_configs(template: NodeConfig, prefill_nodes: int, decode_nodes: int,
                  id_prefix: str = "sim", decode_template: NodeConfig | None = None) -> list[NodeConfig]:
    """``template`` (its engine config carrying ``sim``) copied per node, port 0 each;
    the decode nodes copy ``decode_template`` when given (a deployment whose decode
    nodes stand for another profile than its prefill nodes: common/sim_profiles.py).
    Tier sizes are the modelled model's bytes (engine/sim_runner.py ``standin_tiers``)."""
    templates = {"prefill": template, "decode": decode_template or template}
    if any(t.engine.sim is None for t in templates.values()):
        raise ValueError("sim-nodes: the engine config has no timing model (EngineConfig.sim)")
    if prefill_nodes < 0 or decode_nodes < 0 or prefill_nodes + decode_nodes < 1:
        raise ValueError(f"sim-nodes: need at least one node, got {prefill_nodes} prefill and "
                         f"{decode_nodes} decode nodes")
    roles: list[tuple[NodeRole, int]] = ([("prefill", i) for i in range(prefill_nodes)]
                                         + [("decode", i) for i in range(decode_nodes)])
    engines = {role: standin_tiers(t.engine) for role, t in templates.items()}
    configs = []
    for role, i in roles:
        node_id = f"{id_prefix}-{role}-{i}"
        engine = engines[role]
        if engine.kv_offload_dir is not None:
            engine = dataclasses.replace(engine, kv_offload_dir=os.path.join(engine.kv_offload_dir, node_id))
        configs.append(dataclasses.replace(templates[role], role=role, port=0, node_id=node_id, engine=engine))
    return configs


async def serve_fleet(configs: list[NodeConfig], build_app: AppBuilder, stop: asyncio.Event) -> None:
    """Start every node (a few at a time: each registers with Redis), serve until ``stop``.
    ``build_app``: the role's app of each config (the fleet itself knows no role)."""
    runners = []
    gate = asyncio.Semaphore(8)

    async def start(cfg: NodeConfig) -> tuple[web.Application, web.AppRunner]:
        async with gate:
            app = build_app(cfg)
            return app, await start_site(app, cfg)

    try:
        results = await asyncio.gather(*(start(c) for c in configs), return_exceptions=True)
        started = [s for s in results if not isinstance(s, BaseException)]
        runners = [runner for _, runner in started]
        failed = [s for s in results if isinstance(s, BaseException)]
        if failed:
            raise RuntimeError(f"{len(failed)} of {len(configs)} simulated nodes failed to start: {failed[0]!r}")
        print(f"READY {len(configs)} nodes", flush=True)
        for app, _ in started:
            rt = app[RUNTIME]
            print(f"NODE {rt.config.role} {rt.node_id} {rt.http_addr}", flush=True)
        await stop.wait()
        await asyncio.gather(*(drain(app, app[RUNTIME].config.drain_grace_s) for app, _ in started))
    finally:
        await asyncio.gather(*(r.cleanup() for r in runners), return_exceptions=True)


def run_fleet(configs: list[NodeConfig], build_app: AppBuilder) -> None:
    run_until_signal(lambda stop: serve_fleet(configs, build_app, stop))
