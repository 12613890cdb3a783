"""Does the next turn of a long conversation a decode node holds on its disk tier stall the
node's running decodes? (issue 53) A simulated ``llama3-8b-h100`` decode node (the real
scheduler, block pool, prefix cache, host tier and disk tier with real, authenticated files;
the forward and every tier move priced by the profile: engine/sim_runner.py) runs
``--decodes`` requests; a conversation of ``--history`` tokens it served earlier sits on its
disk tier (pushed down by other prompts), and its next turn, ``--new`` tokens more, arrives.
Three arms, each on a fresh node set up the same way:

    none     the decodes alone
    local    the turn prefilled by the decode node itself (decode-side reuse), its history
             loaded from disk over steps within what a step of the decodes hides
    remote   the turn sent to a prefill node: the decode node reserves its blocks, loading
             of the history what one step may, waits for the rest over the KV transfer
             (``--transfer-steps`` steps), then admits it with its first token

and the router's choice for that turn: the cache_aware policy (the deployment's weights)
over this node's heartbeat (its measured tier rates) and the index's split of the history
by tier, beside an idle prefill node. The figures are the running decodes' inter-token
latency, each step's simulated seconds (every running decode gets one token a step), over
the ``--window`` steps from the turn's arrival: p50, p99, max; target: ITL p99 of the arm
the router chooses within 10% of ``none``'s.

    .venv/bin/python benchmarks/engine/bench_tier_turn.py [--history 10000] [--new 100] [--decodes 16]

Every time is the timing model's (simulated seconds) and the node's rates are what its
runner priced (the engine measures those), so this machine's speed enters no figure; the
one thing it can spoil is the disk writer keeping up: a run whose history did not reach the
disk tier before its turn says so and prints no figure. The node's KV pool and host tier
are smaller than the profile's (``--kv-tokens``, ``--host-tokens``: fewer files to write);
a step's time depends on its batch and contexts, not on the pool's size. Writes
``benchmarks/results/tier_turn.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from splitserve.benchmarks.harness import RESULTS
from splitserve.benchmarks.loadgen.replay.run import percentile
from splitserve.common.config import EngineConfig
from splitserve.common.hashing import hash_blocks
from splitserve.common.kv_events import Tier
from splitserve.common.node_registry import NodeInfo
from splitserve.common.sampling_params import SamplingParams
from splitserve.deploy.planner.sim_profiles import get_deployment, get_profile
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.sim_runner import SimRunner, standin_tiers
from splitserve.router.config import CacheAwareWeights
from splitserve.router.routing.cache_aware import CacheAware
from splitserve.router.routing.tier_cost import TierBlocks

ARMS = ("none", "local", "remote")
TARGET_ITL_P99 = 1.10  # ITL p99 (the router's arm) / ITL p99 (none), at most
SPEEDUP = 1e4  # the sleeps of the timing model shrunk to nothing: the figures are simulated seconds
PRE_STEPS = 20  # decode steps before the turn: the node measures a step of its batch
WRITER_WAIT_S = 120.0  # for the disk writer to store what the setup spills
FILLER_TOKENS = 2048  # each of the prompts that push the history down: 128 blocks, under the writer's queue


class Node:
    """One simulated decode node, set up for an arm (module docstring)."""

    def __init__(self, args: argparse.Namespace, folder: str):
        p = get_profile(args.profile)
        self.bs = p.block_size
        self.engine = EngineCore(standin_tiers(EngineConfig(
            kv_cache_memory=args.kv_tokens * p.kv_bytes_per_token, block_size=p.block_size,
            prefill_chunk_size=p.prefill_chunk_size, max_num_batched_tokens=p.max_num_batched_tokens,
            prefill_step_budget=args.budget, kv_offload_memory=args.host_tokens * p.kv_bytes_per_token,
            kv_offload_dir=folder, kv_offload_disk_bytes=8 * (args.kv_tokens + args.host_tokens) * p.kv_bytes_per_token,
            sim=p.sim_config(speedup=SPEEDUP))))
        self.history = [(7 * j) % 30_000 + 100 for j in range(args.history)]
        self.turn = self.history + [(11 * j) % 30_000 + 100 for j in range(args.new)]
        self.hashes = hash_blocks(self.history, self.bs, self.engine.prompt_ref(self.history).hash_keys)

    def prefill_here(self, rid: str, prompt: list[int]) -> None:
        self.engine.add_request(rid, self.engine.prompt_ref(prompt), SamplingParams(max_tokens=1))
        while self.engine.scheduler.requests.get(rid) is not None:
            self.engine.step()

    def prefilled(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        """``prompt`` as a prefill node's transfer leaves it: reserved, landed, admitted."""
        ref = self.engine.prompt_ref(prompt)
        res = self.engine.reserve(rid, ref)
        assert res is not None, "the KV pool is too small for the benchmark's requests"
        self.engine.add_prefilled(rid, ref, SamplingParams(max_tokens=max_tokens, ignore_eos=True), first_token=5,
                                  logprobs=None, num_cached_tokens=res.num_cached_tokens)

    def setup(self, args: argparse.Namespace) -> bool:
        """The history served and pushed to disk, the rates measured, the decodes running;
        False when the disk writer did not store the history in time."""
        self.prefill_here("history", self.history + [1])  # computed here: the prefill rate
        disk = self.engine.kv.tiers.disk if self.engine.kv.tiers is not None else None
        assert disk is not None
        deadline = time.monotonic() + WRITER_WAIT_S
        filler, i = 0, 0
        while filler < 2 * (args.kv_tokens + args.host_tokens):  # the history: device -> host -> disk
            prompt = [(13 * i + 17 * j) % 30_000 + 100 for j in range(FILLER_TOKENS)]
            self.prefilled(f"filler{i}", prompt, 1)
            self.engine.kv.save_cached()  # its blocks to the host as a step would: 128 spilled at a time
            filler, i = filler + len(prompt), i + 1
            while disk.backlog:  # the blocks it spilled are written before more come (its queue is bounded)
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.002)
        while not all(disk.contains(h) for h in self.hashes[2:]):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        self.prefill_here("warm", self.history[:2 * self.bs] + [2])  # 2 blocks read from disk: the rates
        for d in range(args.decodes):
            prompt = [(19 * d + 23 * j) % 30_000 + 100 for j in range(args.context)]
            self.prefilled(f"d{d}", prompt, PRE_STEPS + args.window + 8)
        for _ in range(PRE_STEPS):
            self.engine.step()
        return True

    def split(self) -> TierBlocks:
        """The history's blocks by the fastest tier holding each (the index's view)."""
        held = self.engine.kv.held_blocks()
        counts = {t: 0 for t in Tier}
        for h in self.hashes:
            if h not in held:
                break
            counts[held[h]] += 1
        return TierBlocks(*(counts[t] for t in Tier))

    def router_path(self, args: argparse.Namespace) -> str:
        """Where cache_aware sends the turn: "local" (this node prefills it) or "remote"."""
        weights = CacheAwareWeights(**get_deployment(args.profile).policy_weights())
        e = self.engine
        me = NodeInfo(node_id="d", role="decode", http_addr="http://d:1", model="m", epoch="e",
                      block_size=self.bs, tiers=list(e.tier_stats()), load=e.load())
        idle = NodeInfo(node_id="p", role="prefill", http_addr="http://p:1", model="m", epoch="e", block_size=self.bs)
        split = self.split()
        decision = CacheAware(weights).choose(self.turn, [idle, me], cached={"d": split.total * self.bs},
                                              tiers={"d": split})
        assert decision is not None
        return "local" if decision.prefill is None else "remote"

    def run_arm(self, arm: str, args: argparse.Namespace) -> dict:
        """The ``window`` steps from the turn's arrival under ``arm``: each step's seconds."""
        e, r = self.engine, self.engine.runner
        assert isinstance(r, SimRunner)
        turn = e.prompt_ref(self.turn)
        if arm == "local":
            e.add_request("turn", turn, SamplingParams(max_tokens=1))
        res = e.reserve("turn", turn) if arm == "remote" else None
        steps: list[float] = []
        ttft = None
        for i in range(args.window):
            if res is not None and i == args.transfer_steps:  # the rest of the KV landed: admitted
                e.add_prefilled("turn", turn, SamplingParams(max_tokens=1), first_token=5, logprobs=None,
                                num_cached_tokens=res.num_cached_tokens)
            before = r.simulated_seconds
            deltas = e.step()
            steps.append(r.simulated_seconds - before)
            if arm == "local" and ttft is None and any(d.request_id == "turn" for d in deltas):
                ttft = sum(steps)
        cached = res.num_cached_tokens if res is not None else None
        return {"itl_p50_ms": round(percentile(steps, 0.5) * 1e3, 3), "itl_p99_ms": round(percentile(steps, 0.99) * 1e3, 3),
                "itl_max_ms": round(max(steps) * 1e3, 3), "steps": len(steps),
                "turn_ttft_ms": None if ttft is None else round(ttft * 1e3, 2),
                "reserved_cached_tokens": cached}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="llama3-8b-h100")
    ap.add_argument("--history", type=int, default=10_000, help="tokens of the conversation on disk")
    ap.add_argument("--new", type=int, default=100, help="the new turn's tokens")
    ap.add_argument("--decodes", type=int, default=16, help="running decodes")
    ap.add_argument("--context", type=int, default=2000, help="each running decode's prompt tokens")
    ap.add_argument("--window", type=int, default=200, help="decode steps measured from the turn's arrival")
    ap.add_argument("--transfer-steps", type=int, default=5, help="remote: steps until the prefill node's KV landed")
    ap.add_argument("--budget", type=int, default=512, help="the decode node's --local-prefill-budget")
    ap.add_argument("--kv-tokens", type=int, default=65536, help="the node's KV pool, tokens")
    ap.add_argument("--host-tokens", type=int, default=65536, help="its host tier, tokens")
    ap.add_argument("--out", default="tier_turn", help="results/<out>.json")
    args = ap.parse_args()
    result: dict = {"command": " ".join(["benchmarks/engine/bench_tier_turn.py", *sys.argv[1:]]),
                    "config": vars(args), "arms": {}}
    for arm in ARMS:
        with tempfile.TemporaryDirectory(prefix="tier-turn-") as folder:
            node = Node(args, folder)
            try:
                if not node.setup(args):
                    result["sustained"] = False
                    result["why"] = f"the disk writer did not store the history within {WRITER_WAIT_S:.0f} s"
                    break
                split = node.split()
                path = node.router_path(args)
                result.update(history_split=split.by_tier(), router_path=path)
                result["arms"][arm] = node.run_arm(arm, args)
                print(f"{arm:>7}: {result['arms'][arm]}", flush=True)
            finally:
                node.engine.close()
    else:
        result["sustained"] = True
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"{args.out}.json"
    if result["sustained"]:
        arms = result["arms"]
        chosen = arms[result["router_path"]]
        ratio = chosen["itl_p99_ms"] / arms["none"]["itl_p99_ms"]
        result["targets"] = {"itl_p99_router_arm_over_none": round(ratio, 3), "met": ratio <= TARGET_ITL_P99}
        print(f"history on the node by tier (blocks): {result['history_split']}; the router sends the turn: "
              f"{result['router_path']}")
        print(f"{'arm':>7} {'ITL p50':>9} {'p99':>9} {'max':>9}  turn TTFT  reserved hit")
        for name, a in arms.items():
            print(f"{name:>7} {a['itl_p50_ms']:7.2f}ms {a['itl_p99_ms']:7.2f}ms {a['itl_max_ms']:7.2f}ms  "
                  f"{a['turn_ttft_ms'] if a['turn_ttft_ms'] is not None else '-':>9}  "
                  f"{a['reserved_cached_tokens'] if a['reserved_cached_tokens'] is not None else '-'}")
        print(f"ITL p99 {result['router_path']} / none: {ratio:.3f} (target <= {TARGET_ITL_P99})")
    else:
        print(f"NOT SUSTAINED: {result['why']}; no figures")
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
