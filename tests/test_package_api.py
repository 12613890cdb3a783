"""The top-level offline API: ``from splitserve import LLM, SamplingParams`` gives the
engine's classes, and ``import splitserve`` alone (or with SamplingParams) stays light:
no torch, no engine."""

import subprocess
import sys

import pytest

HEAVY = "[m for m in sys.modules if m in ('torch', 'transformers') or m.startswith('splitserve.engine')]"


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("code", ["import splitserve",
                                  "import splitserve; from splitserve import SamplingParams; SamplingParams()"])
def test_import_stays_light(code):
    out = _run(f"import sys; {code}; bad = {HEAVY}; print(bad); sys.exit(1 if bad else 0)")
    assert out.returncode == 0, out.stdout + out.stderr


def test_top_level_names_are_the_engine_classes():
    out = _run("import splitserve, sys; from splitserve import LLM, SamplingParams, RequestOutput\n"
               "from splitserve.engine.llm import LLM as L, RequestOutput as R\n"
               "from splitserve.common.sampling_params import SamplingParams as S\n"
               "assert (LLM, SamplingParams, RequestOutput) == (L, S, R)\n"
               "assert {'LLM', 'SamplingParams'} <= set(dir(splitserve))\n"
               "try:\n    splitserve.NoSuchName\nexcept AttributeError as e:\n    print(e)\n"
               "else:\n    sys.exit(1)")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "NoSuchName" in out.stdout


def test_llm_from_top_level_generates(bundled_dir):
    from splitserve import LLM, SamplingParams

    llm = LLM(model=str(bundled_dir), kv_cache_memory=16 << 20)
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4))[0]
    assert len(out.token_ids) == 4 and out.text
