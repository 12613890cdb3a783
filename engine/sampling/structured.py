"""Structured outputs in the engine: grammars compiled with xgrammar, one matcher per
request, and the logits mask of each sampling step.

Owns, per engine:
  - the tokenizer's xgrammar view (`TokenizerInfo`, built once, on the first structured
    request, from the model folder's tokenizer (transformers' `AutoTokenizer`) and the
    model's vocab size and EOS ids);
  - an offline engine's compiled grammars, cached by `GrammarSpec` (LRU,
    `MAX_CACHED_GRAMMARS`), so a schema is compiled once however many requests use it;
  - `GrammarState`: a request's matcher, advanced by every token appended to the
    request (``Request.append_tokens``), the first token sampled on another node included;
  - `GrammarMasker`: for the rows of a sampling step that have a grammar, one batched
    xgrammar call fills a `[S, ceil(V / 32)]` int32 bitmask on the host, copied to the
    logits' device, where xgrammar's kernel sets every refused token to -inf. It runs
    after the forward pass is queued and before the sampler's one device-to-host copy,
    so on CUDA the host fills the mask while the GPU computes.

A grammar that completes allows only the stop tokens (EOS), and a request whose grammar
terminated finishes with "stop" (``Request.check_stop``).

Who compiles: a node compiles in worker processes under a CPU-time limit
(node/grammar_service.py, engine/sampling/grammar_worker.py) and carries the compiled grammar to
the engine with the request (``AddRequest`` / ``AddPrefilled``), so the engine thread
never compiles; the offline `LLM` compiles here, in its caller's thread (`compile()`,
thread-safe). Everything else runs on the engine thread. Must not know about HTTP, the
scheduler or the sampler's internals.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...common.errors import InvalidRequest
from ...common.grammar_limits import MAX_CACHED_GRAMMARS
from ...common.structured_outputs import FIELD, GrammarKind, StructuredOutputsParams
from .grammar_worker import XGR_PREFIX, compile_spec

if TYPE_CHECKING:
    import xgrammar as xgr

# Threads xgrammar may use to compile one grammar (offline) and to fill one batch's bitmask.
XGRAMMAR_THREADS = 4
KIND_FIELDS = {GrammarKind.JSON: "json", GrammarKind.JSON_OBJECT: "json_object", GrammarKind.REGEX: "regex",
               GrammarKind.CHOICE: "choice", GrammarKind.GRAMMAR: "grammar"}


@dataclass(slots=True)
class GrammarState:
    """One request's position in its grammar."""

    matcher: Any  # xgrammar.GrammarMatcher
    rejected: int | None = None  # the first token the grammar refused (then the request fails)

    def accept(self, token_id: int) -> None:
        if self.rejected is None and not self.matcher.accept_token(token_id):
            self.rejected = token_id

    @property
    def terminated(self) -> bool:
        """The grammar completed and accepted a stop token."""
        return self.matcher.is_terminated()


class GrammarCache:
    """The compiled grammars of one offline engine, and every engine's matchers."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: Sequence[int]):
        self._model_dir = Path(model_dir)
        self._vocab_size = vocab_size  # the logits' width (may exceed the tokenizer's)
        self._eos = list(eos_token_ids)
        self._lock = threading.Lock()
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiled: OrderedDict[Any, xgr.CompiledGrammar] = OrderedDict()  # GrammarSpec -> grammar, LRU
        self.compiles = 0  # grammars compiled here (cache misses), a counter for tests and metrics

    def tokenizer_info(self) -> xgr.TokenizerInfo:
        """The model's tokenizer as xgrammar sees it (`InvalidRequest` when the model folder has
        no tokenizer that loads). Seconds: call it off an event loop."""
        import xgrammar as xgr
        from transformers import AutoTokenizer
        try:
            tokenizer = AutoTokenizer.from_pretrained(self._model_dir)
        except (OSError, ValueError, TypeError) as e:  # no tokenizer files (load_format dummy)
            raise InvalidRequest(FIELD, f"structured outputs need the model's tokenizer, and "
                                 f"{self._model_dir} has none that loads: {e}") from None
        return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._eos)

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar of validated ``params``, compiled in this thread (the offline
        `LLM`; a node never calls this); `InvalidRequest` naming ``structured_outputs.<field>``
        when it does not compile."""
        spec = params.spec()
        with self._lock:
            hit = self._compiled.get(spec)
            if hit is not None:
                self._compiled.move_to_end(spec)
                return hit
            if self._compiler is None:  # built on first use: most engines never load xgrammar
                import xgrammar as xgr
                self._compiler = xgr.GrammarCompiler(self.tokenizer_info(), max_threads=XGRAMMAR_THREADS)
            compiler = self._compiler
        try:
            compiled = compile_spec(compiler, spec)
        except RuntimeError as e:  # xgrammar reports every bad schema, regex or grammar so
            message = XGR_PREFIX.sub("", str(e)).strip()
            raise InvalidRequest(f"{FIELD}.{KIND_FIELDS[spec.kind]}", f"cannot be compiled: {message}") from None
        with self._lock:
            self.compiles += 1
            self._compiled[spec] = compiled
            while len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return compiled

    def check(self, params: StructuredOutputsParams) -> None:
        """`InvalidRequest` unless the grammar compiles (and accepts ``resume_token_ids``)."""
        self.new_state(params)

    def new_state(self, params: StructuredOutputsParams, compiled: Any = None) -> GrammarState:
        """A matcher at the grammar's start, advanced past ``params.resume_token_ids``.
        ``compiled``: the grammar, when the caller carries it (a node's); None compiles it here."""
        return start_state(compiled if compiled is not None else self.compile(params), params)


def start_state(compiled: Any, params: StructuredOutputsParams) -> GrammarState:
    """A matcher of ``compiled`` (``params``' grammar) at its start, advanced past
    ``params.resume_token_ids`` (`InvalidRequest` if the grammar refuses them)."""
    import xgrammar as xgr
    state = GrammarState(xgr.GrammarMatcher(compiled))
    for token_id in params.resume_token_ids:
        state.accept(token_id)
    if state.rejected is not None:
        raise InvalidRequest(f"{FIELD}.resume_token_ids", f"token {state.rejected} does not follow the "
                             "grammar from its start")
    return state


class GrammarMasker:
    """Masks the logits of the rows whose request has a grammar, in place (the logits
    are the forward pass's fresh output; the sampler reads them next). Engine thread only."""

    def __init__(self, vocab_size: int, device: torch.device):
        import xgrammar as xgr
        self._vocab = vocab_size
        self._device = device
        self._batch = xgr.BatchGrammarMatcher(max_threads=XGRAMMAR_THREADS)
        self._bitmask = self._allocate(1)  # [S, ceil(V / 32)] int32 on the host, grown on demand
        self.busy_s = 0.0  # host seconds spent filling and applying masks (a metric)

    def __call__(self, logits: torch.Tensor, grammars: Sequence[GrammarState | None]) -> torch.Tensor:
        """``logits`` [S, V], row i for ``grammars[i]`` (None: unconstrained); returns them."""
        import xgrammar as xgr
        rows = [i for i, g in enumerate(grammars) if g is not None]
        if not rows:
            return logits
        t0 = time.perf_counter()
        if self._bitmask.shape[0] < len(grammars):
            self._bitmask = self._allocate(len(grammars))
        bitmask = self._bitmask[:len(grammars)]  # [S, W]; rows without a grammar are not read
        matchers = [g.matcher for g in grammars if g is not None]  # one per entry of rows
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        words = bitmask.to(logits.device, non_blocking=True)  # [S, W]
        # xgrammar's kernel: a C++ loop on the CPU, Triton on CUDA; refused tokens -> -inf
        xgr.apply_token_bitmask_inplace(logits, words, vocab_size=self._vocab, indices=rows)
        self.busy_s += time.perf_counter() - t0
        return logits

    def _allocate(self, rows: int) -> torch.Tensor:
        """A host bitmask (pinned when it is copied to a GPU: the copy is then asynchronous)."""
        import xgrammar as xgr
        bitmask = xgr.allocate_token_bitmask(rows, self._vocab)
        return bitmask.pin_memory() if self._device.type == "cuda" else bitmask
