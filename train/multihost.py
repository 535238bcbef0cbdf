"""Several processes (hosts) running one training job: start-up, global batches, barriers.

Every process runs the same command. `initialize(cfg)` calls `jax.distributed.initialize`
(before anything touches a device) when the run asks for it: `--coordinator HOST:PORT
--num-processes N --process-id I` on any machines, or `--distributed` alone where JAX finds
the cluster itself (Cloud TPU pods, SLURM, Open MPI, Kubernetes). Afterwards `jax.devices()`
lists every process's devices and the mesh spans them all.

Each process reads the same global batch (the pipeline is deterministic and cheap next to a
step) and hands JAX only the rows of its own devices (`global_batch`). Files (run config,
metrics, export) are written by process 0 only; `main_first` orders work that must not race
on the shared output directory.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import jax
import numpy as np
from jax.experimental import multihost_utils

from train.config import TrainConfig

T = TypeVar("T")


def initialize(cfg: TrainConfig) -> None:
    """`jax.distributed.initialize` with the run's settings, if it asks for several processes."""
    if not cfg.is_distributed:
        return
    # CPU devices of different processes talk through gloo (the default CPU backend has no
    # cross-process collectives); GPU and TPU backends ignore this setting.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=cfg.coordinator,
                               num_processes=cfg.num_processes, process_id=cfg.process_id)


def is_main() -> bool:
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process reaches `name` (nothing to wait for with one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def main_first(name: str, fn: Callable[[], T]) -> T:
    """`fn()` on process 0, then on the others (e.g. preparing a shared data cache once)."""
    if is_main():
        result = fn()
        barrier(name)
        return result
    barrier(name)
    return fn()


def global_batch(arrays: dict[str, np.ndarray], sharding) -> dict[str, jax.Array]:
    """Global arrays from host arrays every process holds in full; each process places only
    the slices of its own devices."""
    return {k: jax.make_array_from_callback(x.shape, sharding, lambda index, x=x: x[index])
            for k, x in arrays.items()}


def to_host(tree: Any) -> Any:
    """numpy copies of (possibly non-addressable) global arrays, on every process."""
    if jax.process_count() > 1:
        tree = multihost_utils.process_allgather(tree, tiled=True)
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)
