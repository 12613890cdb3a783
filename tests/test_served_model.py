"""The user's model end to end: router and nodes started on a tiny random model folder
(with the bundled tokenizer) under ``--served-model-name``, through the official openai
client. /v1/models lists every served name with the model's context (capped at its
sliding window, as the nodes cap it); a request naming any served name works; another
name is a 404 OpenAI error; nodes register and label metrics under the first name; a
router expecting another model refuses to start."""

import asyncio
import json
import shutil
import subprocess
import sys
import time
import urllib.request

import openai
import pytest

from splitserve.common.node_registry import NodeRegistry
from splitserve.deploy.launcher import Cluster

pytestmark = pytest.mark.slow
NAMES = ["my-model", "my-alias"]
WINDOW = 200  # the tiny Mistral's sliding window: its usable context


@pytest.fixture
def model_dir(tiny_model_dir, bundled_dir):
    """A tiny random Mistral (512 positions, a 200-token window) with the bundled tokenizer."""
    path, _ = tiny_model_dir("mistral", vocab_size=49152, max_position_embeddings=512,
                             sliding_window=WINDOW, eos_token_id=2, bos_token_id=1, tie_word_embeddings=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(bundled_dir / name, path / name)
    return path


@pytest.fixture
def cluster(model_dir):
    with Cluster(prefill_nodes=1, decode_nodes=1, kv_backend="tcp", kv_cache_memory="32MiB",
                 model=str(model_dir), served_model_names=NAMES) as c:
        yield c


def test_served_model_name_through_openai_client(cluster, model_dir):
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="none", max_retries=0, timeout=120)
    models = client.models.list().data
    assert [m.id for m in models] == NAMES
    assert all(m.model_extra["max_model_len"] == WINDOW for m in models)
    assert models[0].model_extra["root"] == str(model_dir)
    assert client.models.retrieve("my-alias").id == "my-alias"

    for name in NAMES:
        chat = client.chat.completions.create(model=name, max_tokens=6, temperature=0,
                                              messages=[{"role": "user", "content": "Hello there"}])
        assert chat.model == name
        assert chat.usage.completion_tokens >= 1 and chat.usage.prompt_tokens > 3
    done = client.completions.create(model="my-model", prompt="one two three", max_tokens=4)
    assert done.usage.completion_tokens >= 1

    for call in (lambda: client.chat.completions.create(
                     model="SmolLM2-135M-Instruct", max_tokens=2, messages=[{"role": "user", "content": "x"}]),
                 lambda: client.models.retrieve("SmolLM2-135M-Instruct")):
        with pytest.raises(openai.NotFoundError) as err:
            call()
        assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"

    too_long = "word " * (WINDOW + 20)  # over the window even though under max_position_embeddings
    with pytest.raises(openai.BadRequestError, match=str(WINDOW)):
        client.completions.create(model="my-model", prompt=too_long, max_tokens=2)

    # Nodes registered under the first name; the router's metrics carry it as model_name.
    async def registered():
        registry = NodeRegistry(cluster.redis_url)
        try:
            return {n.model for n in await registry.list_nodes()}
        finally:
            await registry.close()
    assert asyncio.run(registered()) == {"my-model"}
    with urllib.request.urlopen(f"{cluster.url}/metrics", timeout=10) as r:
        assert 'model_name="my-model"' in r.read().decode()

    # Router and nodes key block hashes with the same name: a repeated prompt is predicted
    # cached (index entries take a moment to arrive, hence the retries).
    shared = "The same long prompt, sent again and again. " * 8
    for _ in range(10):
        client.completions.create(model="my-alias", prompt=shared, max_tokens=1)
        with urllib.request.urlopen(f"{cluster.url}/debug/decisions?limit=1", timeout=10) as r:
            last = json.loads(r.read())["decisions"][-1]
        if last["predicted_cached_tokens"]:
            break
        time.sleep(0.5)
    assert last["predicted_cached_tokens"] >= 32 and last["outcome"] == "hit", last

    # A router expecting another model (here the bundled one) refuses to start.
    out = subprocess.run([sys.executable, "-m", "splitserve.cli", "router", "--port", "0",
                          "--redis-url", cluster.redis_url], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "served_model_name" in out.stderr and "`my-model`" in out.stderr
    assert "SmolLM2-135M-Instruct" in out.stderr
