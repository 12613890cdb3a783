"""``splitserve up``'s device placement (deploy/devices.py): which device, memory share and
KV backend each node gets, and the command lines the launcher builds from them. CPU-only:
the placement is plain arithmetic; a real CUDA cluster is benchmarks/gpu/bench_gpu_transfer.py's."""

import pytest

from splitserve.deploy.devices import plan_devices
from splitserve.deploy.launcher import Cluster


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def cluster(plan, prefill=1, decode=1, colocated=False) -> Cluster:
    c = Cluster(prefill_nodes=prefill, decode_nodes=decode, kv_backend=plan.kv_backend, kv_cache_memory="64MiB",
                colocated=colocated, devices=plan if plan.devices or plan.dtype else None)
    c.redis_url = "redis://127.0.0.1:1/0"
    return c


def test_cpu_up_is_unchanged():
    for device in (None, "cpu"):
        plan = plan_devices(device, None, None, None, "shm", dtype="auto")
        assert plan.devices == {} and plan.kv_backend == "shm" and plan.dtype is None
        args = cluster(plan).node_args("decode", 0)
        assert flag(args, "--kv-backend") == "shm" and flag(args, "--kv-cache-memory") == "64MiB"
        assert "--device" not in args and "--gpu-memory-utilization" not in args and "--dtype" not in args
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        plan_devices("cpu", None, None, None, "shm", gpu_memory_utilization=0.5)


def test_one_gpu_shares_its_memory_and_uses_ipc():
    plan = plan_devices("cuda", None, None, None, "shm", dtype="bfloat16")
    assert plan.kv_backend == "ipc" and plan.gpu_memory_utilization == 0.9
    c = cluster(plan, prefill=2, decode=1)
    for role, index in (("prefill", 0), ("prefill", 1), ("decode", 0)):
        args = c.node_args(role, index)
        assert flag(args, "--device") == "cuda" and flag(args, "--dtype") == "bfloat16"
        assert flag(args, "--gpu-memory-utilization") == "0.3000" and "--kv-cache-memory" not in args
        assert flag(args, "--kv-backend") == "ipc"


def test_devices_per_role_split_each_gpu_among_its_nodes():
    plan = plan_devices(None, ["cuda:0"], ["cuda:1", "cuda:2"], None, "shm", gpu_memory_utilization=0.8)
    c = cluster(plan, prefill=2, decode=3)
    got = {(r, i): (flag(c.node_args(r, i), "--device"), flag(c.node_args(r, i), "--gpu-memory-utilization"))
           for r, n in (("prefill", 2), ("decode", 3)) for i in range(n)}
    assert got == {("prefill", 0): ("cuda:0", "0.4000"), ("prefill", 1): ("cuda:0", "0.4000"),
                   ("decode", 0): ("cuda:1", "0.4000"), ("decode", 1): ("cuda:2", "0.8000"),
                   ("decode", 2): ("cuda:1", "0.4000")}
    colocated = cluster(plan_devices(None, None, ["cuda:1"], None, "shm"), decode=1, colocated=True)
    assert flag(colocated.node_args("colocated", 0), "--device") == "cuda:1"


def test_tensor_parallel_nodes_take_one_device_per_rank():
    """docs/parallelism.md's 70B on 8 GPUs: a TP4 prefill node on cuda:0-3 (its first device given)
    and a TP8 decode node over all 8; a GPU's share of F counts every rank on it, and a node
    takes its most shared GPU's share (its ranks hold the same block count)."""
    tp = {"prefill": 4, "decode": 8}
    plan = plan_devices(None, ["cuda:0"], [",".join(f"cuda:{i}" for i in range(8))], None, "shm", tp=tp)
    c = Cluster(prefill_nodes=1, decode_nodes=1, kv_backend=plan.kv_backend, devices=plan, tp=tp)
    c.redis_url = "redis://127.0.0.1:1/0"
    assert plan.kv_backend == "ipc" and plan.placement({"prefill": 1, "decode": 1}) == \
        {f"cuda:{i}": 2 if i < 4 else 1 for i in range(8)}
    prefill, decode = c.node_args("prefill", 0), c.node_args("decode", 0)
    assert flag(prefill, "--device") == "cuda:0" and flag(prefill, "--tensor-parallel-size") == "4"
    assert flag(decode, "--device") == "cuda:0,cuda:1,cuda:2,cuda:3,cuda:4,cuda:5,cuda:6,cuda:7"
    assert flag(decode, "--tensor-parallel-size") == "8"
    assert flag(prefill, "--gpu-memory-utilization") == flag(decode, "--gpu-memory-utilization") == "0.4500"
    on_cpu = Cluster(prefill_nodes=1, decode_nodes=1, kv_backend="shm", kv_cache_memory="64MiB",
                     tp={"prefill": 1, "decode": 2})
    on_cpu.redis_url = "redis://127.0.0.1:1/0"
    assert "--tensor-parallel-size" not in on_cpu.node_args("prefill", 0)
    assert flag(on_cpu.node_args("decode", 0), "--tensor-parallel-size") == "2"
    for devices, match in ((["cuda:0,cuda:1,cuda:2"], "names 3 devices for a node of 2 ranks"),
                           (["cuda:0,cuda:0"], "puts two ranks of one node on one GPU"),
                           (["cuda:0,cpu"], "mixes the CPU and GPUs")):
        with pytest.raises(ValueError, match=match):
            plan_devices(None, None, devices, None, "shm", tp={"decode": 2})


def test_backend_follows_the_placement_unless_given():
    assert plan_devices(None, ["cpu"], ["cuda:0"], None, "shm").kv_backend == "tcp"
    assert plan_devices("cuda:0", None, None, "tcp", "shm").kv_backend == "tcp"
    explicit = plan_devices("cuda", None, None, None, "shm", kv_cache_memory_given=True)
    assert explicit.gpu_memory_utilization is None
    assert flag(cluster(explicit).node_args("prefill", 0), "--kv-cache-memory") == "64MiB"
    for args, match in (((None, None, ["cpu"], "ipc", "shm"), "ipc needs every decode node on CUDA"),
                        ((None, ["cuda:0"], ["cpu"], "ipc", "shm"), "ipc needs every decode node on CUDA"),
                        (("cuda", None, None, "shm", "shm"), "shm keeps KV pools in host memory"),
                        (("gpu:0", None, None, None, "shm"), "--device: 'gpu:0'"),
                        ((None, ["cuda:x"], None, None, "shm"), "--prefill-devices"),
                        (("cuda", None, None, None, "shm", None, 1.5), "must be in")):
        with pytest.raises(ValueError, match=match):
            plan_devices(*args)


def test_up_parses_the_device_flags(monkeypatch):
    from splitserve import cli
    seen = []
    monkeypatch.setattr(cli, "COMMANDS", tuple(c._replace(run=lambda args: seen.append(args) or 0)
                                               if c.name == "up" else c for c in cli.COMMANDS))
    assert cli.main(["up", "--device", "cuda", "--prefill-devices", "cuda:0", "--decode-devices", "cuda:1",
                     "--dtype", "float16", "--gpu-memory-utilization", "0.5"]) == 0
    ns = seen[0]
    assert (ns.device, ns.prefill_devices, ns.decode_devices, ns.dtype, ns.gpu_memory_utilization) == \
        ("cuda", ["cuda:0"], ["cuda:1"], "float16", 0.5)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_up_on_one_gpu_serves_through_ipc():
    """`splitserve up --device cuda`: both nodes on one GPU, blocks over CUDA IPC, no fallback."""
    import json
    import os
    import urllib.request

    import openai
    os.environ.setdefault("SPLITSERVE_QUIET", "1")
    plan = plan_devices("cuda", None, None, None, "shm", gpu_memory_utilization=0.3)
    with Cluster(prefill_nodes=1, decode_nodes=1, kv_backend=plan.kv_backend, devices=plan) as c:
        client = openai.OpenAI(base_url=f"{c.url}/v1", api_key="none", max_retries=0, timeout=120)
        r = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The sky is " * 40, max_tokens=4,
                                      temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 4
        for name in ("prefill-0", "decode-0"):
            with urllib.request.urlopen(f"{c.node(name).addr}/debug/state", timeout=10) as resp:
                state = json.loads(resp.read())
            assert state["kv_pool"]["device"].startswith("cuda") and state["kv_pool"]["dtype"] == "bfloat16"
            assert state["kv_pool"]["gpu_memory_utilization"] == pytest.approx(0.15)
        with urllib.request.urlopen(f"{c.node('decode-0').addr}/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line and not line.startswith("#")}
        assert samples.get('splitserve_kv_transfers_total{state="owned"}', 0) >= 1, metrics
        assert not any(v for k, v in samples.items() if k.startswith("splitserve_decode_fallback_prefills_total"))


def test_the_docs_moe_recipe_gives_every_node_expert_parallelism():
    """docs/parallelism.md's Qwen3-30B-A3B on 2 GPUs: both TP2 nodes span cuda:0,cuda:1 with
    --enable-expert-parallel (each pool's EP size is its TP), parsed by the node's CLI."""
    from splitserve.cli import build_parser, node_config

    tp = {"prefill": 2, "decode": 2}
    plan = plan_devices(None, ["cuda:0,cuda:1"], ["cuda:0,cuda:1"], None, "shm", tp=tp)
    c = Cluster(prefill_nodes=1, decode_nodes=1, kv_backend=plan.kv_backend, devices=plan, tp=tp,
                kv_cache_memory="4GiB", expert_parallel=True)
    c.redis_url = "redis://127.0.0.1:1/0"
    for role in ("prefill", "decode"):
        args = c.node_args(role, 0)
        assert "--enable-expert-parallel" in args and flag(args, "--tensor-parallel-size") == "2"
        cfg = node_config(build_parser().parse_args(args), role)
        assert cfg.engine.enable_expert_parallel and cfg.engine.tensor_parallel_size == 2
        assert cfg.rank_devices == ("cuda:0", "cuda:1")
    plain = Cluster(prefill_nodes=1, decode_nodes=1, kv_backend="shm", tp={"decode": 2})
    plain.redis_url = "redis://127.0.0.1:1/0"
    assert "--enable-expert-parallel" not in plain.node_args("decode", 0)


def test_data_parallel_nodes_are_one_member_per_rank_on_their_own_gpu():
    """docs/parallelism.md's DeepSeek-V3-class recipe: --prefill-dp 2 --decode-dp 2 makes 2 members per role,
    rank r of node n at index n * 2 + r, one GPU each, the ranks of a node meeting at one port
    (kept for restarts); the node CLI parses them into data-parallel configs."""
    from splitserve.cli import build_parser, node_config

    dp = {"prefill": 2, "decode": 2}
    plan = plan_devices(None, ["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"], None, "shm")
    c = Cluster(prefill_nodes=1, decode_nodes=1, kv_backend=plan.kv_backend, devices=plan, dp=dp)
    c.redis_url = "redis://127.0.0.1:1/0"
    assert c.members("prefill") == c.members("decode") == 2
    for role, devices in (("prefill", ("cuda:0", "cuda:1")), ("decode", ("cuda:2", "cuda:3"))):
        args = [c.node_args(role, i) for i in range(2)]
        assert [flag(a, "--device") for a in args] == list(devices)
        assert [flag(a, "--data-parallel-rank") for a in args] == ["0", "1"]
        assert flag(args[0], "--data-parallel-address") == flag(args[1], "--data-parallel-address")
        assert c.node_args(role, 1) == args[1]  # a restart gets the same rendezvous
        cfg = node_config(build_parser().parse_args(args[1]), role)
        assert (cfg.engine.data_parallel_size, cfg.engine.data_parallel_rank) == (2, 1)
        assert not cfg.engine.async_scheduling and cfg.engine.enforce_eager
    assert flag(c.node_args("prefill", 0), "--data-parallel-address") != flag(c.node_args("decode", 0),
                                                                             "--data-parallel-address")
