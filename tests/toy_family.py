"""A model family from outside the package, in one file, as a user adds one
(docs/models.md, "Adding a model family"): tests/test_family_registry.py names this file in
$SPLITSERVE_MODEL_FAMILIES.

The toy family is the dense Llama under an architecture transformers does not have
(``ToyDenseForCausalLM``), whose checkpoint uses Meta's original tensor names
(``tok_embeddings``, ``layers.<i>.attention.wq``, ``feed_forward.w1``, ``output``, ...)
and whose config.json names two fields its own way (``ffn_dim``, ``norm_eps``). It maps
both onto the dense module and reuses its sharding plan and parameter counts.
``save_toy_checkpoint`` writes a transformers Llama folder in the toy's form.
"""

import json
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from splitserve.engine.models.config import ModelConfig
from splitserve.engine.models.family import ModelFamily
from splitserve.engine.models.llama import CausalLM, dense_parameters
from splitserve.engine.models.sharding import DENSE_SHARDING

ARCHITECTURE = "ToyDenseForCausalLM"
CONFIG_NAMES = {"ffn_dim": "intermediate_size", "norm_eps": "rms_norm_eps"}  # toy's -> Hugging Face's
# inside a layer: toy's -> Hugging Face's
LAYER_NAMES = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
               "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
               "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
               "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm",
               "ffn_norm": "post_attention_layernorm"}
TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
_TOY_LAYER = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def toy_config(cfg: dict) -> ModelConfig:
    """The config adapter: the toy's field names renamed, then the dense reading (no biases)."""
    return ModelConfig.from_hf({CONFIG_NAMES.get(k, k): v for k, v in cfg.items()},
                               qkv_bias=False, o_bias=False, qk_norm=False)


def toy_names(key: str) -> str:
    """The weight map: a toy tensor name -> the dense module's (unknown names pass through,
    for the loader to refuse)."""
    m = _TOY_LAYER.match(key)
    if m and m.group(2) in LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return TOP_NAMES.get(key, key)


FAMILY = ModelFamily(architectures=(ARCHITECTURE,), config=toy_config, module=CausalLM, weight_map=toy_names,
                     sharding=DENSE_SHARDING, parameters=dense_parameters)


def save_toy_checkpoint(llama_dir: Path, out: Path) -> None:
    """Write the transformers Llama folder ``llama_dir`` (no tied head) at ``out`` in the toy's
    form: config.json renamed, one model.safetensors under Meta's names, tokenizer files copied."""
    out.mkdir(parents=True)
    cfg = json.loads((llama_dir / "config.json").read_text())
    hf_to_toy = {v: k for k, v in CONFIG_NAMES.items()}
    toy_cfg = {hf_to_toy.get(k, k): v for k, v in cfg.items()}
    toy_cfg.update(architectures=[ARCHITECTURE], model_type="toy_dense")
    (out / "config.json").write_text(json.dumps(toy_cfg, indent=2))
    layer_names, top_names = {v: k for k, v in LAYER_NAMES.items()}, {v: k for k, v in TOP_NAMES.items()}
    tensors = {}
    for f in sorted(llama_dir.glob("*.safetensors")):
        for key, t in load_file(f).items():
            m = _HF_LAYER.match(key)
            name = f"layers.{m.group(1)}.{layer_names[m.group(2)]}.{m.group(3)}" if m else top_names[key]
            tensors[name] = t
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    for f in llama_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
