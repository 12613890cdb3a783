"""SimRunner: the ModelRunner of a simulated node. The block pool, prefix cache,
scheduler and every server around the engine run for real; only the forward pass
is replaced by a sleep as long as the timing model (``common.config.SimConfig``)
says the real model would take, and a deterministic token.

Owns: the KV cache size (the real model's block bytes, or the profile's
``SimConfig.kv_bytes_per_token``, so a simulated node holds as many tokens as a
real one with the same ``kv_cache_memory``), the context (the profile's
``SimConfig.max_model_len`` replaces the model folder's, so a node standing for a
128k-context model is not held to the bundled model's 8192), and a KV tensor of one
float per token slot, so the KV transport moves real, checksummed, tiny blocks:

    kv_caches  [1 layer, 2 (K, V), num_blocks, block_size, 1 head, head_dim 1]

A step's period is its simulated time / speedup, the host's own time included: when a
step's work was already there as the previous step ended (a batch running on, a prompt
queued), the wall time the host spent between the two (the scheduler, the node's
bookkeeping: what ``step_overhead_s`` of a profile already stands for) is taken off
the next sleep. Whatever the host takes beyond the period is
``overrun_s`` (wall seconds): a machine too slow for the speed-up, which a run must
report instead of its figures (``/debug/state``: ``sim_overrun_s``).

Must not: load weights or compute. Sampled tokens are never an EOS or stop id,
so a simulated request runs to ``max_tokens``.
"""

import dataclasses
import time

import torch

from ..common.config import EngineConfig
from .kv_cache_manager import KVCacheManager
from .model_config import ModelConfig
from .model_runner import KVCacheFactory, LaunchedStep, kv_block_bytes
from .sampler import SampledTokens
from .scheduler import SchedulerOutput

_TOKEN_BASE, _TOKEN_SPAN = 1000, 20000  # sampled ids cycle through [1000, 21000)


class SimRunner:
    def __init__(self, config: EngineConfig, model_dir, kv_cache_factory: KVCacheFactory | None = None):
        assert config.sim is not None
        self.config = config
        self.sim = config.sim
        model_config = ModelConfig.from_dir(model_dir)
        if self.sim.max_model_len:
            model_config = dataclasses.replace(model_config, max_position_embeddings=self.sim.max_model_len)
        self.model_config = model_config
        bs = config.block_size
        real_bytes = (self.sim.kv_bytes_per_token * bs if self.sim.kv_bytes_per_token
                      else kv_block_bytes(self.model_config, bs, torch.float32))
        self.num_blocks = config.kv_cache_memory // real_bytes
        if self.num_blocks < 2:
            raise ValueError(f"kv_cache_memory: {config.kv_cache_memory} bytes hold fewer than 2 blocks of "
                             f"{real_bytes} bytes; raise it")
        shape = (1, 2, self.num_blocks, bs, 1, 1)
        self.kv_caches = (kv_cache_factory(shape, torch.float32) if kv_cache_factory else
                          torch.zeros(shape, dtype=torch.float32))
        self.simulated_seconds = 0.0  # total step time asked of the model (a metric)
        self.overrun_s = 0.0  # wall seconds steps took beyond their simulated time / speedup
        self._last_end = 0.0  # when the previous launch returned (monotonic)

    def launch(self, out: SchedulerOutput, kv: KVCacheManager) -> LaunchedStep:
        """Sleep the step's simulated time (divided by the speed-up), then sample one
        token for every request whose scheduled tokens reach the end of its sequence
        (the returned step is complete: a simulated node gains nothing from async scheduling)."""
        start = time.monotonic()
        # this step's work waited as the last one ended: the host's time since is part of its period
        carry = start - self._last_end if any(r.arrival_time <= self._last_end for r, _ in out.scheduled) else 0.0
        decodes = [r.num_computed_tokens for r, n in out.scheduled if n == 1]
        chunks = [(n, r.num_computed_tokens) for r, n in out.scheduled if n > 1]
        seconds = self.sim.step_seconds(len(decodes), chunks, sum(decodes))
        self.simulated_seconds += seconds
        reqs, tokens = [], []
        for req, n in out.scheduled:
            if req.num_computed_tokens + n == req.seq_len:
                token = _TOKEN_BASE + (req.seq_len * 7919) % _TOKEN_SPAN
                while token in req.stop_ids:
                    token += 1
                reqs.append(req)
                tokens.append(token)
        left = start - carry + seconds / self.sim.speedup - time.monotonic()
        if left > 0:
            time.sleep(left)
        else:
            self.overrun_s += -left
        self._last_end = time.monotonic()
        sampled = SampledTokens(torch.tensor(tokens), None, [r.sampling_params for r in reqs], []) if reqs else None
        return LaunchedStep(reqs, sampled, sum(n for _, n in out.scheduled))
