"""Placing trial workers on a Ray cluster: one actor per matching GPU (or CPU actors), replaced when lost.

Ray describes a GPU node by its ``GPU`` count and one ``accelerator_type:<TYPE>`` resource (``H200``,
``H100``,
``A100-80G``, ...). :func:`plan_placement` reads those from the cluster before any actor exists, so a card
that is
not there is a clear error within seconds, not a hang; each worker then asks for ``num_gpus=1`` and the
``accelerator_type`` option, so Ray places exactly one per GPU of that type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
import ray.exceptions

from kvtune.tuner.protocol import WorkerInfo, WorkerSpec
from kvtune.tuner.worker import TrialWorker

START_TIMEOUT_S = 900.0  # loading a model on a worker (weights from disk, first CUDA context)
ACCELERATOR_PREFIX = "accelerator_type:"


class WorkerStartError(ValueError):
    """A worker could not start (its model failed to load, or its device is not what was asked for)."""


@dataclass(frozen=True)
class Placement:
    """``count`` workers; each on one GPU of ``accelerator_type`` (Ray's name), or on ``num_cpus`` CPUs if
    None."""

    count: int
    accelerator_type: str | None
    num_cpus: float = 1.0

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"`workers >= 1` must hold, but got workers={self.count}")

    def actor_options(self) -> dict[str, Any]:
        if self.accelerator_type is None:
            return {"num_cpus": self.num_cpus, "num_gpus": 0}
        return {"num_cpus": 0, "num_gpus": 1, "accelerator_type": self.accelerator_type}

    def describe(self) -> str:
        where = f"1 {self.accelerator_type} GPU" if self.accelerator_type else f"{self.num_cpus:g} CPU"
        return f"{self.count} worker(s), {where} each"


def gpus_of_type(accelerator_type: str) -> int:
    """GPUs on the alive nodes of the connected cluster that carry ``accelerator_type:<TYPE>``."""
    key = ACCELERATOR_PREFIX + accelerator_type
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    return sum(int(n["Resources"].get("GPU", 0)) for n in nodes if key in n["Resources"])


def accelerator_types() -> list[str]:
    """The accelerator types the connected cluster reports (e.g. ``['H200']``)."""
    keys = ray.cluster_resources()
    return sorted(k.removeprefix(ACCELERATOR_PREFIX) for k in keys if k.startswith(ACCELERATOR_PREFIX))


def plan_placement(
    accelerator_type: str | None, workers: int | None, cpus_per_worker: float = 1.0
) -> Placement:
    """Check the cluster has what is asked and say how many workers to start (default: one per GPU).

    Raises :class:`ValueError` naming the cluster's GPUs when no GPU of ``accelerator_type`` exists or fewer
    than ``workers`` do; with ``accelerator_type=None`` (``--gpu cpu``) checks the CPUs instead.
    """
    if accelerator_type is None:
        cpus = float(ray.cluster_resources().get("CPU", 0))
        count = workers or 1
        if count * cpus_per_worker > cpus:
            raise ValueError(
                f"`workers * cpus_per_worker <= cluster CPUs` must hold, but got {count} * "
                f"{cpus_per_worker:g} > {cpus:g}"
            )
        return Placement(count, None, cpus_per_worker)
    have = gpus_of_type(accelerator_type)
    if have == 0:
        total = int(ray.cluster_resources().get("GPU", 0))
        raise ValueError(
            f"no {accelerator_type} GPU in the Ray cluster: it has {total} GPU(s) of types "
            f"{accelerator_types() or 'none'}; pick --gpu for a card that is there, or --gpu cpu"
        )
    if workers is not None and workers > have:
        raise ValueError(f"--workers {workers} asks for more than the {have} {accelerator_type} GPU(s) there")
    return Placement(workers or have, accelerator_type)


class WorkerPool:
    """The study's workers: started together, each replaceable after its process is lost."""

    def __init__(self, spec: WorkerSpec, placement: Placement, worker_cls: type = TrialWorker) -> None:
        self.spec = spec
        self.placement = placement
        self._remote: Any = ray.remote(worker_cls).options(max_restarts=0, **placement.actor_options())
        self.actors: list[Any] = []
        self.infos: list[WorkerInfo] = []
        self.replaced = 0

    def start(self) -> list[WorkerInfo]:
        """Start every worker and wait until each has loaded its model."""
        self.actors = [self._remote.remote(self.spec) for _ in range(self.placement.count)]
        self.infos = _wait_ready(self.actors)
        return self.infos

    def replace(self, index: int) -> WorkerInfo:
        """Start a new worker in place of worker ``index`` (whose process was lost)."""
        ray.kill(self.actors[index], no_restart=True)
        self.actors[index] = self._remote.remote(self.spec)
        self.infos[index] = _wait_ready([self.actors[index]])[0]
        self.replaced += 1
        return self.infos[index]

    def stop(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []


def _wait_ready(actors: list[Any]) -> list[WorkerInfo]:
    refs = [a.info.remote() for a in actors]
    try:
        return list(ray.get(refs, timeout=START_TIMEOUT_S))
    except ray.exceptions.GetTimeoutError:
        raise WorkerStartError(f"a worker did not start within {START_TIMEOUT_S:.0f} s") from None
    except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        raise WorkerStartError(f"a worker failed to start: {_last_line(e)}") from None


def _last_line(error: BaseException) -> str:
    """The root cause of a Ray error as one line (Ray wraps the remote traceback around it)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    causes = [line for line in lines if "Error:" in line and not line.startswith("ray.exceptions")]
    return causes[-1] if causes else (lines[-1] if lines else type(error).__name__)


# card id -> the accelerator type Ray reports for it (Ray names a GPU by the model token of its NVML name)
RAY_ACCELERATOR_TYPES: dict[str, str] = {
    "h100-sxm": "H100",
    "h100-pcie": "H100",
    "h200": "H200",
    "a100-40g": "A100",
    "a100-80g": "A100",
    "l40s": "L40S",
    "l4": "L4",
    "a10g": "A10G",
    "rtx-4090": "GeForce-RTX-4090",
}


def ray_accelerator_type(card: Any) -> str:
    """The Ray accelerator type of a catalog card (``ValueError`` for a card Ray cannot place)."""
    if card.id not in RAY_ACCELERATOR_TYPES:
        raise ValueError(f"--gpu {card.id}: not a GPU Ray can place; GPUs: {list(RAY_ACCELERATOR_TYPES)}")
    return RAY_ACCELERATOR_TYPES[card.id]
