"""The ``splitserve`` command. Subcommands parse flags into one frozen config and
hand it to the component; nothing here holds state.

    splitserve up                       a local cluster: redis, router, prefill and decode nodes
    splitserve router|prefill|decode    one component (one per machine in production)
    splitserve generate --prompt "..."  offline generation, no servers
    splitserve bench --base-url URL    load-test any OpenAI-compatible endpoint
"""

import argparse
import logging
import json
import sys


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="Hugging Face safetensors folder (default: bundled SmolLM2-135M-Instruct)")
    g.add_argument("--kv-cache-memory", default="1GiB", help="memory for the KV block pool, e.g. 512MiB, 2GiB")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--prefill-chunk-size", type=int, default=512)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--threads", type=int, default=None, help="torch threads for this process")


def engine_config(args):
    from splitserve.common.config import EngineConfig, parse_size

    return EngineConfig(model=args.model, kv_cache_memory=parse_size(args.kv_cache_memory),
                        block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        prefill_chunk_size=args.prefill_chunk_size,
                        enable_prefix_caching=not args.no_prefix_caching, num_threads=args.threads)


def cmd_generate(args) -> int:
    from splitserve.common.errors import InvalidRequest
    from splitserve.common.sampling_params import SamplingParams
    from splitserve.engine.llm import LLM

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
    g = p.add_argument_group("node")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=0, help="0 picks a free port")
    g.add_argument("--redis-url", default=None, help="registry; without it the node is not discoverable")
    g.add_argument("--node-id", default="")
    g.add_argument("--kv-backend", choices=("tcp", "shm", "ucx"), default="tcp")
    g.add_argument("--transfer-lease", type=float, default=30.0, help="seconds before a transfer fails")
    g.add_argument("--fault", choices=("corrupt_block",), default=None, help=argparse.SUPPRESS)


def cmd_node(args) -> int:
    from splitserve.common.config import NodeConfig
    from splitserve.node.runtime import run_node

    role = "colocated" if args.command == "decode" and args.colocated else args.command
    run_node(NodeConfig(role=role, engine=engine_config(args), host=args.host, port=args.port,
                        redis_url=args.redis_url, node_id=args.node_id, kv_backend=args.kv_backend,
                        transfer_lease_s=args.transfer_lease, fault=args.fault))
    return 0


def cmd_router(args) -> int:
    from splitserve.router.app import run_router
    from splitserve.router.config import router_config

    run_router(router_config(args))
    return 0


def cmd_up(args) -> int:
    from splitserve.deploy.launcher import launch

    return launch(args)


def cmd_bench(args) -> int:
    from splitserve.benchmarks.serve.cli import main as bench_main

    return bench_main(args)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate offline with the engine (no servers)")
    _add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat message")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="a stop string (repeatable)")
    gen.add_argument("--json", action="store_true", help="one JSON line per prompt")
    gen.set_defaults(func=cmd_generate)

    for role in ("prefill", "decode"):
        node = sub.add_parser(role, help=f"run a {role} node")
        _add_engine_args(node)
        _add_node_args(node)
        if role == "decode":
            node.add_argument("--colocated", action="store_true", help="prefill every request locally")
        node.set_defaults(func=cmd_node)

    router = sub.add_parser("router", help="run the OpenAI-compatible router")
    from splitserve.router.config import add_router_args
    add_router_args(router)
    router.set_defaults(func=cmd_router)

    up = sub.add_parser("up", help="start a local cluster (redis, router, nodes) and serve until Ctrl-C")
    up.add_argument("--config", default=None, help="TOML file (default: deploy/local.toml)")
    up.add_argument("--prefill-nodes", type=int)
    up.add_argument("--decode-nodes", type=int)
    up.add_argument("--port", type=int, help="router port")
    up.add_argument("--kv-backend", choices=("tcp", "shm", "ucx"))
    up.add_argument("--kv-cache-memory")
    up.add_argument("--threads-per-node", type=int)
    up.add_argument("--cpus", nargs="+", metavar="ROLE=CPUS",
                    help="pin roles to CPUs, e.g. prefill=0 decode=1 router=0 (a pinned node gets "
                         "one torch thread per CPU)")
    up.add_argument("--redis-url", default=None, help="use this Redis instead of starting one")
    up.add_argument("--model", default=None)
    up.set_defaults(func=cmd_up)

    bench = sub.add_parser("bench", help="benchmark an OpenAI-compatible endpoint: TTFT, TPOT, ITL, "
                           "E2E percentiles, throughput, goodput")
    from splitserve.benchmarks.serve.cli import add_bench_args
    add_bench_args(bench)
    bench.set_defaults(func=cmd_bench)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as e:  # configuration errors: say what to change, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
