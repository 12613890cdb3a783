"""The thread boundary of engine/engine_thread.py: only the engine thread touches the
engine, and the engine thread touches no node. One check watches every attribute read of
every EngineCore while a real prefill node and a real decode node serve disaggregated
requests (one of them ending on its first token, whose transfer must still count as
owned), scrape and abort; one watches the prefill node's the same way (its block exports
are the engine thread's own, engine/block_export.py); one reads the source for code that
could reach the engine."""

import ast
import asyncio
import pathlib
import threading

import msgspec
from aiohttp.test_utils import TestServer

from splitserve.common import metric_names as names
from splitserve.common.config import EngineConfig, NodeConfig
from splitserve.common.prompt_ref import WirePrompt
from splitserve.common.protocol import Abort, FrameReader, GenerateRequest, TokenDelta
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.engine_core import EngineCore
from splitserve.decode_node.server import build_app as build_decode_app
from splitserve.prefill_node.server import PrefillNode, build_app as build_prefill_app
from splitserve.tests.metrics_text import sample_sum

ROOT = pathlib.Path(__file__).resolve().parent.parent
ENGINE_THREAD = "engine"  # EngineThread's thread name


def _watch_reads(cls: type, monkeypatch) -> tuple[threading.Event, list[tuple[str, str]]]:
    """Record (thread, attribute) of every attribute read of a ``cls`` while the event is set."""
    watching = threading.Event()
    seen: list[tuple[str, str]] = []
    original = cls.__getattribute__

    def watched(self, name):
        if watching.is_set():
            seen.append((threading.current_thread().name, name))
        return original(self, name)

    monkeypatch.setattr(cls, "__getattribute__", watched)
    return watching, seen


def _serve(tiny_llama_dir, watching: threading.Event) -> tuple[list[TokenDelta], str]:
    """Two disaggregated requests, scrapes and aborts on a real prefill and decode node
    (``watching`` set while both engine threads run): the first request's frames, the
    decode node's metrics."""
    path, _ = tiny_llama_dir()
    engine = EngineConfig(model=str(path), kv_cache_memory=1 << 20, num_threads=1)
    prefill_cfg = NodeConfig(role="prefill", engine=engine)
    decode_cfg = NodeConfig(role="decode", engine=engine)

    async def body():
        prefill, decode = TestServer(build_prefill_app(prefill_cfg)), TestServer(build_decode_app(decode_cfg))
        await prefill.start_server()
        await decode.start_server()
        watching.set()  # both engine threads run from here on
        try:
            import aiohttp
            async with aiohttp.ClientSession() as s:
                req = GenerateRequest(request_id="r1", prompt=WirePrompt.of(range(1, 40)),
                                      sampling_params=SamplingParams(max_tokens=6, ignore_eos=True),
                                      prefill_addr=str(prefill.make_url("")).rstrip("/"), transfer_id="t1")
                frames: list[TokenDelta] = []
                async with s.post(decode.make_url("/generate"), data=msgspec.msgpack.encode(req),
                                  headers={"Content-Type": "application/msgpack"}) as r:
                    assert r.status == 200, await r.text()
                    reader = FrameReader(TokenDelta)
                    async for chunk in r.content.iter_any():
                        frames.extend(reader.feed(chunk))
                # one that ends on its first token (the prefill node's): its transfer is owned too
                one = msgspec.structs.replace(req, request_id="r2", transfer_id="t2",
                                              sampling_params=SamplingParams(max_tokens=1, ignore_eos=True))
                async with s.post(decode.make_url("/generate"), data=msgspec.msgpack.encode(one),
                                  headers={"Content-Type": "application/msgpack"}) as r:
                    assert r.status == 200
                    await r.read()
                async with s.get(decode.make_url("/metrics")) as r:
                    metrics = await r.text()
                for server in (prefill, decode):
                    for route in ("/metrics", "/debug/state", "/health"):
                        async with s.get(server.make_url(route)) as r:
                            assert r.status == 200
                    async with s.post(server.make_url("/abort"), data=msgspec.msgpack.encode(Abort("r1")),
                                      headers={"Content-Type": "application/msgpack"}) as r:
                        assert r.status == 200
            await asyncio.sleep(0.2)  # the engines' idle passes
        finally:
            watching.clear()
            await decode.close()
            await prefill.close()
        return frames, metrics

    return asyncio.run(body())


def test_event_loop_never_touches_a_running_engine(tiny_llama_dir, monkeypatch):
    watching, seen = _watch_reads(EngineCore, monkeypatch)
    frames, metrics = _serve(tiny_llama_dir, watching)
    assert sample_sum(metrics, names.KV_TRANSFERS, state="owned") == 2
    assert sample_sum(metrics, names.KV_TRANSFERS, state="aborted") == 0
    assert frames[-1].finish_reason == "length"
    assert sum(len(f.token_ids) for f in frames) == 6
    engine_reads = [name for thread, name in seen if thread == ENGINE_THREAD]
    assert engine_reads, "the watch saw nothing: the test does not test"
    elsewhere = sorted({(thread, name) for thread, name in seen if thread != ENGINE_THREAD})
    assert elsewhere == [], f"engine read off the engine thread: {elsewhere}"


def test_the_engine_thread_never_reads_the_prefill_node(tiny_llama_dir, monkeypatch):
    """Everything an export needs rides its ExportKV; the prefill node learns of it from events."""
    watching, seen = _watch_reads(PrefillNode, monkeypatch)
    _, metrics = _serve(tiny_llama_dir, watching)
    assert sample_sum(metrics, names.KV_TRANSFERS, state="owned") == 2  # both prompts' blocks were exported
    assert seen, "the watch saw nothing: the test does not test"
    on_engine = sorted({name for thread, name in seen if thread == ENGINE_THREAD})
    assert on_engine == [], f"the engine thread read the prefill node: {on_engine}"


def _attribute_names(tree: ast.AST) -> set[str]:
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}


def test_only_the_runtime_builds_an_engine_and_only_the_engine_loop_holds_it():
    """Outside engine/, EngineCore is built in one place (node/runtime.py) and handed to
    the EngineThread; nothing reaches for the EngineThread's private engine."""
    owners = {ROOT / "node" / "runtime.py"}
    for folder in ("node", "decode_node", "prefill_node", "router", "kvtransfer", "common"):
        for file in (ROOT / folder).rglob("*.py"):
            tree = ast.parse(file.read_text(), str(file))
            names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
            if file not in owners:
                assert "EngineCore" not in names, f"{file.relative_to(ROOT)} uses EngineCore"
            assert "_engine" not in _attribute_names(tree) or file in owners, \
                f"{file.relative_to(ROOT)} reaches into an engine"
