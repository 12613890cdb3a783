"""Bring-up of an engine's runner and the ranks beside it: what ``EngineCore`` builds first.

Owns choosing the runner and starting what it needs, in order: this process's torch threads
(placement.py), then one of

    tensor_parallel_size N > 1   check the model splits N ways (before any process starts); the
                                 workers started here (a TPLeader of its own: offline use) or by
                                 the node (its leader handed in); join them (launch.py), pin rank
                                 0 to its cores; rank 0's ModelRunner over its shard, linked to them
    data_parallel_size N > 1     check the model splits; join the data-parallel group
                                 (data_parallel.py); a ModelRunner over a group of one carrying it
    neither                      a ModelRunner (TP 1)
    a simulated node (sim set)   a SimRunner: the same engine, a timing model for the forward
                                 (it stands for TP in its timing alone: no rank starts)

and undoing it (``Ranks.close``: stop the workers, leave the data-parallel group, give the
process its cores back). A failure while the ranks join is worded by the leader (which rank,
how it ended) and leaves nothing started. Must not: schedule, step or know the engine's
requests (engine_core.py), or how a node supervises its processes (node/ranks.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from ...common.config import EngineConfig
from ..model_runner import KVCacheFactory, ModelRunner
from ..models.families import read_model_config
from ..models.sharding import check_model_tp
from ..parallel.group import DataParallel, TPFailure, TPGroup
from ..runner import Runner
from .placement import pin_process, rank_cpus, rank_device, rank_threads

if TYPE_CHECKING:
    from .launch import TPLeader

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Ranks:
    """What bringing up a runner started beside it, for the engine to undo in ``close``."""
    tp: TPLeader | None = None  # rank 0's leader of the node's worker ranks (tensor_parallel_size > 1)
    dp: DataParallel | None = None  # this engine's data-parallel group (data_parallel_size > 1)
    unpinned: set[int] | None = None  # the cores this process had before rank 0 was pinned

    def close(self) -> None:
        """Stop the worker ranks, if any, leave the data-parallel group, and give this process
        back the cores it had before rank 0 was pinned to its share (idempotent)."""
        if self.tp is not None:
            self.tp.close()
        if self.dp is not None:
            self.dp.close()
        if self.unpinned is not None:
            pin_process(self.unpinned)
            self.unpinned = None


class Started(NamedTuple):
    runner: Runner
    ranks: Ranks


def start_runner(config: EngineConfig, model_dir: Path, kv_cache_factory: KVCacheFactory | None = None,
                 tp: TPLeader | None = None) -> Started:
    """The engine's runner and what it started (module docstring). ``tp``: rank 0's leader of
    a node whose workers it started; None with ``tensor_parallel_size`` > 1 starts them here,
    as child processes."""
    size = config.tensor_parallel_size
    threads = rank_threads(config.num_threads, size if config.sim is None else 1,
                           rank_device(config.device, 0))
    if threads:
        torch.set_num_threads(threads)
    if config.sim is None and size > 1:  # a simulated node stands for TP in its timing alone
        return _start_tp(config, model_dir, kv_cache_factory, tp)
    if config.sim is None:
        assert tp is None, "a TP leader for an engine with tensor_parallel_size 1"
        dp = _join_data_parallel(config, model_dir)
        group = None if dp is None else TPGroup.single(config.device, data_parallel=dp)
        return Started(ModelRunner(config, model_dir, kv_cache_factory, group), Ranks(dp=dp))
    # a simulated node: same engine, timing model in place of the forward pass
    from ..sim_runner import SimRunner
    return Started(SimRunner(config, model_dir, kv_cache_factory), Ranks())


def _join_data_parallel(config: EngineConfig, model_dir: Path) -> DataParallel | None:
    """The data-parallel group of a rank of a DP node, joined once the model is known to split
    (a clear error before any rendezvous); None at data_parallel_size 1."""
    if config.data_parallel_size == 1:
        return None
    from .data_parallel import join_data_parallel

    check_model_tp(read_model_config(model_dir), 1, dp=config.data_parallel_size)
    assert config.data_parallel_address is not None, "EngineConfig checks it"
    return join_data_parallel(config.data_parallel_rank, config.data_parallel_size, torch.device(config.device),
                              config.data_parallel_address)


def _start_tp(config: EngineConfig, model_dir: Path, kv_cache_factory: KVCacheFactory | None,
              tp: TPLeader | None) -> Started:
    """Rank 0's runner, after the workers joined (started here when ``tp`` is None)."""
    from .launch import TPLeader  # zmq and multiprocessing: only for an engine of several ranks

    size = config.tensor_parallel_size
    # before any process starts
    check_model_tp(read_model_config(model_dir), size, config.enable_expert_parallel)
    if tp is None:
        tp = TPLeader(size)
        tp.spawn_workers(config)
    assert tp.size == size, f"a TP leader of {tp.size} ranks for tensor_parallel_size {size}"
    ranks = Ranks(tp=tp)
    try:
        device = rank_device(config.device, 0)
        group = tp.join(device, config.enable_expert_parallel)
        cpus = rank_cpus(0, size, device)
        if cpus is not None:  # CPU ranks of one host: each on its own cores (undone by close())
            ranks.unpinned = pin_process(cpus)
        return Started(ModelRunner(config, model_dir, kv_cache_factory, group, tp), ranks)
    except TPFailure as e:
        failure = tp.explain(e)
        ranks.close()
        raise failure from e
    except BaseException:
        ranks.close()
        raise
