"""The ``splitserve`` command. Subcommands parse flags into one frozen config and
hand it to the component; nothing here holds state.

    splitserve up                       a local cluster: redis, router, prefill and decode nodes
    splitserve router|prefill|decode    one component (one per machine in production)
    splitserve generate --prompt "..."  offline generation, no servers
    splitserve sim-nodes                many simulated nodes in one process (timing model)
    splitserve make-trace OUT           a multi-tenant shared-prefix routing trace (JSONL)
    splitserve replay TRACE             replay a trace through the router against simulated nodes
    splitserve bench --base-url URL    load-test any OpenAI-compatible endpoint
    splitserve plan                     the cheapest prefill/decode fleet for an SLO and a workload
    splitserve planner                  resize the pools online from the routers' metrics
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import TYPE_CHECKING, Callable, NamedTuple

from .common.config import DEFAULT_LOCAL_PREFILL_BUDGET, LOAD_FORMATS, EngineConfig, Fault, NodeConfig, NodeRole, SimConfig
from .common.kv_backends import BACKENDS_ENV, CUDA_HOST_BACKEND, DEFAULT_BACKEND, backend_names
from .common.plugins import Names
from .deploy.orphan import watch_launcher

if TYPE_CHECKING:
    from aiohttp import web


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="Hugging Face safetensors folder (default: bundled SmolLM2-135M-Instruct)")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model's names; the first is registered for routers to match, labels the "
                        "metrics and keys the block hashes (default: --model as given)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: the model's, capped at a sliding window)")
    g.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                   help="auto/safetensors: the folder's weights; dummy: seeded random weights from its "
                        "config.json alone (e.g. benchmarks/model_configs/llama3-8b)")
    g.add_argument("--kv-cache-memory", default=None,
                   help="memory for the KV block pool, e.g. 512MiB, 2GiB (default 1GiB)")
    g.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                   help="CUDA: fraction of the device's total memory this process may use; the KV pool "
                        "gets what the weights and a profiled activation peak leave of it")
    g.add_argument("--kv-offload-memory", default=None, metavar="SIZE",
                   help="host memory for prefix-cache blocks evicted from the KV pool, e.g. 8GiB "
                        "(pinned on CUDA); a later prompt with that prefix loads them back")
    g.add_argument("--kv-offload-dir", default=None, metavar="DIR",
                   help="a disk tier below host memory: one authenticated file per block here (the "
                        "folder is the node user's alone: made 0700, refused if others may access it), "
                        "reused after a restart by a node of the same model, dtype, layout and key "
                        "($SPLITSERVE_KV_DISK_KEY, else $SPLITSERVE_KV_DISK_KEY_FILE, else DIR/kv-disk.key, "
                        "made once)")
    g.add_argument("--kv-offload-disk-bytes", default=None, metavar="SIZE",
                   help="the disk tier's size, e.g. 100GiB (needs --kv-offload-dir)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--prefill-chunk-size", type=int, default=512)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--threads", type=int, default=None, help="torch threads for this process")
    g.add_argument("--device", default="cpu",
                   help="torch device: cpu, cuda, cuda:1; a tensor-parallel node may list one per rank, "
                        "rank 0's first: cuda:4,cuda:5 (default: rank r on cuda:k+r)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="shard the model over N ranks, one process and one device each (Megatron-style; "
                        "N must split the model's heads); on cpu the ranks share this process's cores")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="a MoE model's experts split whole over the --tensor-parallel-size ranks (each holds "
                        "E/N experts) instead of every expert cut by columns; attention stays tensor-parallel")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                   help="this process is one of N data-parallel ranks of a MoE node: its own requests, "
                        "scheduler and KV pool, the experts split over the N (needs --data-parallel-rank "
                        "and --data-parallel-address)")
    g.add_argument("--data-parallel-rank", type=int, default=0, metavar="R")
    g.add_argument("--data-parallel-address", default=None, metavar="HOST:PORT",
                   help="where rank 0 hosts the data-parallel ranks' rendezvous (the ranks share a host)")
    g.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="weights and KV cache (auto: float32 on cpu, bfloat16 on cuda)")
    g.add_argument("--attention-backend", choices=("auto", "cuda", "triton", "torch"), default="auto",
                   help="auto: CUDA kernels, else Triton, else torch (always torch on cpu)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="no padded static decode and no CUDA graphs: every step runs at its exact shape")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule step N+1 while the device runs step N (default: on for cuda, off on cpu)")
    g.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None, metavar="N",
                   help="decode batch-size buckets (default: 1 2 4 8, then multiples of 8 up to --max-num-seqs)")


def engine_config(args: argparse.Namespace, sim: SimConfig | None = None,
                  prefill_step_budget: int | None = None) -> EngineConfig:
    from .common.bundled import BUNDLED_MODEL_ID
    from .common.config import parse_size

    if args.kv_cache_memory is not None and args.gpu_memory_utilization is not None:
        raise ValueError("give one of --kv-cache-memory and --gpu-memory-utilization")
    model_id = args.served_model_name[0] if args.served_model_name else args.model or BUNDLED_MODEL_ID
    if not model_id.strip():
        raise ValueError("served_model_name: names must be non-empty")
    return EngineConfig(model=args.model, model_id=model_id, max_model_len=args.max_model_len,
                        load_format=args.load_format,
                        kv_cache_memory=parse_size(args.kv_cache_memory or "1GiB"),
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        prefill_chunk_size=args.prefill_chunk_size, prefill_step_budget=prefill_step_budget,
                        enable_prefix_caching=not args.no_prefix_caching, num_threads=args.threads,
                        device=args.device.split(",")[0], dtype=args.dtype, attention_backend=args.attention_backend,
                        enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling,
                        cuda_graph_sizes=tuple(args.cuda_graph_sizes) if args.cuda_graph_sizes else None,
                        tensor_parallel_size=args.tensor_parallel_size,
                        enable_expert_parallel=args.enable_expert_parallel, sim=sim,
                        data_parallel_size=args.data_parallel_size, data_parallel_rank=args.data_parallel_rank,
                        data_parallel_address=args.data_parallel_address,
                        kv_offload_memory=parse_size(args.kv_offload_memory or "0", "kv_offload_memory"),
                        kv_offload_dir=args.kv_offload_dir,
                        kv_offload_disk_bytes=parse_size(args.kv_offload_disk_bytes or "0", "kv_offload_disk_bytes"))


def _add_generate_args(p: argparse.ArgumentParser) -> None:
    _add_engine_args(p)
    p.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat message")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="a stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="one JSON line per prompt")


def cmd_generate(args) -> int:
    from .common.errors import InvalidRequest
    from .common.sampling_params import SamplingParams
    from .engine.llm import LLM

    if "," in args.device:
        raise ValueError("device: a list of devices is for prefill and decode nodes; generate places rank r "
                         "on cuda:k+r for --device cuda:k")
    llm = LLM.from_config(engine_config(args))
    print(f"[splitserve] KV cache holds {llm.engine.kv_capacity_tokens} tokens "
          f"({llm.engine.num_blocks} blocks)", file=sys.stderr)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop or [])
    prompts = args.prompt or ["Tell me a short story about a robot who learns to paint."]
    if args.chat:
        prompts = [[{"role": "user", "content": p}] for p in prompts]
    try:
        outputs = llm.generate(prompts, params)
    except InvalidRequest as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for prompt, out in zip(prompts, outputs):
        if args.json:
            print(json.dumps({"prompt": prompt, "text": out.text, "finish_reason": out.finish_reason,
                              "prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(out.token_ids),
                              "cached_tokens": out.num_cached_tokens}))
        else:
            print(f"--- {prompt if isinstance(prompt, str) else prompt[-1]['content']}\n{out.text}\n"
                  f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]")
    return 0


def _add_node_args(p: argparse.ArgumentParser) -> None:
    from .common.auth import add_cluster_token_args

    g = p.add_argument_group("node")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=0, help="0 picks a free port")
    g.add_argument("--redis-url", default=None,
                   help="node registry and prefix index (default: $SPLITSERVE_REDIS_URL; neither: the node "
                        "is not discoverable); a URL with a password belongs in the environment: flags "
                        "show in `ps`")
    g.add_argument("--node-id", default="")
    g.add_argument("--kv-backend", choices=Names(backend_names), default=DEFAULT_BACKEND, metavar="NAME",
                   help=f"how KV blocks travel: %(choices)s (default %(default)s; a backend of your own: "
                        f"${BACKENDS_ENV}, see README.md)")
    g.add_argument("--transfer-lease", type=float, default=30.0, help="seconds before a transfer fails")
    g.add_argument("--local-prefill-budget", type=int, default=None, metavar="N",
                   help="decode nodes: the most prompt tokens one step computes for the prompts this node "
                        "prefills itself (no prefill node chosen, a fallback), chunked so no step of the "
                        "running batch grows past its decodes plus N; 0: no limit (default "
                        f"{DEFAULT_LOCAL_PREFILL_BUDGET}, or less where --max-num-batched-tokens minus "
                        "--max-num-seqs is less; prefill and colocated nodes ignore it)")
    g.add_argument("--kv-pull-memory", default="256MiB", metavar="SIZE",
                   help="the most bytes this node holds packed for the prefix pulls other nodes ask of it, "
                        "all of them together, e.g. 1GiB (default 256MiB; at least one KV block)")
    g.add_argument("--fault", choices=[f.value for f in Fault], default=None,
                   help=argparse.SUPPRESS)
    add_cluster_token_args(g)
    g.add_argument("--drain-grace", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    g.add_argument("--grammar-compile-timeout", type=float, default=10.0, metavar="S",
                   help="CPU seconds one structured-output grammar may take to compile; past it the "
                        "compile's worker process is killed and the request gets a 400 (too complex)")
    g.add_argument("--grammar-compile-workers", type=int, default=2, metavar="N",
                   help="worker processes compiling structured-output grammars (niced; started on the "
                        "first structured request)")


def node_config(args: argparse.Namespace, role: NodeRole, sim: SimConfig | None = None) -> NodeConfig:
    from .common.auth import cluster_token_from_args, redis_url_from
    from .common.config import parse_size

    devices = tuple(args.device.split(",")) if "," in args.device else ()  # one per rank
    budget = args.local_prefill_budget
    if budget is not None and budget < 0:
        raise ValueError(f"--local-prefill-budget: must be >= 0 (0: no limit), got {budget}")
    if budget is None:  # the default fits the step: an explicit budget that does not is refused
        room = args.max_num_batched_tokens - args.max_num_seqs
        budget = min(DEFAULT_LOCAL_PREFILL_BUDGET, room) if room >= 1 else 0
    # the decode nodes' flag alone: a prefill or colocated node is neither bound nor checked by it
    engine = engine_config(args, sim, prefill_step_budget=(budget or None) if role == "decode" else None)
    return NodeConfig(role=role, engine=engine, host=args.host, port=args.port,
                      redis_url=redis_url_from(args.redis_url), node_id=args.node_id, kv_backend=args.kv_backend,
                      transfer_lease_s=args.transfer_lease, fault=Fault(args.fault) if args.fault else None,
                      kv_pull_memory=parse_size(args.kv_pull_memory, "--kv-pull-memory"),
                      cluster_token=cluster_token_from_args(args),
                      drain_grace_s=args.drain_grace, rank_devices=devices,
                      grammar_compile_timeout_s=args.grammar_compile_timeout,
                      grammar_compile_workers=args.grammar_compile_workers)


def _add_prefill_args(p: argparse.ArgumentParser) -> None:
    _add_engine_args(p)
    _add_node_args(p)


def _add_decode_args(p: argparse.ArgumentParser) -> None:
    _add_prefill_args(p)
    p.add_argument("--colocated", action="store_true", help="prefill every request locally")


def node_app(config: NodeConfig) -> web.Application:
    """The app of ``config``'s role: the one place a node process picks its role (the
    role's package builds on node/, which knows no role)."""
    if config.role == "prefill":
        from .prefill_node.server import build_app
    else:  # decode, colocated
        from .decode_node.server import build_app
    return build_app(config)


def cmd_node(args: argparse.Namespace) -> int:
    from .node.app import run_node

    role: NodeRole = "colocated" if args.command == "decode" and args.colocated else args.command
    return run_node(node_app, node_config(args, role))


def _add_sim_nodes_args(p: argparse.ArgumentParser) -> None:
    _add_engine_args(p)
    _add_node_args(p)
    p.add_argument("--prefill-nodes", type=int, default=4)
    p.add_argument("--decode-nodes", type=int, default=1)
    p.add_argument("--sim-timing", default=None,
                   help="timing-model JSON from benchmarks/engine/fit_timing.py (default: the built-in fit)")
    p.add_argument("--sim-speedup", type=float, default=1.0, help="divide every simulated step by this")
    p.add_argument("--id-prefix", default="sim", help="node ids are <prefix>-<role>-<i>")
    p.add_argument("--profile", default=None, help="a GPU deployment to stand for (deploy/planner/sim_profiles.toml): "
                   "sets context, KV pool, block size, chunking and a roofline timing")
    p.add_argument("--list-profiles", action="store_true", help="print the profiles' derived numbers and exit")


def cmd_sim_nodes(args) -> int:
    from .node.sim_fleet import fleet_configs, run_fleet

    if args.list_profiles:
        from .deploy.planner.sim_profiles import format_profiles, load_profiles
        print(format_profiles(load_profiles()))
        return 0
    sim = SimConfig.load(args.sim_timing, args.sim_speedup)
    if args.profile:  # the profile's model and GPU: context, KV pool, chunking, roofline timing
        from .deploy.planner.sim_profiles import get_profile
        p = get_profile(args.profile)
        sim = p.sim_config(args.sim_speedup)
        args.kv_cache_memory, args.block_size = str(p.kv_pool_bytes), p.block_size
        args.prefill_chunk_size, args.max_num_batched_tokens = p.prefill_chunk_size, p.max_num_batched_tokens
        args.max_num_seqs = p.max_num_seqs
    template = node_config(args, "decode", sim)
    run_fleet(fleet_configs(template, args.prefill_nodes, args.decode_nodes, args.id_prefix), node_app)
    return 0


def _add_make_trace_args(p: argparse.ArgumentParser) -> None:
    from .benchmarks.loadgen.replay.generate import PRESETS

    p.add_argument("out")
    p.add_argument("--preset", choices=sorted(PRESETS), default="default",
                   help="long-context: input p50 ~10k, p90 ~30k, max ~128k tokens (flags below override); "
                        "prefix-groups: ~15k-token prompts in groups sharing 97%%, reused minutes apart, a "
                        "working set ~3x 16 H100s' KV (only --duration and --seed apply)")
    p.add_argument("--tenants", type=int, default=None, help="system prompts")
    p.add_argument("--max-system-blocks", type=int, default=None,
                   help="system prompts have 1..N blocks of 512 tokens")
    p.add_argument("--users-per-tenant", type=int, default=None)
    p.add_argument("--user-blocks", type=int, default=None, help="blocks of a user's profile")
    p.add_argument("--rate", type=float, default=None, help="new conversations per second")
    p.add_argument("--duration", type=float, default=None, help="seconds in which conversations start")
    p.add_argument("--mean-turns", type=float, default=None)
    p.add_argument("--user-tokens", type=int, default=None, help="mean user-message tokens")
    p.add_argument("--output-tokens", type=int, default=None, help="mean answer tokens")
    p.add_argument("--think-time", type=float, default=None, help="mean seconds between turns")
    p.add_argument("--seed", type=int, default=None)


def cmd_make_trace(args) -> int:
    import dataclasses

    from .benchmarks.loadgen.replay.generate import PRESETS, generate
    from .common.trace import dump_trace, summarize

    base = PRESETS[args.preset]
    flags = dict(tenants=args.tenants, max_system_blocks=args.max_system_blocks,
                 users_per_tenant=args.users_per_tenant, user_blocks=args.user_blocks, rate=args.rate,
                 duration_s=args.duration, mean_turns=args.mean_turns, mean_user_tokens=args.user_tokens,
                 mean_output_tokens=args.output_tokens, mean_think_s=args.think_time, seed=args.seed)
    # flags given on the command line override the preset (argparse defaults are None)
    given = {k: v for k, v in flags.items() if v is not None}
    unknown = sorted(set(given) - {f.name for f in dataclasses.fields(base)})
    if unknown:
        raise SystemExit(f"make-trace: --preset {args.preset} has no {', '.join(unknown)}")
    spec = dataclasses.replace(base, **given)
    trace = generate(spec)
    dump_trace(trace, args.out)
    print(json.dumps({"out": args.out, "preset": args.preset, **summarize(trace)}))
    return 0


def _policy_names() -> tuple[str, ...]:
    """--policy's choices: the policy registry's, imported when the flag is checked."""
    from .router.routing.policy_registry import policy_names

    return policy_names()


def _add_replay_args(p: argparse.ArgumentParser) -> None:
    from .router.config import DEFAULT_POLICY, POLICIES_ENV

    p.add_argument("trace", help="JSONL: {timestamp (ms), input_length, output_length, hash_ids}")
    p.add_argument("--prefill-nodes", type=int, default=16)
    p.add_argument("--decode-nodes", type=int, default=None, help="default: prefill nodes / 4")
    p.add_argument("--policy", choices=Names(_policy_names), default=DEFAULT_POLICY, metavar="NAME",
                   help=f"the router's: %(choices)s (default %(default)s; one of your own: ${POLICIES_ENV})")
    p.add_argument("--speedup", type=float, default=10.0, help="trace seconds per wall-clock second")
    p.add_argument("--max-output-tokens", type=int, default=16, help="cap on each request's max_tokens")
    p.add_argument("--kv-cache-memory", default="1GiB", help="per simulated node")
    p.add_argument("--fleet-procs", type=int, default=2, help="processes the simulated nodes share")
    p.add_argument("--sim-timing", default=None, help="timing-model JSON (default: the built-in fit)")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--router-arg", action="append", help="extra router flag (repeatable), e.g. "
                   "--router-arg=--score-weights=prefill_request=16")
    p.add_argument("--result-json", default=None)
    p.add_argument("--profile", default=None, help="simulated nodes stand for this GPU deployment "
                   "(splitserve sim-nodes --list-profiles); replaces --kv-cache-memory and --sim-timing")
    p.add_argument("--trace-block-size", type=int, default=512, help="tokens per hash id in the trace")
    p.add_argument("--kv-offload-memory", default=None, metavar="SIZE",
                   help="per simulated node: a host-memory tier of its prefix cache, in the modelled model's "
                        "bytes (sim-nodes --list-profiles shows each profile's tier sizes)")
    p.add_argument("--kv-offload-disk-bytes", default=None, metavar="SIZE",
                   help="per simulated node: a disk tier below it (in a temporary folder)")


def cmd_replay(args) -> int:
    from .benchmarks.loadgen.replay.run import ReplayConfig, print_summary, run_replay

    result = run_replay(ReplayConfig(
        trace=args.trace, prefill_nodes=args.prefill_nodes, decode_nodes=args.decode_nodes, policy=args.policy,
        speedup=args.speedup, max_output_tokens=args.max_output_tokens, kv_cache_memory=args.kv_cache_memory,
        fleet_procs=args.fleet_procs, sim_timing=args.sim_timing, limit=args.limit,
        router_args=tuple(args.router_arg or ()), result_json=args.result_json,
        profile=args.profile, trace_block_size=args.trace_block_size, kv_offload_memory=args.kv_offload_memory,
        kv_offload_disk_bytes=args.kv_offload_disk_bytes))
    print_summary(result)
    return 0 if result["failed"] == 0 else 1


def _add_router_args(p: argparse.ArgumentParser) -> None:
    from .router.config import add_router_args

    add_router_args(p, policies=Names(_policy_names))


def cmd_router(args) -> int:
    from .router.app import run_router
    from .router.config import router_config

    run_router(router_config(args))
    return 0


def _add_up_args(p: argparse.ArgumentParser) -> None:
    from .deploy.local_redis import RESPONSES_SHARE
    from .router.config import DEFAULT_POLICY, POLICIES_ENV, add_model_args

    p.add_argument("--config", default=None, help="TOML file (default: deploy/local.toml)")
    p.add_argument("--prefill-nodes", type=int)
    p.add_argument("--decode-nodes", type=int)
    p.add_argument("--port", type=int, help="router port")
    p.add_argument("--router-replicas", type=int, default=1,
                   help="routers behind the same Redis, each with its own prefix mirror "
                        "(the first on --port, the others on free ports; all URLs are printed)")
    p.add_argument("--policy", choices=Names(_policy_names), metavar="NAME",
                   help=f"every router's --policy: %(choices)s (default {DEFAULT_POLICY}; one of your own: "
                        f"${POLICIES_ENV})")
    p.add_argument("--kv-backend", choices=Names(backend_names), metavar="NAME",
                   help=f"how KV blocks travel: %(choices)s (default: {CUDA_HOST_BACKEND} when every node "
                        f"runs on CUDA, else deploy/local.toml's; a backend of your own: ${BACKENDS_ENV})")
    p.add_argument("--kv-cache-memory")
    p.add_argument("--threads-per-node", type=int)
    p.add_argument("--cpus", nargs="+", metavar="ROLE=CPUS",
                   help="pin roles to CPUs, e.g. prefill=0 decode=1 router=0 (a pinned node gets "
                        "one torch thread per CPU)")
    p.add_argument("--redis-url", default=None,
                   help="use this Redis instead of starting one (default: $SPLITSERVE_REDIS_URL, else "
                        "start one with a random password); members get it in their environment")
    p.add_argument("--responses-maxmemory", default=None, metavar="SIZE",
                   help=f"the Redis of the routers' stored /v1/responses, one of its own: its maxmemory "
                        f"(volatile-lru; the routers' budget is {RESPONSES_SHARE:.0%}% of it; default: "
                        "deploy/local.toml's, 256MiB)")
    p.add_argument("--startup-timeout", type=float, default=None, metavar="S",
                   help="seconds until every node registered and every router sees them, else stop and "
                        "exit 1 naming who is missing (default: deploy/local.toml's, 180)")
    p.add_argument("--host", default=None, help="bind address of the router and nodes (default: "
                   "deploy/local.toml's, 127.0.0.1)")
    add_model_args(p)
    p.add_argument("--device", default=None, help="every node's device: cpu (default), cuda, cuda:N")
    p.add_argument("--prefill-devices", nargs="+", metavar="DEVICE",
                   help="devices the prefill nodes cycle through, e.g. cuda:0 (default: --device)")
    p.add_argument("--decode-devices", nargs="+", metavar="DEVICE",
                   help="devices the decode nodes cycle through, e.g. cuda:1 (default: --device); a "
                        "tensor-parallel node's entry lists its ranks' devices: cuda:0,cuda:1")
    p.add_argument("--prefill-tp", type=int, default=None, metavar="N",
                   help="ranks per prefill node (its --tensor-parallel-size; default 1)")
    p.add_argument("--decode-tp", type=int, default=None, metavar="N",
                   help="ranks per decode (or colocated) node; any TP that splits the model's KV heads "
                        "pairs with any prefill TP")
    p.add_argument("--local-prefill-budget", type=int, default=None, metavar="N",
                   help="the decode nodes' --local-prefill-budget: prompt tokens per step for the prompts "
                        "they prefill themselves; 0: no limit (default: deploy/local.toml's, 512)")
    p.add_argument("--kv-pull-memory", default=None, metavar="SIZE",
                   help="every node's --kv-pull-memory: the most bytes it holds packed for the prefix pulls "
                        "other nodes ask of it, all together (default: deploy/local.toml's, 256MiB)")
    p.add_argument("--prefill-dp", type=int, default=None, metavar="N",
                   help="data-parallel ranks per prefill node (a MoE model): each rank its own requests and "
                        "KV pool, a node of the pool, the experts split over the N (default 1)")
    p.add_argument("--decode-dp", type=int, default=None, metavar="N",
                   help="data-parallel ranks per decode node, as --prefill-dp")
    p.add_argument("--enable-expert-parallel", action="store_true", default=None,
                   help="every node's --enable-expert-parallel (a MoE model): each pool's EP size is its "
                        "--prefill-tp / --decode-tp, so prefill and decode may differ")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                   help="CUDA: fraction of each GPU its nodes may use, split evenly among them (default 0.9)")
    p.add_argument("--load-format", choices=LOAD_FORMATS, default=None,
                   help="every node's --load-format (default: deploy/local.toml's, auto); dummy: random "
                        "weights from the model folder's config.json")
    p.add_argument("--enforce-eager", action="store_true", default=None,
                   help="every node's --enforce-eager: no CUDA graphs, every step at its exact shape")
    p.add_argument("--kv-offload-memory", default=None, metavar="SIZE",
                   help="every node's host-memory tier for evicted prefix-cache blocks, e.g. 8GiB")
    p.add_argument("--kv-offload-dir", default=None, metavar="DIR",
                   help="a disk tier below it: node <id> keeps its block files in DIR/<id> (kept across "
                        "restarts)")
    p.add_argument("--kv-offload-disk-bytes", default=None, metavar="SIZE",
                   help="each node's disk tier size, e.g. 100GiB")
    p.add_argument("--api-key", action="append", default=None, metavar="'KEY [cache_salt=SALT]'",
                   help="a client key the router requires as 'Authorization: Bearer <key>' on /v1/*, "
                        "optionally with its tenant's cache salt (repeatable; default: "
                        "$SPLITSERVE_API_KEY, one spec per line; none: no authentication); prefer "
                        "--api-key-file or the environment: flags show in `ps`")
    p.add_argument("--api-key-file", default=None,
                   help="file with one 'KEY [cache_salt=SALT]' per line (# comments), readable by its "
                        "owner only; the router gets the keys in an owner-only file of its own")
    p.add_argument("--shared-prefix-cache", action="store_true",
                   help="every router's --shared-prefix-cache: API keys without a cache_salt share one "
                        "prefix cache (default: each key its own)")
    p.add_argument("--planner", action="store_true",
                   help="size the prefill and decode pools from the SLO and the load: start and drain "
                        "nodes (flags --planner-*; docs/planning.md)")
    _add_planner_args(p, "planner-", standalone=False)


def _add_planner_args(p: argparse.ArgumentParser, prefix: str = "", standalone: bool = True) -> None:
    from .deploy.planner.config import add_planner_args

    add_planner_args(p, prefix, standalone)


def cmd_planner(args) -> int:
    from .deploy.planner.config import planner_config
    from .deploy.planner.service import run_planner

    run_planner(planner_config(args))
    return 0


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    from .deploy.planner.offline.cli import add_plan_args

    add_plan_args(p)


def cmd_plan(args) -> int:
    from .benchmarks.loadgen.replay.plan_check import check_plan, pick_speedup
    from .deploy.planner.offline.cli import PlanCheck
    from .deploy.planner.offline.cli import main as plan_main

    return plan_main(args, PlanCheck(pick_speedup, check_plan))


def cmd_up(args) -> int:
    from .deploy.launcher import launch

    return launch(args)


def _add_bench_args(p: argparse.ArgumentParser) -> None:
    from .benchmarks.loadgen.bench.cli import add_bench_args

    add_bench_args(p)


def cmd_bench(args) -> int:
    from .benchmarks.loadgen.bench.cli import main as bench_main

    return bench_main(args)


class Command(NamedTuple):
    """One subcommand: its flags are added by ``add_args`` and ``run`` handles them."""
    name: str
    help: str
    add_args: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS = (
    Command("generate", "generate offline with the engine (no servers)", _add_generate_args, cmd_generate),
    Command("prefill", "run a prefill node", _add_prefill_args, cmd_node),
    Command("decode", "run a decode node", _add_decode_args, cmd_node),
    Command("sim-nodes", "run simulated prefill and decode nodes in one process: real servers, block pool "
            "and scheduler, a timing model in place of the model", _add_sim_nodes_args, cmd_sim_nodes),
    Command("make-trace", "write a multi-tenant shared-prefix routing trace (JSONL)", _add_make_trace_args,
            cmd_make_trace),
    Command("replay", "replay a routing trace through the router against simulated nodes", _add_replay_args,
            cmd_replay),
    Command("router", "run the OpenAI-compatible router", _add_router_args, cmd_router),
    Command("up", "start a local cluster (redis, router, nodes) and serve until Ctrl-C", _add_up_args, cmd_up),
    Command("bench", "benchmark an OpenAI-compatible endpoint: TTFT, TPOT, ITL, E2E percentiles, throughput, "
            "goodput", _add_bench_args, cmd_bench),
    Command("plan", "the cheapest prefill/decode fleet that meets an SLO for a workload (offline, simulated)",
            _add_plan_args, cmd_plan),
    Command("planner", "size the prefill and decode pools online from the routers' metrics and export the "
            "targets for autoscalers (Kubernetes)", _add_planner_args, cmd_planner),
)


def build_parser() -> argparse.ArgumentParser:
    """``splitserve``'s parser: one subparser per command of COMMANDS."""
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help)
        command.add_args(p)
        p.set_defaults(func=command.run)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    watch_launcher()  # a member of a local cluster stops when its launcher is gone (deploy/orphan.py)
    try:
        return args.func(args)
    except ValueError as e:  # configuration errors: say what to change, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
