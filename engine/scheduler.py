"""Scheduler: decides, every step, which requests compute how many tokens.

One rule for everything (see ``request.py``): a scheduled request computes
``min(num_tokens - num_computed_tokens, budget left, prefill_chunk_size)`` tokens.
A prefill row (more than its sequence's last token) also draws from ``prefill_step_budget``; a decode does not.

    step budget (max_num_batched_tokens)
    |-- running requests first, in admission order (decodes take 1, unfinished
    |   prompts take a chunk): continuous batching with chunked prefill
    '-- then waiting requests, FIFO, while budget, blocks and max_num_seqs last
        and nothing was preempted this step: prefix-cache hit first (those
        tokens are never computed), then a chunk

A prefix hit below the device (host memory, disk: kv/tier_store.py) is not free: loading
its blocks takes the step time, so the step's prefill budget pays for it too, each block
priced at what loading it costs in prompt tokens the engine computes meanwhile (the
measured rates, ``KVCacheManager.lower_plan``). A request loads the leading blocks of its
run that the budget left affords (its *pending run*, kept by the KV cache manager), at
least one when no prompt work came before it this step, and computes only once the whole
run is loaded: a long run loads over several steps, a budget's worth each, and a request
may be running with no row in a step (loads only). Beside running decodes a step's loads
also take no longer than a step of the batch alone (``hidden_load_tokens``, measured):
they overlap its forward layer by layer, so the decodes' step is not lengthened. A lookup
finds disk hits in the index without reading them; each is read once, when it loads.

    prefill_step_budget (or the step budget); loads beside decodes: also what a step hides
    |-- a running request's pending run: its next blocks' loads
    |-- a running prompt's chunk (once its run is loaded)
    '-- a waiting request: its run's first blocks, then (all loaded) a chunk

A running prefill row whose prefill budget is spent is skipped this step (the decodes
after it still run); a waiting request that would get none stays at the head of the
queue. Running rows come first, in admission order, so the oldest prefill always gets
its chunk: the prefill budget bounds every step's prompt tokens without starving any.

A waiting request whose next uncached prompt block is being computed right now by a
running request (the n choices of one prompt, or prompts sharing a system prompt,
arriving together) waits at the head of the queue until that block is cached, then
takes it from the prefix cache instead of computing it again. It never waits on a
request that is not running, and running requests always progress, so it cannot
wait forever.

When the block pool cannot hold a running request's next tokens, the most recently
admitted running request is preempted by recompute: its blocks are freed and it
goes back to the head of the queue with ``num_computed_tokens = 0`` (its full
blocks usually survive in the prefix cache). A request never waits on itself:
the engine admits no request that could not fit the KV cache alone (RequestLimits,
engine/limits.py), so the oldest running request always progresses, and no
request is dropped.

Async scheduling (engine_core.py) calls ``schedule`` while the previous step still
runs. A running request whose last token is still on the device (``pending_tokens``)
decodes that token's position (the runner reads its id on the device), unless that
token already ends it by length; a preempted request with a pending token is not
readmitted before the token lands, since recompute needs every id on the host.
"""

from collections import deque
from typing import NamedTuple

from .kv.cache_manager import KVCacheManager
from .request import Request, Status


class Row(NamedTuple):
    """One request's part of a step: the tokens it computes, and how many of them, the last
    ones, the step samples at. A row that reaches the end of its sequence (a decode, a
    prompt's last chunk) verifies 1: the token after it is sampled there. With speculative
    decoding a row would carry ``num_proposed`` drafts after its last token and verify
    ``1 + num_proposed``; the engine keeps the drafts its verification accepts and rolls
    back the others (``Request.rollback``)."""
    request: Request
    num_tokens: int  # tokens computed this step, its proposed ones included
    num_verify: int  # its last tokens whose logits are sampled: 0 (a chunk mid-prompt), 1, or 1 + num_proposed
    num_proposed: int  # drafts placed after its last token for this step to verify (0: nothing proposes yet)


class SchedulerOutput(NamedTuple):
    rows: list[Row]  # running order
    preempted: list[Request]

    @property
    def scheduled(self) -> list[tuple[Request, int]]:
        """(request, tokens to compute this step) of each row, for readers that need no more."""
        return [(r.request, r.num_tokens) for r in self.rows]


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 prefill_chunk_size: int, max_model_len: int, prefill_step_budget: int | None = None):
        """``prefill_step_budget``: the most tokens one step's prefill rows compute together
        (None: only ``max_num_batched_tokens`` bounds them)."""
        self.kv = kv
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunk = prefill_chunk_size
        self.prefill_step_budget = prefill_step_budget
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # req_id -> request, until finished
        self.num_preemptions = 0  # since start (a metric)

    def add(self, req: Request) -> None:
        assert req.request_id not in self.requests, req.request_id
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def add_running(self, req: Request) -> None:
        """Admit a request whose blocks are already allocated and computed (KV transfer)."""
        assert req.request_id not in self.requests, req.request_id
        self.requests[req.request_id] = req
        req.status = Status.RUNNING
        self.running.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        # None: never below ``budget``, which every row draws from, so it binds nothing
        full = float(self.prefill_step_budget or budget)
        prefill_left = full  # prompt tokens, and the loads' price in them (module docstring)
        load_left = self.load_allowance()  # the loads also draw from this
        rows: list[Row] = []
        preempted: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.pending_tokens and req.ends_by_length(self.max_model_len):
                i += 1  # the token on the device is its last: nothing more to compute
                continue
            pending = self.kv.pending_lower(req.request_id)
            plan = self.kv.lower_plan(pending, min(prefill_left, load_left), prefill_left >= full)
            start = req.num_computed_tokens + plan.blocks * self.kv.block_size
            n = self._num_tokens(req.seq_len - start, budget, prefill_left - plan.tokens) \
                if plan.blocks == len(pending) else 0
            if n == 0 and plan.blocks == 0:
                i += 1  # a prefill row (or a run to load), and this step's prefill budget is spent
                continue
            while self.kv.allocate_slots(req.request_id, start + n, num_load=plan.blocks) is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                break
            prefill_left -= plan.tokens
            load_left -= plan.tokens
            if plan.blocks:
                req.num_computed_tokens = self.kv.num_cached_tokens(req.request_id)  # fewer: the run ended
            if n:
                prefill_left -= n if req.seq_len - req.num_computed_tokens > 1 else 0
                rows.append(self._row(req, n))
                budget -= n
            i += 1

        while self.waiting and not preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.pending_tokens:  # preempted while a step sampled for it: recompute once it lands
                break
            # prompt logprobs need the logits of every prompt position: cached blocks have none
            hashes = [] if req.sampling_params.prompt_logprobs is not None else req.block_hashes
            hit = self.kv.get_computed_blocks(hashes, req.all_token_ids, req.salt)
            if self._prefix_in_flight(req, hashes, hit.num_tokens):
                break
            plan = self.kv.lower_plan(hit.lower, min(prefill_left, load_left), prefill_left >= full)
            start = (len(hit.blocks) + plan.blocks) * self.kv.block_size
            n = self._num_tokens(req.num_tokens - start, budget, prefill_left - plan.tokens) \
                if plan.blocks == len(hit.lower) else 0
            if (n == 0 and plan.blocks == 0) or self.kv.allocate_slots(
                    req.request_id, start + n, hit.blocks, hit.lower, num_load=plan.blocks) is None:
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            req.num_computed_tokens = self.kv.num_cached_tokens(req.request_id)  # hits loaded (all, or the run ended)
            self.running.append(req)
            prefill_left -= plan.tokens
            load_left -= plan.tokens
            if n:
                prefill_left -= n if req.seq_len - req.num_computed_tokens > 1 else 0
                rows.append(self._row(req, n))
                budget -= n
        return SchedulerOutput(rows, preempted)

    def load_allowance(self, whole: bool = False) -> float:
        """What one step's lower-tier loads may cost, in prompt tokens, before anything else
        draws: the prefill budget, and beside running decodes no more than a step of them hides
        (``KVCacheManager.hidden_load_tokens``): nothing when the next step waits for them
        ``whole`` (a reservation's), since those hide behind no forward."""
        full = float(self.prefill_step_budget or self.max_num_batched_tokens)
        if any(r.num_computed_tokens >= len(r.prompt_token_ids) for r in self.running):  # decoding
            return 0.0 if whole else min(full, self.kv.hidden_load_tokens())
        return full

    def _num_tokens(self, remaining: int, budget: int, prefill_left: float) -> int:
        """Tokens a row with ``remaining`` uncomputed ones computes this step: a prefill row
        (``remaining`` > 1; it draws them from the prefill budget) is capped by the prefill
        budget left too, so it may get 0."""
        n = min(remaining, budget, self.chunk)
        return n if remaining == 1 else max(0, min(n, int(prefill_left)))

    @staticmethod
    def _row(req: Request, n: int) -> Row:
        """``req``'s row computing its next ``n`` tokens: it verifies one if they reach the end.
        Its first row records the prefix hits before it (device and loaded: the tokens it never
        computes) as its cached tokens."""
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = req.num_computed_tokens
        return Row(req, n, int(req.num_computed_tokens + n == req.seq_len), 0)

    def _prefix_in_flight(self, req: Request, hashes: list[int], num_cached: int) -> bool:
        """Whether the block after ``req``'s cached prefix is one a running request is
        computing (its prompt's full blocks not yet computed), so it will be cached soon."""
        if not self.kv.enable_prefix_caching:
            return False
        bs = self.kv.block_size
        nxt = num_cached // bs
        if nxt >= min(len(hashes), (req.num_tokens - 1) // bs):
            return False  # no further block could be a hit
        want = hashes[nxt]
        return any(want in r.block_hashes[r.num_computed_tokens // bs:len(r.prompt_token_ids) // bs]
                   for r in self.running if r.num_computed_tokens < len(r.prompt_token_ids))

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.request_id)
        req.status = Status.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance computed counts and register newly full blocks in the prefix cache."""
        for row in out.rows:
            row.request.num_computed_tokens += row.num_tokens
            self.cache_computed(row.request)

    def cache_computed(self, req: Request) -> None:
        """Register the request's blocks that are full of computed tokens whose ids are on
        the host (a block completed by a pending token is registered once that lands)."""
        if req.status is Status.RUNNING:
            self.kv.cache_blocks(req.request_id, req.block_hashes, req.all_token_ids,
                                 min(req.num_computed_tokens, req.num_tokens), req.salt)

    def finish(self, req_id: str, reason: str) -> Request | None:
        """Finish (or abort) a request and free its blocks. Idempotent: None if unknown."""
        req = self.requests.pop(req_id, None)
        if req is None:
            return None
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        self.kv.free(req_id)
        req.status = Status.FINISHED
        req.finish_reason = reason
        return req
