"""The conversations of a trace (lines naming one: TraceRequest.conversation, written by
``make-trace`` for closed-loop presets): turn k+1 is sent ``think_ms`` after turn k's
answer ended, and its prompt is what the model saw and said so far::

    turn 1      the line's hash ids expanded (common/trace.py prompt_tokens)
    turn k+1    turn k's prompt + the ids turn k's node generated + the line's new tokens:
                its expansion past turn k's input_length + output_length (the user message
                and tool result the generator added after the answer)

So the decode node that served turn k, which cached the blocks of the tokens it generated,
holds most of turn k+1's prompt. The router does not return generated ids (completions'
logprobs carry text; ``return_token_ids`` is refused), so they are computed: a simulated
node's tokens are a fixed function of the position (common/sim_tokens.py). Each answer's
streamed text is checked against those ids' text: ``not_reproduced`` counts answers that
differ (their next turn's prompt is then not what the node generated: a broken run).

Also the pooled bound: one shared prefix cache that never evicts, in the nodes' blocks.
A request hits the leading blocks of its prompt that an earlier prompt or answer filled
(at most (prompt - 1) // block_size blocks: an engine computes the last token); its
prompt's blocks join the cache when it is sent, its answer's (all but the last token,
whose KV is never computed) when it is answered.

Owns the turn chain, the prompts and the bound. Must not talk to a cluster.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from splitserve.common.hashing import hash_blocks
from splitserve.common.prompt_ref import PromptKeys
from splitserve.common.sim_tokens import sim_answer
from splitserve.common.trace import HASH_BLOCK, TraceRequest, prompt_tokens


class Conversations:
    """The turns of ``requests`` (sorted by timestamp, as load_trace returns them), their
    prompts in nodes' blocks of ``block_size`` tokens hashed as ``model_id``'s."""

    def __init__(self, requests: Sequence[TraceRequest], block_size: int, model_id: str,
                 hash_block: int = HASH_BLOCK):
        self.requests, self.block_size, self.hash_block = requests, block_size, hash_block
        self._keys = PromptKeys(model=model_id).hash_keys()
        self.previous: dict[int, int] = {}  # a later turn's index -> its conversation's turn before it
        self.next_turn: dict[int, int] = {}  # the reverse
        last: dict[int, int] = {}
        for i, r in enumerate(requests):
            if r.conversation is None:
                continue
            if (p := last.get(r.conversation)) is not None:
                before = requests[p]
                if r.input_length <= before.input_length + before.output_length:
                    raise ValueError(f"trace: conversation {r.conversation}: the turn at {r.timestamp} ms has "
                                     f"{r.input_length} input tokens, not more than the turn before it and its "
                                     f"answer ({before.input_length} + {before.output_length})")
                self.previous[i], self.next_turn[p] = p, i
            last[r.conversation] = i
        self.count = len(last)
        self._said: dict[int, list[int]] = {}  # a turn with a next one -> its prompt + answer, until sent
        self._cache: set[int] = set()  # the pooled bound's block hashes
        self.pooled_hits = [0] * len(requests)  # per request: the bound's cached prompt tokens
        self.prompt_lengths = [0] * len(requests)  # per request: the prompt sent
        self.not_reproduced = 0
        self._decode: Callable[[list[int], bool], str] | None = None  # the tokenizer's, once needed

    @classmethod
    def of(cls, requests: Sequence[TraceRequest], block_size: int, model_id: str,
           hash_block: int = HASH_BLOCK) -> Conversations | None:
        """The conversations of ``requests``; None when no line names one."""
        if all(r.conversation is None for r in requests):
            return None
        return cls(requests, block_size, model_id, hash_block)

    def prompt(self, i: int) -> list[int]:
        """Request ``i``'s prompt (module docstring); call it once, as it is sent (after the
        turn before it was answered), which puts it in the pooled bound."""
        r = self.requests[i]
        tokens = prompt_tokens(r, hash_block=self.hash_block)
        if (p := self.previous.get(i)) is not None:
            before = self.requests[p]
            tokens = self._said.pop(p) + tokens[before.input_length + before.output_length:]
        hashes = hash_blocks(tokens, self.block_size, self._keys)
        hit = 0
        for h in hashes[:(len(tokens) - 1) // self.block_size]:
            if h not in self._cache:
                break
            hit += 1
        self.pooled_hits[i], self.prompt_lengths[i] = hit * self.block_size, len(tokens)
        self._cache.update(hashes)
        return tokens

    def answered(self, i: int, prompt: list[int], tokens: int, text: str) -> None:
        """Request ``i`` (sent with ``prompt``) was answered with ``tokens`` tokens streamed
        as ``text`` (0 and "" when it failed: the next turn then follows the prompt alone)."""
        answer = sim_answer(len(prompt), tokens)
        if answer and self._text(answer) != text:
            self.not_reproduced += 1
        said = prompt + answer
        self._cache.update(hash_blocks(said[:-1], self.block_size, self._keys))
        if i in self.next_turn:
            self._said[i] = said

    def _text(self, ids: list[int]) -> str:
        if self._decode is None:  # the bundled model's tokenizer, as the router detokenizes
            from tokenizers import Tokenizer

            from splitserve.common.bundled import converted_dir
            self._decode = Tokenizer.from_file(str(converted_dir() / "tokenizer.json")).decode
        return self._decode(ids, True)  # skip_special_tokens

    def summary(self) -> dict:
        """The figures a replay reports about its conversations."""
        return {"conversations": self.count, "later_turns": len(self.previous),
                "answers_not_reproduced": self.not_reproduced}

    def pooled_hit_rate(self) -> float:
        """The bound's cached prompt tokens over the prompt tokens sent."""
        sent = sum(self.prompt_lengths)
        return sum(self.pooled_hits) / sent if sent else 0.0
