"""ModelConfig: the architecture of a Llama-family checkpoint, read from its
Hugging Face ``config.json`` and frozen. The single place config.json is read;
owns nothing else (no weights, no torch).

Families (``architectures[0]``) and how they differ, as flags the model reads:

    family   | qkv_bias           | o_bias         | qk_norm | tied embeddings | sliding window
    ---------+--------------------+----------------+---------+-----------------+---------------------------
    Llama    | attention_bias     | attention_bias | no      | from config     | none
    Qwen2    | always             | never          | no      | from config     | layer_types / use_sliding_window
    Qwen3    | attention_bias     | attention_bias | yes     | from config     | layer_types / use_sliding_window
    Mistral  | never              | never          | no      | from config     | sliding_window (all layers)

Sliding-window attention is not implemented in the attention backends. Instead, a
window smaller than the model's context caps the usable context at the window
(``max_position_embeddings`` here is the usable context), with a log line: every
token then sees its whole prefix, which is exactly what the window allows, so the
output matches transformers for every sequence that fits.
"""

import json
import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# architectures[0] -> (qkv bias, o_proj bias, q/k RMSNorm); None: the config's attention_bias
_FAMILIES: dict[str, tuple[bool | None, bool | None, bool]] = {
    "LlamaForCausalLM": (None, None, False),
    "Qwen2ForCausalLM": (True, False, False),
    "Qwen3ForCausalLM": (None, None, True),
    "MistralForCausalLM": (False, False, False),
}
SUPPORTED_ARCHITECTURES = tuple(_FAMILIES)
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "mistral": "MistralForCausalLM"}  # model_type -> architecture, for configs without architectures
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # independent of hidden_size / num_heads in Qwen3
    max_position_embeddings: int  # usable context: the config's, capped at a sliding window
    rms_norm_eps: float
    rope_theta: float
    # None, or the HF rope scaling dict ({"rope_type": "linear"|"llama3", "factor": ...}).
    rope_scaling: tuple[tuple[str, object], ...] | None
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # RMSNorm over head_dim on each q and k head, before RoPE
    sliding_window: int | None  # the checkpoint's window, when some layer uses one
    eos_token_ids: tuple[int, ...]

    @property
    def rope_scaling_dict(self) -> dict | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """KV cache bytes one token takes over all layers, K and V, at ``itemsize`` bytes per value."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * itemsize

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"model: {model_dir} has no config.json; pass a Hugging Face model folder")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        archs = cfg.get("architectures") or [_MODEL_TYPES.get(cfg.get("model_type", ""), "LlamaForCausalLM")]
        arch = archs[0]
        if arch not in _FAMILIES:
            raise ValueError(f"model: config.json architectures: {arch} is not supported; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        qkv_bias, o_bias, qk_norm = _FAMILIES[arch]
        attention_bias = bool(cfg.get("attention_bias", False))
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"model: config.json hidden_act: {cfg['hidden_act']!r} is not supported (silu)")
        heads = cfg["num_attention_heads"]
        num_layers = cfg["num_hidden_layers"]
        theta, scaling = _rope(cfg)
        window = _sliding_window(cfg, arch, num_layers)
        max_pos = cfg.get("max_position_embeddings", 2048)
        if window is not None and window < max_pos:
            log.warning("model: %s uses a %d-token sliding window, which splitserve does not implement; "
                     "the usable context is capped at %d tokens (config.json max_position_embeddings: %d)",
                     arch, window, window, max_pos)
            max_pos = window
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position_embeddings=max_pos,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias if qkv_bias is None else qkv_bias,
            o_bias=attention_bias if o_bias is None else o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=qk_norm,
            sliding_window=window,
            eos_token_ids=eos_ids,
        )


def _rope(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None for the default RoPE)."""
    # transformers >= 5 nests RoPE settings in rope_parameters; older configs
    # keep rope_theta / rope_scaling at the top level.
    rope = dict(cfg.get("rope_parameters") or {})
    theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or rope or None
    if scaling is None:
        return theta, None
    scaling = dict(scaling)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"model: config.json rope_scaling.rope_type: {kind!r} is not supported "
                         f"({', '.join(ROPE_TYPES)})")
    if kind == "default":
        return theta, None
    scaling["rope_type"] = kind
    return theta, scaling


def _sliding_window(cfg: dict, arch: str, num_layers: int) -> int | None:
    """The attention window when any layer uses one, else None."""
    window = cfg.get("sliding_window")
    if window is None:
        return None
    if arch == "MistralForCausalLM":  # every layer, whenever the config names a window
        return int(window)
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        types = cfg.get("layer_types")
        if types is not None:
            return int(window) if "sliding_attention" in types else None
        # older configs: layers from max_window_layers on slide when use_sliding_window
        uses = cfg.get("use_sliding_window", False) and cfg.get("max_window_layers", num_layers) < num_layers
        return int(window) if uses else None
    return None
