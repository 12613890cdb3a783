"""A model folder's Hugging Face ``config.json`` as any process reads it, without torch:
the file itself, the architecture it names, and the usable context. The router checks
prompts against that context (router/tokenizer.py) and every node caps its own at
it (the families' config adapters, engine/models/), so both read it here, the same way.

Sliding-window attention is not implemented in the attention backends. Instead, a
window smaller than the model's context caps the usable context at the window: every
token then sees its whole prefix, which is exactly what the window allows, so the
output matches transformers for every sequence that fits. Which layers slide:

    architecture        | sliding window
    --------------------+-------------------------------------------
    Mistral             | sliding_window (all layers)
    Qwen2, Qwen3        | layer_types / use_sliding_window
    any other           | none

Must not import torch or engine code. Any family's config.json names its context
``max_position_embeddings`` (default 2048), as Hugging Face's do.
"""

import json
from pathlib import Path

# model_type -> architecture, for configs without ``architectures``
MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "mistral": "MistralForCausalLM"}


def read_config_json(model_dir: str | Path) -> dict:
    """The folder's config.json as a dict."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"model: {model_dir} has no config.json; pass a Hugging Face model folder")
    return json.loads(path.read_text())


def architecture(cfg: dict) -> str:
    """``architectures[0]``, else the architecture of ``model_type``, else Llama."""
    archs = cfg.get("architectures") or [MODEL_TYPES.get(cfg.get("model_type", ""), "LlamaForCausalLM")]
    return archs[0]


def sliding_window(cfg: dict) -> int | None:
    """The attention window when any layer uses one, else None."""
    window, arch = cfg.get("sliding_window"), architecture(cfg)
    if window is None:
        return None
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):  # every layer, whenever the config names a window
        return int(window)
    if arch == "Qwen3MoeForCausalLM":  # every layer, when use_sliding_window
        return int(window) if cfg.get("use_sliding_window", False) else None
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM"):
        types = cfg.get("layer_types")
        if types is not None:
            return int(window) if "sliding_attention" in types else None
        # older configs: layers from max_window_layers on slide when use_sliding_window
        num_layers = cfg["num_hidden_layers"]
        uses = cfg.get("use_sliding_window", False) and cfg.get("max_window_layers", num_layers) < num_layers
        return int(window) if uses else None
    return None


def usable_context(cfg: dict) -> int:
    """The context a node serves: ``max_position_embeddings``, capped at a sliding window."""
    window, context = sliding_window(cfg), cfg.get("max_position_embeddings", 2048)
    return window if window is not None and window < context else context
