"""Loads a Hugging Face checkpoint of any registered family (families.py; one
``model.safetensors`` or shards listed in ``model.safetensors.index.json``) into the
family's module, or builds it with random weights from ``config.json`` alone.

Owns the name mapping from checkpoint weights to ours: the family's weight map gives each
tensor its Hugging Face-style name (``model.layers.<i>.<part>.<kind>``, ``model.embed_tokens``,
``model.norm``, ``lm_head``), its sharding plan's fused parts are concatenated
(q/k/v and gate/up in the dense family) and its stacked parts stacked (a MoE's
per-expert tensors into one [experts, ...] parameter: sharding.StackSlot). Also the load formats (``LOAD_FORMATS``: auto
and safetensors read the checkpoint, dummy draws seeded random weights on the target
device so that real shapes can be benchmarked without downloading them) and the
resolution of the model argument: ``None`` means the bundled model.

Tensor parallelism: given a ``TPGroup`` of size t > 1, the loader builds rank
``group.rank``'s shard (the family's sharding plan) and reads only its slices of the checkpoint
(``safe_open(...).get_slice``: the other ranks' bytes are never read; under expert
parallelism another rank's experts are skipped whole). Dummy weights are
drawn whole, in the TP=1 model's order from the same seed, and cut, so the TP=t dummy
model is exactly the TP=1 dummy model, sharded (the draw costs each rank the whole
model's random numbers, once, one tensor at a time).
"""

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from ...common.config import LOAD_FORMATS
from .config import ModelConfig
from .family import ModelFamily
from .llama import CausalLM
from ..parallel.group import TPGroup
from .families import family_of, read_model_config
from .sharding import Cut, TPShard, cut

# Dummy weights: normal(0, std) matrices and biases, norms at 1. std is the usual HF
# initializer_range: activations stay O(1) through 32+ layers in bf16 as in fp32.
DUMMY_SEED = 0
DUMMY_STD = 0.02

# model.layers.<i>.<part>.<kind>: kind weight, bias, or a named tensor (e_score_correction_bias)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(\w+)$")


def resolve_model_dir(model: str | Path | None) -> Path:
    """The folder to load: the bundled model when ``model`` is None or its id."""
    from ...common.bundled import BUNDLED_MODEL_ID
    from .convert import bundled_model_dir

    if model is None or str(model) == BUNDLED_MODEL_ID:
        return bundled_model_dir()
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"model: {model!r} is not a model folder (no config.json there); "
                         f"pass a Hugging Face safetensors folder or omit it for {BUNDLED_MODEL_ID}")
    return path


def read_safetensors(model_dir: Path, shard: TPShard | None = None) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint, single-file or sharded, under their family's weight map's
    names; with ``shard`` (TP > 1) only that rank's slice of each (the family's sharding
    plan), checked against the full shape."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (model_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"model: {model_dir} holds no model.safetensors nor a sharded index; for random "
                         "weights from its config.json alone use load_format dummy (--load-format dummy)")
    cfg = read_model_config(model_dir)
    family = family_of(cfg.architecture)
    tensors = {}
    for name in files:
        with safe_open(model_dir / name, framework="pt") as f:
            for key in f.keys():
                hf = family.weight_map(key)
                m = _LAYER.match(hf)
                if m and int(m.group(1)) >= cfg.num_layers:
                    continue  # not a layer of the served model (DeepSeek's multi-token-prediction layer)
                if shard is not None and m and not family.sharding.held(f"{m.group(2)}.{m.group(3)}", shard):
                    continue  # another rank's expert: not a byte of it is read
                c = None if shard is None or shard.size == 1 else _hf_key_cut(hf, shard, cfg, family)
                tensors[hf] = f.get_tensor(key) if c is None else _read_cut(f, key, c, model_dir)
    return tensors


def _hf_key_cut(key: str, shard: TPShard, cfg: ModelConfig, family: ModelFamily) -> Cut | None:
    """The cut rank ``shard`` reads of the tensor named ``key`` (None: all of it)."""
    m = _LAYER.match(key)
    if m:
        return family.sharding.cut(m.group(2), m.group(3), shard, cfg)
    if key in ("model.embed_tokens.weight", "lm_head.weight"):
        return family.sharding.cut(key.split(".")[-2], "weight", shard, cfg)
    return None


def _read_cut(f, key: str, c: Cut, model_dir: Path) -> torch.Tensor:
    """Read only the rows or columns ``c`` of ``key`` from an open safetensors file."""
    sl = f.get_slice(key)
    shape = sl.get_shape()
    if c.dim >= len(shape) or c.stop > shape[c.dim]:
        raise ValueError(f"model: {key} in {model_dir} has shape {tuple(shape)}, too small for its "
                         f"tensor-parallel slice [{c.start}, {c.stop}) of dim {c.dim}: config.json implies more")
    piece = sl[c.start:c.stop] if c.dim == 0 else sl[:, c.start:c.stop]
    return cut(piece, Cut(0, 0, piece.shape[0], c.pad_to)) if c.pad_to is not None else piece


def load_model(model_dir: Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               load_format: str = "auto", group: TPGroup | None = None) -> CausalLM:
    """The model of ``model_dir`` in ``dtype`` on ``device``; ``load_format`` is one of
    LOAD_FORMATS (dummy reads only config.json). With ``group`` (TP > 1): rank
    ``group.rank``'s shard, reading only its slices."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format: must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    cfg = read_model_config(model_dir)
    model = _build(cfg, group)
    if load_format == "dummy":
        weights = dummy_weights(model, dtype, torch.device(device))
    else:
        weights = {k: v.to(device=device, dtype=dtype) for k, v in hf_to_ours(model, model_dir).items()}
    model.load_state_dict(weights, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rope = model.make_rope(cfg)  # rebuild the RoPE tables off the meta device
    return model.to(device).eval()


def hf_to_ours(model: CausalLM, model_dir: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under our names (the family's fused parts fused), checked
    against the parameters of ``model`` (on the meta device): nothing missing, nothing
    left over, every shape as config.json implies."""
    cfg = model.cfg
    plan = family_of(cfg.architecture).sharding
    fused_parts = plan.fused
    hf = read_safetensors(model_dir, model.shard)
    ours: dict[str, torch.Tensor] = {}
    stacks: dict[str, dict[tuple[int, int], torch.Tensor]] = {}  # our stacked name -> (row, piece) -> tensor
    for key in list(hf):
        m = _LAYER.match(key)
        slot = plan.stacked(f"{m.group(2)}.{m.group(3)}", model.shard) if m else None
        if m and slot is not None:
            stacks.setdefault(f"layers.{m.group(1)}.{slot.name}", {})[slot.row, slot.piece] = hf.pop(key)
        elif key == "model.embed_tokens.weight":
            ours["embed_tokens.weight"] = hf.pop(key)
        elif key == "model.norm.weight":
            ours["norm.weight"] = hf.pop(key)
        elif key == "lm_head.weight" and not cfg.tie_word_embeddings:
            ours["lm_head.weight"] = hf.pop(key)
        elif m and not any(m.group(2) in parts for parts in fused_parts.values()):
            ours[f"layers.{m.group(1)}.{m.group(2)}.{m.group(3)}"] = hf.pop(key)
    for i in range(cfg.num_layers):
        for fused, parts in fused_parts.items():
            for kind in ("weight", "bias"):
                names = [f"model.layers.{i}.{p}.{kind}" for p in parts]
                if all(n in hf for n in names):
                    ours[f"layers.{i}.{fused}.{kind}"] = torch.cat([hf.pop(n) for n in names])
    for name, pieces in stacks.items():
        rows, per_row = 1 + max(r for r, _ in pieces), 1 + max(p for _, p in pieces)
        if len(pieces) != rows * per_row:
            raise ValueError(f"model: {name} in {model_dir}: {rows * per_row - len(pieces)} of its "
                             f"{rows} x {per_row} stacked tensors (experts x parts) are missing")
        ours[name] = torch.stack([torch.cat([pieces[r, p] for p in range(per_row)]) for r in range(rows)])
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
    on ``device`` in ``dtype``: the same weights on every call on a given device. A
    rank's shard gets its cut of the whole model's weights (drawn whole, in order)."""
    gen = torch.Generator(device=device).manual_seed(DUMMY_SEED)
    shard = model.shard
    # the names, order and shapes of the TP=1 draw (a data-parallel rank holds only some experts)
    full = _build(model.cfg, None) if shard.size > 1 or shard.expert_parallel else model
    shard_full = family_of(model.cfg.architecture).sharding.full
    out = {}
    for name, param in full.named_parameters():  # a tied head is listed once, as embed_tokens
        t = torch.empty(param.shape, dtype=dtype, device=device)
        t = t.fill_(1.0) if name.endswith("norm.weight") else t.normal_(0.0, DUMMY_STD, generator=gen)
        out[name] = shard_full(name, t, shard, model.cfg)
    return out


def _build(cfg: ModelConfig, group: TPGroup | None) -> CausalLM:
    """The family's module for ``cfg`` on the meta device (no memory until weights land)."""
    with torch.device("meta"):
        model = family_of(cfg.architecture).module(cfg, group)
    assert isinstance(model, CausalLM), f"{cfg.architecture}: a family's module is a CausalLM (family.py)"
    return model
