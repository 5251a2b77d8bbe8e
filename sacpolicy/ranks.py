"""Where this process stands in a distributed run, from the environment its launcher set, and the rules the pipeline
follows under one: each rank on its own GPU, side effects on rank 0 only, the other ranks waiting for them.

Launchers and what they set:
- ``torchrun --nproc-per-node N scripts/train.py ...``: every rank starts the script at once with ``RANK``,
  ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` / ``MASTER_PORT`` (its agent's store).
- Lightning's DDP launcher (``trainer.strategy=ddp``, ``devices=N``): rank 0 runs the script alone until its first
  ``Trainer.fit``, then starts ranks 1..N-1 as new processes of the same command with ``LOCAL_RANK``,
  ``NODE_RANK`` and ``WORLD_SIZE`` set (no ``RANK``); everything rank 0 did before is on disk by then.

Standard library and torch only (no room of sacpolicy), so every layer may ask it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

# the process group this module starts under torchrun (Lightning's is 30 minutes): rank 0's data preparation (the
# target's continuations, feature caches) may take longer than that while the other ranks wait at a barrier
GROUP_TIMEOUT = timedelta(hours=int(os.environ.get("SACPOLICY_DIST_TIMEOUT_H", "6")))


@dataclass(frozen=True)
class Rank:
    rank: int
    local_rank: int
    world_size: int

    @property
    def zero(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def current(env: Mapping[str, str] | None = None) -> Rank:
    """This process's rank, local rank and world size: the running process group's, else torchrun's ``RANK``, else
    Lightning's ``NODE_RANK`` and ``LOCAL_RANK`` (rank 0 exactly when both are 0), else a single process. (Lightning
    removes ``WORLD_SIZE`` when a ``fit`` ends; its process group stays.)"""
    if env is None:
        import torch.distributed as dist

        env = os.environ
        if dist.is_available() and dist.is_initialized():
            return Rank(dist.get_rank(), int(env.get("LOCAL_RANK", "0")), dist.get_world_size())
    local = int(env.get("LOCAL_RANK", "0"))
    world = int(env.get("WORLD_SIZE", "1"))
    if "RANK" in env:
        rank = int(env["RANK"])
    else:
        node = int(env.get("NODE_RANK", env.get("GROUP_RANK", "0")))
        per_node = int(env.get("LOCAL_WORLD_SIZE", "0")) or max(world, 1)
        rank = node * per_node + local
    return Rank(rank, local, world)


def local_device(device, env: Mapping[str, str] | None = None):
    """``device`` (a ``torch.device``) with this rank's GPU: a CUDA device without an index is ``cuda:$LOCAL_RANK``
    when a launcher set ``LOCAL_RANK`` (so N ranks of one node load onto N GPUs, not all onto ``cuda:0``); an
    explicit index or another device is kept."""
    import torch

    env = os.environ if env is None else env
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and "LOCAL_RANK" in env:
        return torch.device("cuda", int(env["LOCAL_RANK"]))
    return device


def _torchrun(env: Mapping[str, str]) -> bool:
    return "RANK" in env and "MASTER_ADDR" in env and "MASTER_PORT" in env


def ensure_group() -> bool:
    """Whether a process group is running, after starting one under torchrun (NCCL with a GPU, else gloo; Lightning
    then trains in it). A Lightning-launched rank does not start one: its rank 0 is already inside ``fit``, where
    Lightning starts the group."""
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        return False
    if dist.is_initialized():
        return True
    if not (current().distributed and _torchrun(os.environ)):
        return False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(current().local_rank)
    dist.init_process_group(backend, timeout=GROUP_TIMEOUT)
    return True


def barrier() -> None:
    import torch.distributed as dist

    if current().distributed and ensure_group():
        dist.barrier()


def rank_zero_first(fn: Callable[[], T], what: str = "") -> T:
    """``fn()`` on rank 0 first, then on the other ranks, which by then read what it wrote (caches made by
    ``fn``). One process: just ``fn()``. A rank Lightning launched before any group exists runs ``fn`` at once: its
    rank 0 did it before launching it."""
    r = current()
    if not r.distributed or not ensure_group():
        return fn()
    if r.zero:
        out = fn()
        barrier()
        return out
    logger.info("rank %d waits for rank 0: %s", r.rank, what or getattr(fn, "__name__", "its preparation"))
    barrier()
    return fn()


def wait_for(path, failed=None, *, since: float | None = None, poll_s: float = 0.5, log_every_s: float = 60.0,
             timeout_s: float | None = None):
    """Block until file ``path`` exists (rank 0 wrote it; written atomically, so it is whole). ``failed``: a file
    whose appearance (newer than ``since``) means rank 0 gave up; raises ``RuntimeError`` with its text."""
    from pathlib import Path

    path, t0, last = Path(path), time.monotonic(), time.monotonic()
    failed = Path(failed) if failed is not None else None
    while not path.exists():
        if failed is not None and failed.exists() and (since is None or failed.stat().st_mtime >= since):
            raise RuntimeError(f"rank 0 failed while making {path.name}: {failed.read_text()[:2000]}")
        now = time.monotonic()
        if timeout_s is not None and now - t0 > timeout_s:
            raise TimeoutError(f"rank {current().rank} waited {timeout_s:.0f}s for rank 0 to write {path}")
        if now - last >= log_every_s:
            last = now
            logger.info("rank %d still waiting for rank 0 to write %s", current().rank, path)
        time.sleep(poll_s)
    return path


def share_run_dir(argv: list[str], env: Mapping[str, str] | None = None, store=None) -> list[str]:
    """``argv`` with one ``hydra.run.dir`` for every rank of a torchrun launch: Hydra resolves ``${now}`` in each
    process, so ranks started a second apart would write two run directories. Rank 0 picks the directory
    (``outputs/<date>/<time>``, as conf/train.yaml names it) and publishes it in torchrun's store; the other ranks
    read it there and leave Hydra's own ``.hydra`` files to rank 0. Unchanged for one process, a Lightning launch
    (Lightning passes rank 0's directory on itself) or an explicit ``hydra.run.dir``."""
    env = os.environ if env is None else env
    r = current(env)
    if not r.distributed or not _torchrun(env) or any(a.startswith(("hydra.run.dir=", "-m", "--multirun"))
                                                       for a in argv[1:]):
        return argv
    key = "sacpolicy/run_dir"
    if store is None:
        import torch.distributed as dist

        try:
            store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                                  timeout=timedelta(minutes=5))
        except (RuntimeError, OSError) as exc:  # an older launcher without an agent store
            logger.warning("rank %d cannot reach torchrun's store (%s): ranks may resolve two run directories; pass "
                           "hydra.run.dir=<dir> to every rank", r.rank, exc)
            return argv
    if r.zero:
        run_dir = time.strftime("outputs/%Y-%m-%d/%H-%M-%S")
        store.set(key, run_dir)
    else:
        run_dir = store.get(key).decode()
    extra = [f"hydra.run.dir={run_dir}"] + ([] if r.zero else ["hydra.output_subdir=null"])
    return [*argv, *extra]
