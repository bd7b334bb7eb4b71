"""Decisions every rank takes alike. Under tensor parallelism each rank is its own process: SELECT=fastest must route
every rank the same way (FlashInfer's autotune and the engine's own collectives run on all of them or none). Each rank's
facts are gathered from every rank of the engine's group (its CPU/gloo group where the engine home names one, else
torch.distributed's default group), and every rank computes the same answer from the same list.

Every exchange is bounded: a rank that does not reach the same point within the timeout, or reaches another one, is a
named refusal on every rank that waits, never a hang.
"""

from __future__ import annotations

import datetime
import pickle
import time
from typing import Callable

import torch

from ..errors import RefusedToServe
from .state import STATE


def use_group(find: Callable[[], object]) -> Callable[[], None]:
    """Share decisions in the process group `find()` returns (an engine's tensor-parallel CPU group) where it has one;
    return the undo."""
    STATE.groups.append(find)
    return lambda: STATE.groups.remove(find) if find in STATE.groups else None


def _group() -> object | None:
    """Return the engine's tensor-parallel CPU group, or None (torch.distributed's default group)."""
    for find in list(STATE.groups):
        try:
            group = find()
        except Exception:  # the engine's parallel state is not up (yet): the default group
            continue
        if isinstance(group, torch.distributed.ProcessGroup):
            return group
    return None


def ranks() -> tuple[int, int]:
    """Return (this rank, how many ranks) of the group decisions are shared in; (0, 1) without torch.distributed."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    group = _group()
    return dist.get_rank(group), dist.get_world_size(group)


def gather(point: str, facts: object, timeout_s: float) -> list:
    """Return every rank's `facts` at `point`, in rank order (`[facts]` on one rank); RefusedToServe where a rank does
    not reach `point` within `timeout_s` seconds, or reaches another point."""
    world = ranks()[1]
    if world < 2:
        return [facts]
    dist, group = torch.distributed, _group()
    on_gpu = dist.get_backend(group) == "nccl"  # the default group of a GPU engine: its tensors live on the GPU
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    data = pickle.dumps((point, facts))
    deadline = time.monotonic() + timeout_s
    try:
        sizes = _all_gather(torch.tensor([len(data)], device=device), group, world, deadline)
        mine = torch.zeros(max(int(n) for n in sizes), dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        found = _all_gather(mine.to(device), group, world, deadline)
    except RuntimeError as exc:  # gloo and NCCL: a wait past its timeout, or a peer gone
        raise RefusedToServe(
            refusal(
                f"not every rank reached {point} within {timeout_s:g} s (SM120_FP4_SELFTEST_TIMEOUT): another rank "
                f"stopped or is stuck ({type(exc).__name__}: {exc}); see the other ranks' logs for why"
            )
        ) from exc
    gathered = [pickle.loads(t[: int(n)].cpu().numpy().tobytes()) for t, n in zip(found, sizes)]
    strays = [f"rank {r} was at {p}" for r, (p, _) in enumerate(gathered) if p != point]
    if strays:
        raise RefusedToServe(
            refusal(
                f"the ranks' decisions diverged: this rank was at {point}, {', '.join(strays)}; the ranks must verify "
                "the same layer configurations (see the other ranks' logs for which check failed there)"
            )
        )
    return [f for _, f in gathered]


def refusal(problem: str) -> str:
    """Return the message refusing to serve on this rank because of `problem` (a decision not shared)."""
    rank, world = ranks()
    return f"sm120_fp4: refusing to serve NVFP4 on rank {rank} of {world}: {problem}"


def _all_gather(tensor: torch.Tensor, group, world: int, deadline: float) -> list[torch.Tensor]:
    out = [torch.empty_like(tensor) for _ in range(world)]
    work = torch.distributed.all_gather(out, tensor, group=group, async_op=True)
    if not work.wait(datetime.timedelta(seconds=max(0.001, deadline - time.monotonic()))):
        raise RuntimeError("timed out")
    return out
