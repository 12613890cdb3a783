"""How many KV bytes does an MLA model move per prompt token, measured against the formula,
and what does moving an 8k-token prompt's latent blocks cost beside the same prompt on a
same-size GQA model? Two random models of the same layers and hidden size, each served by a
real cluster (router, 1 prefill node, 1 decode node, tcp):

    (a) DeepSeek-V3-shaped (DeepseekV3ForCausalLM, Multi-head Latent Attention): each layer
        caches one latent of kv_lora_rank 512 + qk_rope_head_dim 64 = 576 values per token,
        as DeepSeek-V3 does;
    (b) Llama with GQA (16 query heads over 8 KV heads of head_dim 128): each layer caches
        8 x 128 x (K and V) = 2048 values per token, as a Llama-3-70B layer does.

    .venv/bin/python benchmarks/kvtransfer/bench_latent_transfer.py [--tokens 8192] [--reps 5] [--quick]

Formula: bytes per token = layers x values per layer x itemsize (the nodes' KV dtype). Measured
two ways: the prefill node's ``kv_bytes_sent_total`` over the tokens of the blocks it sent
(``kv_blocks_sent_total`` x block size), per request, and the KV pool's bytes over its tokens
(``/debug/state`` ``kv_pool``). Transfer time: the prefill node's ``kv_send_seconds_total``
for the request (each chunk's send, first frame out to last acknowledgement, summed: prefill
compute between chunks left out); the decode node's ``transfer`` stage (reserve -> blocks
owned, which includes the prefill compute) and the request's wall time are given beside it.
Each model runs twice, each time on a fresh cluster: with the engine's default 512-token
prefill chunks (each chunk's blocks sent while the next computes, so the send shares the
cores with the compute) and in one step (prefill chunk and step budget = the prompt: the
compute ends, then every block goes in one send, a transfer alone). Each repetition is a distinct random prompt (no prefix-cache hit) with max_tokens 1; medians
of ``--reps``. Writes ``benchmarks/results/latent_transfer.json`` (``--quick``: 512 tokens,
2 reps, 2 layers, to ``--out`` or the system's temp folder; what the test runs).

The models are random (transformers' initialisation, fp32, the bundled vocabulary and
tokenizer) and small (hidden 256, 4 layers) so an 8k prefill is quick on a CPU; only the
cache shape per layer is the real models'. On this machine both nodes share 2 busy cores and
tcp runs over loopback: read the bytes as exact and the times as this host's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from splitserve.benchmarks.harness import RESULTS, token_prompts
from splitserve.common import metric_names as names

LAYERS, HIDDEN = 4, 256
MAX_POSITIONS = 9216  # >= 8k prompt + the generated token
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
# DeepSeek-V3's attention shape (config.json of deepseek-ai/DeepSeek-V3): latent 512 + 64 rope
DEEPSEEK_V3_MLA = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
# Llama-3-70B's KV per layer: 8 KV heads of 128
LLAMA3_70B_KV = dict(num_key_value_heads=8, head_dim=128)
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_values_per_layer(cfg: dict) -> int:
    """KV cache values per token and layer of a transformers config dict: the latent
    (kv_lora_rank + qk_rope_head_dim) for MLA, K and V of every KV head otherwise."""
    if "kv_lora_rank" in cfg:
        return cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim


def formula_bytes_per_token(cfg: dict, itemsize: int) -> int:
    """layers x values per layer x itemsize."""
    return cfg["num_hidden_layers"] * kv_values_per_layer(cfg) * itemsize


def deepseek_config(layers: int = LAYERS, hidden: int = HIDDEN, vocab: dict | None = None) -> dict:
    """A DeepSeek-V3-shaped config dict (DeepseekV3Config's arguments): DeepSeek-V3's MLA
    widths, q LoRA, a first dense layer then DeepSeekMoE (4 routed experts, top 2, one shared)."""
    return dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", num_hidden_layers=layers,
                hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
                num_attention_heads=4, num_key_value_heads=4, q_lora_rank=128, **DEEPSEEK_V3_MLA,
                n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
                first_k_dense_replace=1, routed_scaling_factor=2.5, max_position_embeddings=MAX_POSITIONS,
                tie_word_embeddings=False, **(vocab or {}))


def llama_config(layers: int = LAYERS, hidden: int = HIDDEN, vocab: dict | None = None) -> dict:
    """A Llama of the same layers and hidden size with Llama-3-70B's KV per layer: 16 query
    heads over 8 KV heads of head_dim 128 (set explicitly: hidden / heads is 16)."""
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=layers,
                hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=16, **LLAMA3_70B_KV,
                max_position_embeddings=MAX_POSITIONS, rope_theta=500000.0, tie_word_embeddings=False,
                **(vocab or {}))


def build_model(cfg: dict, out: Path, tokenizer_dir: Path) -> Path:
    """Save a random fp32 model of ``cfg`` (transformers) at ``out`` with the tokenizer files."""
    import torch
    import transformers

    config_cls = {"llama": transformers.LlamaConfig, "deepseek_v3": transformers.DeepseekV3Config}[cfg["model_type"]]
    model_cls = {"llama": transformers.LlamaForCausalLM,
                 "deepseek_v3": transformers.DeepseekV3ForCausalLM}[cfg["model_type"]]
    kwargs = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    torch.manual_seed(0)
    model = model_cls(config_cls(**kwargs)).eval()
    model.save_pretrained(out, safe_serialization=True)
    for f in TOKENIZER_FILES:
        if (tokenizer_dir / f).is_file():
            shutil.copy(tokenizer_dir / f, out / f)
    return out


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read()


def _metric(addr: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = _get(f"{addr}/metrics").decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def _complete(url: str, model_id: str, prompt: list[int]) -> dict:
    body = json.dumps({"model": model_id, "prompt": prompt, "max_tokens": 1, "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as r:
        return json.loads(r.read())


def _counters(prefill: str, decode: str) -> dict[str, float]:
    stage = names.KV_TRANSFER_STAGE_SECONDS
    return {"bytes": _metric(prefill, names.KV_BYTES_SENT),
            "blocks": _metric(prefill, names.KV_BLOCKS_SENT),
            "send_s": _metric(prefill, names.KV_SEND_SECONDS),
            "stage_transfer_s": _metric(decode, stage + "_sum", stage="transfer"),
            "transfers": _metric(decode, stage + "_count", stage="transfer"),
            "fallbacks": _metric(decode, names.FALLBACK_PREFILLS)}


def measure(path: Path, cfg: dict, prompts: list[list[int]], kv_cache_bytes: int, one_step: bool = False) -> dict:
    """Serve ``path`` on 1 prefill + 1 decode node (tcp), send each prompt with max_tokens 1,
    and read what moved. ``one_step``: the nodes compute a whole prompt in one step (prefill
    chunk and step budget = its length), so its blocks go out after the compute, in one send;
    otherwise the engine's default 512-token chunks, each chunk's blocks sent while the next
    computes."""
    from splitserve.deploy.launcher import Cluster

    n = max(map(len, prompts))
    extra = ["--prefill-chunk-size", str(n), "--max-num-batched-tokens", str(n)] if one_step else []
    c = Cluster(prefill_nodes=1, decode_nodes=1, kv_backend="tcp", kv_cache_memory=str(kv_cache_bytes),
                model=str(path), extra_node_args=extra)
    try:
        c.start()
        prefill, decode = c.node("prefill-0").addr, c.node("decode-0").addr
        model_id = json.loads(_get(f"{c.url}/v1/models"))["data"][0]["id"]
        states = {n: json.loads(_get(f"{a}/debug/state")) for n, a in (("prefill", prefill), ("decode", decode))}
        dtype = states["prefill"]["dtype"]
        pool = states["prefill"]["kv_pool"]
        block_size = states["prefill"]["kv"]["block_size"]
        # warm-up: one short prompt of its own (the connection to the decode node, the first
        # forward's allocations), left out of the figures
        _complete(c.url, model_id, [7 + (i * 31) % 1000 for i in range(4 * block_size)])
        reps = []
        for prompt in prompts:
            before = _counters(prefill, decode)
            t0 = time.perf_counter()
            answer = _complete(c.url, model_id, prompt)
            wall = time.perf_counter() - t0
            after = _counters(prefill, decode)
            d = {k: after[k] - before[k] for k in after}
            if d["fallbacks"] or d["transfers"] != 1 or not d["blocks"]:
                raise RuntimeError(f"{path.name}: the prompt's KV did not move as one transfer: {d}")
            tokens = int(d["blocks"]) * block_size
            details = answer["usage"].get("prompt_tokens_details") or {}
            reps.append({"prompt_tokens": len(prompt), "cached_tokens": details.get("cached_tokens"),
                         "blocks_sent": int(d["blocks"]), "bytes_sent": int(d["bytes"]),
                         "bytes_per_token": d["bytes"] / tokens, "send_s": d["send_s"],
                         "transfer_stage_s": d["stage_transfer_s"], "wall_s": wall,
                         "send_gbps": d["bytes"] / d["send_s"] / 1e9 if d["send_s"] else None})
            print(f"  {path.name}{' (one step)' if one_step else ''}: {len(prompt)} tokens, "
                  f"{int(d['blocks'])} blocks, {int(d['bytes'])} bytes, "
                  f"send {d['send_s'] * 1e3:.1f} ms, transfer stage {d['stage_transfer_s']:.2f} s, "
                  f"wall {wall:.2f} s", flush=True)
        itemsize = ITEMSIZE[dtype]
        formula = formula_bytes_per_token(cfg, itemsize)
        med = lambda k: statistics.median(r[k] for r in reps)  # noqa: E731
        return {"one_step": one_step, "model": path.name, "architecture": cfg["architectures"][0],
                "dtype": dtype, "itemsize": itemsize,
                "layers": cfg["num_hidden_layers"], "hidden_size": cfg["hidden_size"],
                "kv_values_per_layer": kv_values_per_layer(cfg), "block_size": block_size,
                "kv_key": states["prefill"]["kv"],
                "formula_bytes_per_token": formula,
                "measured_bytes_per_token": med("bytes_per_token"),
                "pool_bytes_per_token": pool["bytes"] / pool["tokens"],
                "prompt_tokens": len(prompts[0]), "prompt_bytes_formula": formula * len(prompts[0]),
                "prompt_bytes_sent": med("bytes_sent"),
                "send_s_median": med("send_s"), "transfer_stage_s_median": med("transfer_stage_s"),
                "wall_s_median": med("wall_s"), "send_gbps_median": med("send_gbps"), "reps": reps}
    finally:
        c.stop()


def _at(d: dict, dotted: str):
    for part in dotted.split("."):
        d = d[part]
    return d


def table(res: dict) -> str:
    a, b = res["models"]["latent"], res["models"]["gqa"]
    rows = [("KV values per token and layer", "kv_values_per_layer", "{:.0f}"),
            ("bytes/token, formula", "formula_bytes_per_token", "{:.0f}"),
            ("bytes/token, measured (sent)", "measured_bytes_per_token", "{:.1f}"),
            ("bytes/token, KV pool", "pool_bytes_per_token", "{:.1f}"),
            (f"bytes for the {a['prompt_tokens']}-token prompt, sent", "prompt_bytes_sent", "{:.0f}"),
            ("send time, median (ms)", "send_s_median", "ms"),
            ("send rate, median (GB/s)", "send_gbps_median", "{:.2f}"),
            ("decode 'transfer' stage incl. prefill, median (s)", "transfer_stage_s_median", "{:.2f}"),
            ("request wall time, median (s)", "wall_s_median", "{:.2f}"),
            ("one step: send time, median (ms)", "one_step.send_s_median", "ms"),
            ("one step: send rate, median (GB/s)", "one_step.send_gbps_median", "{:.2f}"),
            ("one step: request wall time, median (s)", "one_step.wall_s_median", "{:.2f}")]
    fmt = lambda f, v: f"{v * 1e3:.1f}" if f == "ms" else f.format(v)  # noqa: E731
    out = [f"{'':52} {'MLA (DeepSeek-V3)':>18} {'GQA (Llama-3-70B)':>18} {'GQA/latent':>11}"]
    for label, key, f in rows:
        x, y = (_at(m, key) for m in (a, b))
        ratio = y / x if x else float("nan")
        out.append(f"{label:52} {fmt(f, x):>18} {fmt(f, y):>18} {ratio:>11.2f}")
    return "\n".join(out)


def run(tokens: int, reps: int, layers: int, out: Path) -> dict:
    from splitserve.engine.models.convert import bundled_model_dir

    tok_dir = bundled_model_dir()
    ref = json.loads((tok_dir / "config.json").read_text())
    vocab = {k: ref[k] for k in ("vocab_size", "bos_token_id", "eos_token_id")}
    # distinct random prompts (the first tokens differ: no prefix hit), the same for both models
    prompts = token_prompts(reps, tokens, ref["vocab_size"], seed=1234)
    models = {}
    with tempfile.TemporaryDirectory(prefix="latent_transfer_") as tmp:
        for kind, cfg in (("latent", deepseek_config(layers, vocab=vocab)), ("gqa", llama_config(layers, vocab=vocab))):
            path = build_model(cfg, Path(tmp) / f"{kind}-{cfg['architectures'][0]}", tok_dir)
            need = formula_bytes_per_token(cfg, 4) * (tokens + 256)
            kv_cache = int(need * 1.25) + (16 << 20)
            print(f"{kind}: {cfg['architectures'][0]}, {kv_values_per_layer(cfg)} KV values per token and layer, "
                  f"KV cache {kv_cache >> 20} MiB per node", flush=True)
            models[kind] = measure(path, cfg, prompts, kv_cache)
            one = measure(path, cfg, prompts, kv_cache, one_step=True)
            models[kind]["one_step"] = {k: one[k] for k in ("measured_bytes_per_token", "prompt_bytes_sent",
                                                            "send_s_median", "send_gbps_median",
                                                            "transfer_stage_s_median", "wall_s_median", "reps")}
    a, b = models["latent"], models["gqa"]
    res = {"question": "KV bytes per token of an MLA model against the formula, and an 8k-token prompt's latent "
                       "transfer beside the same prompt on a same-size GQA model",
           "command": " ".join([".venv/bin/python", "benchmarks/kvtransfer/bench_latent_transfer.py", *sys.argv[1:]]),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_average": os.getloadavg(),
           "kv_backend": "tcp", "tokens": tokens, "reps": reps, "models": models,
           "ratio_gqa_over_latent": {
               "formula_bytes_per_token": b["formula_bytes_per_token"] / a["formula_bytes_per_token"],
               "measured_bytes_per_token": b["measured_bytes_per_token"] / a["measured_bytes_per_token"],
               "prompt_bytes_sent": b["prompt_bytes_sent"] / a["prompt_bytes_sent"],
               "send_s_median": b["send_s_median"] / a["send_s_median"],
               "one_step_send_s_median": b["one_step"]["send_s_median"] / a["one_step"]["send_s_median"],
               "transfer_stage_s_median": b["transfer_stage_s_median"] / a["transfer_stage_s_median"]},
           "measured_equals_formula": {k: m["measured_bytes_per_token"] == m["formula_bytes_per_token"]
                                       for k, m in models.items()},
           "bf16_bytes_per_token_formula": {k: m["layers"] * m["kv_values_per_layer"] * 2 for k, m in models.items()}}
    print(table(res))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out}")
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192, help="prompt length in tokens")
    ap.add_argument("--reps", type=int, default=5, help="distinct prompts sent to each model")
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--quick", action="store_true", help="512 tokens, 2 reps, 2 layers (the test)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.reps, args.layers = 512, 2, 2
    out = args.out or (Path(tempfile.gettempdir()) / "latent_transfer_quick.json" if args.quick
                       else RESULTS / "latent_transfer.json")
    os.environ.setdefault("SPLITSERVE_QUIET", "1")
    run(args.tokens, args.reps, args.layers, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
