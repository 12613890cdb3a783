"""What the family registry (families.py) knows of one model family: how its config.json
becomes a ``ModelConfig`` (the config adapter), the module that runs it, how its
checkpoint's tensor names map onto the module's, how the module is cut over
tensor-parallel ranks, and its parameter counts. One file per family defines one
``FAMILY`` (the built-in dense family: llama.py).

Must not read files or build modules itself: a family is a table of functions.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from torch import nn

from .config import ModelConfig
from ..parallel.group import TPGroup
from .sharding import ShardingPlan


class ParamCount(NamedTuple):
    """A model's parameters, from its config's shapes alone."""

    total: int  # every parameter (a tied head once): what the weights take
    active: int  # those one token's forward pass multiplies (total in a dense model; a MoE's routed share)


@dataclass(frozen=True, slots=True)
class ModelFamily:
    architectures: tuple[str, ...]  # config.json architectures[0] values it serves
    config: Callable[[dict], ModelConfig]  # config adapter: config.json -> the frozen config
    # The whole model, or with a TPGroup of size t > 1 that rank's shard, built on the current
    # device (the loader builds it on "meta"). A CausalLM (llama.py), whose forward the engine
    # runs: a family with another feed-forward or attention block passes CausalLM its factory
    # (llama.FeedForward, llama.AttentionBlock) and, with other rotary tables, their class.
    module: Callable[[ModelConfig, TPGroup | None], nn.Module]
    # a checkpoint tensor's name -> the module's Hugging Face-style name
    # (model.layers.<i>.self_attn.q_proj.weight, ...: loader.py)
    weight_map: Callable[[str], str]
    sharding: ShardingPlan
    parameters: Callable[[ModelConfig], ParamCount]
