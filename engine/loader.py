"""Loads a Hugging Face Llama checkpoint (one ``model.safetensors`` or shards
listed in ``model.safetensors.index.json``) into ``LlamaForCausalLM``.

Owns the name mapping from HF weights to ours (q/k/v and gate/up are fused) and
the resolution of the model argument: ``None`` means the bundled model.
"""

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from splitserve.engine.model import LlamaForCausalLM
from splitserve.engine.model_config import ModelConfig

_FUSED = {  # our fused name -> the HF parts, concatenated on the output dim in this order
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def resolve_model_dir(model: str | Path | None) -> Path:
    """The folder to load: the bundled model when ``model`` is None or its id."""
    from splitserve.common.bundled import BUNDLED_MODEL_ID
    from splitserve.engine.convert import bundled_model_dir

    if model is None or str(model) == BUNDLED_MODEL_ID:
        return bundled_model_dir()
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"model: {model!r} is not a model folder (no config.json there); "
                         f"pass a Hugging Face safetensors folder or omit it for {BUNDLED_MODEL_ID}")
    return path


def read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint, single-file or sharded."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (model_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"model: {model_dir} holds no model.safetensors nor a sharded index")
    tensors = {}
    for name in files:
        with safe_open(model_dir / name, framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return tensors


def load_model(model_dir: Path, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> LlamaForCausalLM:
    cfg = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    hf = read_safetensors(model_dir)
    ours: dict[str, torch.Tensor] = {}
    for key in list(hf):
        m = _LAYER.match(key)
        if key == "model.embed_tokens.weight":
            ours["embed_tokens.weight"] = hf.pop(key)
        elif key == "model.norm.weight":
            ours["norm.weight"] = hf.pop(key)
        elif key == "lm_head.weight" and not cfg.tie_word_embeddings:
            ours["lm_head.weight"] = hf.pop(key)
        elif m and not any(m.group(2) in parts for parts in _FUSED.values()):
            ours[f"layers.{m.group(1)}.{m.group(2)}.{m.group(3)}"] = hf.pop(key)
    for i in range(cfg.num_layers):
        for fused, parts in _FUSED.items():
            for kind in ("weight", "bias"):
                names = [f"model.layers.{i}.{p}.{kind}" for p in parts]
                if all(n in hf for n in names):
                    ours[f"layers.{i}.{fused}.{kind}"] = torch.cat([hf.pop(n) for n in names])
    hf.pop("lm_head.weight", None)  # tied: the embedding serves as the head
    if hf:
        raise ValueError(f"model: unexpected weights in {model_dir}: {sorted(hf)[:5]}")
    expected = {k for k in model.state_dict() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    missing = expected - ours.keys()
    if missing:
        raise ValueError(f"model: weights missing from {model_dir}: {sorted(missing)[:5]}")
    ours = {k: v.to(dtype) for k, v in ours.items()}
    model.load_state_dict(ours, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rope = type(model.rope)(cfg)  # rebuild the RoPE tables off the meta device
    return model.to(device).eval()
