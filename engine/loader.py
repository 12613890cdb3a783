"""Loads a Hugging Face checkpoint of any family ``ModelConfig`` supports (one
``model.safetensors`` or shards listed in ``model.safetensors.index.json``) into
``CausalLM``, or builds it with random weights from ``config.json`` alone.

Owns the name mapping from HF weights to ours (q/k/v and gate/up are fused), the
load formats (``LOAD_FORMATS``: auto and safetensors read the checkpoint, dummy
draws seeded random weights on the target device so that real shapes can be
benchmarked without downloading them) and the resolution of the model argument:
``None`` means the bundled model.
"""

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from ..common.config import LOAD_FORMATS
from .model import CausalLM
from .model_config import ModelConfig

# Dummy weights: normal(0, std) matrices and biases, norms at 1. std is the usual HF
# initializer_range: activations stay O(1) through 32+ layers in bf16 as in fp32.
DUMMY_SEED = 0
DUMMY_STD = 0.02

_FUSED = {  # our fused name -> the HF parts, concatenated on the output dim in this order
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def resolve_model_dir(model: str | Path | None) -> Path:
    """The folder to load: the bundled model when ``model`` is None or its id."""
    from ..common.bundled import BUNDLED_MODEL_ID
    from .convert import bundled_model_dir

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
        raise ValueError(f"model: {model_dir} holds no model.safetensors nor a sharded index; for random "
                         "weights from its config.json alone use load_format dummy (--load-format dummy)")
    tensors = {}
    for name in files:
        with safe_open(model_dir / name, framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return tensors


def load_model(model_dir: Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               load_format: str = "auto") -> CausalLM:
    """The model of ``model_dir`` in ``dtype`` on ``device``; ``load_format`` is one of
    LOAD_FORMATS (dummy reads only config.json)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format: must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    cfg = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = CausalLM(cfg)
    if load_format == "dummy":
        weights = dummy_weights(model, dtype, torch.device(device))
    else:
        weights = {k: v.to(device=device, dtype=dtype) for k, v in hf_to_ours(model, model_dir).items()}
    model.load_state_dict(weights, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rope = type(model.rope)(cfg)  # rebuild the RoPE tables off the meta device
    return model.to(device).eval()


def hf_to_ours(model: CausalLM, model_dir: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under our names (q/k/v and gate/up fused), checked
    against the parameters of ``model`` (on the meta device): nothing missing, nothing
    left over, every shape as config.json implies."""
    cfg = model.cfg
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
    expected = dict(model.named_parameters())  # a tied head is listed once, as embed_tokens
    unexpected = sorted(hf) + sorted(ours.keys() - expected.keys())
    if unexpected:
        raise ValueError(f"model: unexpected weights in {model_dir} for {cfg.architecture}: {unexpected[:5]}")
    missing = expected.keys() - ours.keys()
    if missing:
        raise ValueError(f"model: weights missing from {model_dir} for {cfg.architecture}: {sorted(missing)[:5]}")
    for name, param in expected.items():
        if ours[name].shape != param.shape:
            raise ValueError(f"model: {name} in {model_dir} has shape {tuple(ours[name].shape)}, "
                             f"config.json implies {tuple(param.shape)}")
    return ours


def dummy_weights(model: CausalLM, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Seeded random weights for every parameter of ``model`` (on the meta device), drawn
    on ``device`` in ``dtype``: the same weights on every call on a given device."""
    gen = torch.Generator(device=device).manual_seed(DUMMY_SEED)
    out = {}
    for name, param in model.named_parameters():  # a tied head is listed once, as embed_tokens
        t = torch.empty(param.shape, dtype=dtype, device=device)
        out[name] = t.fill_(1.0) if name.endswith("norm.weight") else t.normal_(0.0, DUMMY_STD, generator=gen)
    return out
