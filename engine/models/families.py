"""The family registry: config.json's architecture name -> its ``ModelFamily`` (family.py:
config adapter, module, weight map, sharding plan, parameter counts), and the reading of
a model folder's config through it (``read_model_config``).

A family is one file defining ``FAMILY``. The built-in ones are listed in ``BUILTIN``
(the dense family, llama.py: Llama, Qwen2, Qwen3, Mistral; the MoE families, moe_family.py:
Qwen3-MoE, Mixtral, Qwen2-MoE). A family from outside the package is named in the
environment variable ``SPLITSERVE_MODEL_FAMILIES``: a comma-separated list of importable
module names (``my_pkg.my_family``) or paths of ``.py`` files, each defining ``FAMILY``.
Every process that reads a config (each node,
its worker ranks, ``splitserve up``'s members, the offline ``LLM``) loads them on its
first lookup; processes inherit the variable, so setting it where ``splitserve up``
starts covers the whole cluster. The router never reads it: it needs only the
tokenizer, the chat template and config.json's context (common/hf_config.py).

Must not build modules or read weights (loader.py does).
"""

import os
from functools import cache
from pathlib import Path

from ...common.hf_config import architecture, read_config_json
from ...common.plugins import load_specs
from . import deepseek, llama, moe_family
from .config import ModelConfig
from .family import ModelFamily

FAMILIES_ENV = "SPLITSERVE_MODEL_FAMILIES"
BUILTIN = (llama.FAMILY, moe_family.FAMILY, deepseek.FAMILY)


def family_of(arch: str) -> ModelFamily:
    """The family serving architecture ``arch``; raises naming the supported ones."""
    families = _families(os.environ.get(FAMILIES_ENV, ""))
    if arch not in families:
        raise ValueError(f"model: config.json architectures: {arch} is not supported; supported: "
                         f"{', '.join(families)} (a family of your own: ${FAMILIES_ENV}, see docs/models.md)")
    return families[arch]


def model_config(cfg: dict) -> ModelConfig:
    """The frozen config of config.json ``cfg``, read by its family's config adapter."""
    return family_of(architecture(cfg)).config(cfg)


def read_model_config(model_dir: str | Path) -> ModelConfig:
    """The frozen config of the model folder ``model_dir``."""
    return model_config(read_config_json(model_dir))


@cache
def _families(spec: str) -> dict[str, ModelFamily]:
    """architecture -> family: the built-ins, then each module of ``spec`` ($SPLITSERVE_MODEL_FAMILIES)."""
    out: dict[str, ModelFamily] = {}
    loaded = load_specs(FAMILIES_ENV, spec, "FAMILY", ModelFamily, "splitserve_family")
    for family, source in [(f, "built in") for f in BUILTIN] + [(f, e) for e, f in loaded]:
        taken = sorted(set(family.architectures) & out.keys())
        if taken:
            raise ValueError(f"{FAMILIES_ENV}: {source} registers {', '.join(taken)}, which another family "
                             "serves already; give the family its own architecture name")
        out.update((arch, family) for arch in family.architectures)
    return out
