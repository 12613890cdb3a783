"""KV cache sizing and placement (engine/kv/sizing.py) and what a node shows of it
(/debug/state, /metrics). The GPU budget is arithmetic tested here; the profiled sizing
itself runs only on CUDA (marked gpu), on the bundled model's shape."""

import asyncio

import pytest
import torch

from splitserve.common import metric_names as names
from splitserve.common.config import EngineConfig, NodeConfig
from splitserve.engine.attention.selector import select_backend
from splitserve.engine.kv.sizing import dummy_forward, gpu_kv_cache_budget, kv_block_bytes
from splitserve.engine.model_runner import ModelRunner
from splitserve.tests.metrics_text import sample_sum

GIB = 1 << 30
# one 16-token block of conftest's tiny Llama: 2 layers, K and V, 2 KV heads, head_dim 16, float32
TINY_BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4


def test_gpu_budget_is_the_share_minus_weights_and_activations():
    assert gpu_kv_cache_budget(80 * GIB, 0.5, 2 * GIB, 3 * GIB, free=70 * GIB) == 35 * GIB
    with pytest.raises(ValueError, match="gpu_memory_utilization: 0.05 of 80.0 GiB leaves nothing"):
        gpu_kv_cache_budget(80 * GIB, 0.05, 2 * GIB, 3 * GIB, free=70 * GIB)
    with pytest.raises(ValueError, match="device has 10.00 GiB free"):
        gpu_kv_cache_budget(80 * GIB, 0.9, 2 * GIB, 3 * GIB, free=10 * GIB)


def test_gpu_memory_utilization_is_refused_on_cpu_and_out_of_range():
    with pytest.raises(ValueError, match="gpu_memory_utilization: sizes a GPU's KV cache"):
        EngineConfig(gpu_memory_utilization=0.5)
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match=r"gpu_memory_utilization: must be in \(0, 1\]"):
            EngineConfig(device="cuda", gpu_memory_utilization=bad)


def test_cli_explains_pool_flag_errors(capsys):
    from splitserve import cli
    assert cli.main(["generate", "--gpu-memory-utilization", "0.5"]) == 2
    assert "gpu_memory_utilization" in capsys.readouterr().err
    assert cli.main(["generate", "--device", "cuda", "--gpu-memory-utilization", "0.5",
                     "--kv-cache-memory", "1GiB"]) == 2
    assert "give one of --kv-cache-memory and --gpu-memory-utilization" in capsys.readouterr().err


def test_runner_pool_from_kv_cache_memory_and_the_profiling_forward_on_cpu(tiny_llama_dir):
    path, _ = tiny_llama_dir()
    config = EngineConfig(model=str(path), kv_cache_memory=1 << 20, max_num_batched_tokens=40, block_size=8)
    runner = ModelRunner(config, path)
    block = kv_block_bytes(runner.model_config, 8, torch.float32)
    assert runner.kv_size.block_bytes == block and runner.num_blocks == (1 << 20) // block
    # one block more in the tensor: the scratch block padded static-decode rows write (model_runner.py)
    assert runner.kv_caches.shape[2] == runner.num_blocks + 1 and runner.kv_size.weights_bytes is None
    backend = select_backend(config, torch.device("cpu"), runner.model_config.head_dim)
    scratch = dummy_forward(runner.model, backend, config, torch.float32, torch.device("cpu"))
    assert scratch == 5 * block  # 40 tokens in 8-token blocks
    with pytest.raises(ValueError, match="kv_cache_memory: .* fewer than 2 blocks"):
        ModelRunner(EngineConfig(model=str(path), kv_cache_memory=block), path)


def test_node_shows_device_dtype_and_pool(tiny_llama_dir):
    from aiohttp.test_utils import TestClient, TestServer

    from splitserve.decode_node.server import build_app
    path, _ = tiny_llama_dir()
    config = NodeConfig(role="colocated", engine=EngineConfig(model=str(path), kv_cache_memory=1 << 20))

    async def body():
        async with TestClient(TestServer(build_app(config))) as client:
            state = await (await client.get("/debug/state")).json()
            metrics = await (await client.get("/metrics")).text()
        return state, metrics
    state, metrics = asyncio.run(body())
    pool = state["kv_pool"]
    block = TINY_BLOCK_BYTES
    assert state["device"] == "cpu" and state["dtype"] == "float32" and pool["device"] == "cpu"
    assert pool["blocks"] == (1 << 20) // block and pool["bytes"] == pool["blocks"] * block
    assert pool["tokens"] == pool["blocks"] * 16 and pool["gpu_memory_utilization"] is None
    assert sample_sum(metrics, names.NODE_DEVICE_INFO, device="cpu", dtype="float32") == 1
    assert sample_sum(metrics, names.KV_POOL_BLOCKS) == pool["blocks"]
    assert sample_sum(metrics, names.KV_POOL_TOKENS) == pool["tokens"]
    assert sample_sum(metrics, names.KV_POOL_BYTES) == pool["bytes"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_memory_utilization_sizes_the_pool_on_cuda(shaped_model):
    """The bundled model's shape (random weights where only its config is at hand): the
    weights and a max_num_batched_tokens prefill's activations are measured, and the pool
    gets what is left of the share."""
    import gc

    path, load_format = shaped_model
    free, total = torch.cuda.mem_get_info()
    util = min(0.5, 0.8 * free / total)
    config = EngineConfig(model=str(path), load_format=load_format, device="cuda", gpu_memory_utilization=util)
    runner = ModelRunner(config, path)
    try:
        plan = runner.kv_size
        assert runner.kv_caches.is_cuda and runner.kv_caches.dtype == torch.bfloat16
        num_params = sum(p.numel() for p in runner.model.parameters())
        assert plan.weights_bytes >= 2 * num_params  # bf16 weights, and whatever else was allocated before
        assert plan.activation_peak_bytes > 0  # a 2048-token prefill needs room beyond its scratch cache
        assert plan.budget_bytes == int(total * util) - plan.weights_bytes - plan.activation_peak_bytes
        assert plan.block_bytes == kv_block_bytes(runner.model_config, config.block_size, torch.bfloat16)
        # the pool plus the scratch block of static decode
        assert runner.kv_caches.numel() * runner.kv_caches.element_size() == (plan.num_blocks + 1) * plan.block_bytes
        assert plan.num_blocks * plan.block_bytes <= plan.budget_bytes < (plan.num_blocks + 1) * plan.block_bytes
    finally:  # the pool holds half the GPU: give it back to the tests (and processes) that follow
        del runner
        gc.collect()
        torch.cuda.empty_cache()
