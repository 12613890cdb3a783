"""SimRunner: the ModelRunner of a simulated node. The block pool, prefix cache,
scheduler and every server around the engine run for real; only the forward pass
is replaced by a sleep as long as the timing model (``common.config.SimConfig``)
says the real model would take, and a deterministic token (common/sim_tokens.py: a
function of the position a client can reproduce).

Owns: the KV cache size (the real model's block bytes, or the profile's
``SimConfig.kv_bytes_per_token``, so a simulated node holds as many tokens as a
real one with the same ``kv_cache_memory``), the context (the profile's
``SimConfig.max_model_len`` replaces the model folder's, so a node standing for a
128k-context model is not held to the bundled model's 8192), and a KV tensor of one
float per token slot, so the KV transport moves real, checksummed, tiny blocks:

    kv_caches  [1 layer, 2 (K, V), num_blocks, block_size, 1 head, head_dim 1]

The prefix cache's lower tiers (engine/kv/tier_store.py) hold stand-in blocks too; their
sizes are given in the modelled model's bytes like the KV cache's (``standin_tiers``
turns them into the stand-ins' bytes: as many blocks as a real node's tiers hold), and
the moves between the tiers since the last step (``KVCacheManager.take_moves``) cost what
they would take the deployment (``SimConfig.host_bytes_per_s``: host memory <-> the KV
cache, a load or a store; ``disk_read_bytes_per_s``: a load from disk, which then
crosses into the KV cache as a host load too):

    stores to host memory    the copy engine's timeline, one batch (``Move.batch``) after
                             another: a batch starts when the step that queued it ended, or
                             when the batch before it landed, and costs no step
    a forward that overwrites a block, or reads a slot, whose store batch
                             (``KVCacheManager.before_forward``) is still copying starts when
                             that batch lands
    disk reads, a reservation's loads
                             before the step that follows them starts: a real engine reads a
                             disk block on its own thread, and waits for a reservation's
                             loads whole (kv/tier_store.py ``Move.whole``)
    loads                    on the step that follows them, one layer after another as a
                             real engine issues them (kv/tier_store.py ``LayerLoads``): the
                             forward's layer i starts when the loads' layer i and the
                             forward's layer i - 1 are done, a pipeline of the profile's
                             layers (``SimConfig.num_layers``) whose stages split the loads
                             and the forward evenly: max(loads, forward) + min(loads,
                             forward) / layers; the blocks in place (``launch``'s ``ready``:
                             a prefill node packs a cached prefix to send) once the loads
                             and the wait above are done
    a store to disk          the disk tier's writer thread's: not priced
    a step of no rows        its loads alone (a prompt loading a long run: scheduler.py)

What it priced is what the engine measures (the stand-in blocks' own copies time nothing:
kv/tier_store.py ``TierSpec.timed_by_runner``): each load's seconds per tier
(``KVCacheManager.observe_load``), the forward of a step computing prompt tokens beside no
load (``observe_prefill``) and of one of the running batch alone (``observe_batch``), in
simulated seconds, so the scheduler prices a load in prompt tokens as the modelled node
would, whatever the speed-up.

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
from collections.abc import Callable, Sequence

import torch

from ..common.config import EngineConfig
from ..common.kv_events import Tier
from ..common.sim_tokens import sim_token
from .kv.cache_manager import KVCacheManager
from .kv.tier_store import Move
from .models.loader import resolve_model_dir
from .models.config import ModelConfig
from .models.families import read_model_config
from .model_runner import KVCacheFactory, kv_block_bytes
from .runner import LaunchedStep, Runner, prompt_tokens, split
from .sampling.sampler import SampledTokens
from .scheduler import SchedulerOutput

_STANDIN_DTYPE = torch.float32  # one value per token slot, K and V, of the stand-in blocks


def standin_block_bytes(block_size: int) -> int:
    """Bytes of one stand-in block (the KV cache shape above)."""
    return 2 * block_size * _STANDIN_DTYPE.itemsize


def modelled_block_bytes(config: EngineConfig, model_config: ModelConfig) -> int:
    """Bytes of one KV block of the model a simulated node stands for: the profile's
    (``SimConfig.kv_bytes_per_token``), else the model folder's own."""
    assert config.sim is not None
    if config.sim.kv_bytes_per_token:
        return config.sim.kv_bytes_per_token * config.block_size
    return kv_block_bytes(model_config, config.block_size, _STANDIN_DTYPE)


def standin_tiers(config: EngineConfig) -> EngineConfig:
    """A simulated node's ``config`` with its lower tiers' sizes (``kv_offload_memory``,
    ``kv_offload_disk_bytes``: bytes of the modelled model's KV, as ``kv_cache_memory`` is)
    in bytes of the stand-in blocks the engine's tiers hold: as many blocks as the modelled
    node's tiers. The engine sizes its tiers from the KV cache it is given (engine/kv/tier_store.py)."""
    if not config.kv_offload_memory:
        return config
    real = modelled_block_bytes(config, read_model_config(resolve_model_dir(config.model)))
    standin = standin_block_bytes(config.block_size)
    return dataclasses.replace(config, kv_offload_memory=config.kv_offload_memory // real * standin,
                               kv_offload_disk_bytes=config.kv_offload_disk_bytes // real * standin)


class SimRunner(Runner):
    def __init__(self, config: EngineConfig, model_dir, kv_cache_factory: KVCacheFactory | None = None):
        assert config.sim is not None
        self.config = config
        self.sim = config.sim
        model_config = read_model_config(model_dir)
        if self.sim.max_model_len:
            model_config = dataclasses.replace(model_config, max_position_embeddings=self.sim.max_model_len)
        self.model_config = model_config
        self.num_layers = self.sim.num_layers or model_config.num_layers  # the stages loads overlap with
        bs = config.block_size
        self.block_bytes = modelled_block_bytes(config, model_config)
        self.num_blocks = config.kv_cache_memory // self.block_bytes
        if self.num_blocks < 2:
            raise ValueError(f"kv_cache_memory: {config.kv_cache_memory} bytes hold fewer than 2 blocks of "
                             f"{self.block_bytes} bytes; raise it")
        shape = (1, 2, self.num_blocks, bs, 1, 1)
        self.kv_caches = (kv_cache_factory(shape, _STANDIN_DTYPE) if kv_cache_factory else
                          torch.zeros(shape, dtype=_STANDIN_DTYPE))
        assert self.kv_caches[:, :, 0].numel() * self.kv_caches.element_size() == standin_block_bytes(bs)
        self.simulated_seconds = 0.0  # total step time asked of the model (a metric)
        self.overrun_s = 0.0  # wall seconds steps took beyond their simulated time / speedup
        self._last_end = 0.0  # when the previous launch returned (monotonic)
        self._copies_until = 0.0  # when the copy engine is done with the stores queued so far (monotonic)
        self._batch_landed: dict[int, float] = {}  # store batch -> when it lands (monotonic), until then

    def expert_load(self) -> dict[int, float]:
        return {}  # a timing model routes no token

    def launch(self, out: SchedulerOutput, kv: KVCacheManager,
               ready: Callable[[], None] | None = None) -> LaunchedStep:
        """Sleep the step's simulated time (divided by the speed-up), then sample a token
        at each of every row's last ``num_verify`` tokens (the returned step is complete: a simulated node gains nothing from async scheduling).
        The step's wait for a store batch comes first, then its loads beside its forward
        (module docstring); ``ready`` is called once the loads are done (the blocks it reads
        are in place)."""
        start = time.monotonic()
        # this step's work waited as the last one ended: the host's time since is part of its period
        carry = start - self._last_end if any(r.arrival_time <= self._last_end for r, _ in out.scheduled) else 0.0
        rows = split(out)
        decodes = [r.request.num_computed_tokens for r in rows.decodes]
        chunks = [(r.num_tokens, r.request.num_computed_tokens) for r in rows.chunks]
        if (layer_loads := kv.take_loads()) is not None:
            layer_loads.wait_all()  # the stand-in blocks move for real; the time is the profile's
        wait, loads = self._tier_seconds(kv, start)
        forward = self.sim.step_seconds(len(decodes), chunks, sum(decodes)) if out.rows else 0.0
        prompt = prompt_tokens(out)
        if not loads and prompt >= self.config.block_size:
            kv.observe_prefill(prompt, forward)  # the recompute rate, as the modelled node's
        elif not loads and not prompt and out.rows:
            kv.observe_batch(forward)  # the running batch alone: the loads a step hides
        # the forward's layer i waits for the loads' layer i: a pipeline of `layers` stages
        seconds = wait + (max(loads, forward) + min(loads, forward) / self.num_layers if loads else forward)
        self.simulated_seconds += seconds
        if ready is not None:
            left = start - carry + (wait + loads) / self.sim.speedup - time.monotonic()
            if left > 0:
                time.sleep(left)
            ready()
        verifying = [r for r in out.rows if r.num_verify]
        tokens, params = [], []
        for row in verifying:
            req = row.request
            for i in range(row.num_verify):
                tokens.append(sim_token(req.seq_len + i, req.stop_ids))
                params.append(req.sampling_params)
        left = start - carry + seconds / self.sim.speedup - time.monotonic()
        if left > 0:
            time.sleep(left)
        else:
            self.overrun_s += -left
        self._last_end = time.monotonic()
        sampled = SampledTokens(torch.tensor(tokens), None, params, []) if tokens else None
        return LaunchedStep(verifying, sampled, sum(r.num_tokens for r in out.rows))

    def _tier_seconds(self, kv: KVCacheManager, start: float) -> tuple[float, float]:
        """Simulated seconds of the step launched at ``start`` (wall) spent on its tiers: its
        wait before anything of it starts (for the copy engine, and for the loads it waits for
        whole: disk reads, a reservation's loads), and its loads beside the forward (module
        docstring)."""
        moves = kv.take_moves()
        queued = self._last_end or start  # as the previous step ended
        for m in moves:
            if m.batch:
                self._copies_until = max(self._copies_until, queued) + self.tier_move_seconds([m]) / self.sim.speedup
                self._batch_landed[m.batch] = self._copies_until
        landed = self._batch_landed.get(kv.before_forward(), 0.0)
        self._batch_landed = {b: t for b, t in self._batch_landed.items() if t > start}
        wait = max(0.0, landed - start) * self.sim.speedup
        loads = 0.0
        for m in moves:
            if m.load:
                seconds = self.tier_move_seconds([m])
                kv.observe_load(m.tier, m.nbytes, seconds)  # what the engine measures: the modelled time
                if m.whole:
                    wait += seconds
                else:
                    loads += seconds
        return wait, loads

    def tier_move_seconds(self, moves: Sequence[Move]) -> float:
        """Simulated seconds of ``moves`` at the profile's rates (module docstring)."""
        seconds = 0.0
        for m in moves:
            if m.tier is Tier.HOST and self.sim.host_bytes_per_s:
                seconds += m.blocks * self.block_bytes / self.sim.host_bytes_per_s
            elif m.tier is Tier.DISK and m.load and self.sim.disk_read_bytes_per_s:
                seconds += m.blocks * self.block_bytes / self.sim.disk_read_bytes_per_s
        return seconds
