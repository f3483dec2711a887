"""What a study needs of the machine, checked before Ray starts; a resource that runs out, said in one line.

Before Ray starts (:func:`check_resources`, after the trace and the models are checked):

- the seed fits the samplers' range (``--seed``);
- the KV budget holds the longest request of the sample in the unquantized baseline's layout (the baseline
  is measured first in every study; a request that does not fit in the whole cache can never be scheduled):
  ``--kv-budget``;
- on a local CPU study, the RAM the workers will hold (:func:`cpu_ram_need`: each allocates its whole KV
  budget, plus about 1 GiB for the model, PyTorch and Ray) is available now: ``--kv-budget`` / ``--workers``;
- the folder the preset goes to can be written (``--out``): a read-only, immutable or missing-permission
  folder is refused before the study runs, not after it.

While the study runs, a worker that Ray kills for memory (:func:`ray_oom_line`) and a database that the disk
can no longer grow (:func:`kvtune.studies.storage.disk_full`) end the run with one line naming what to
change; the study keeps every finished trial.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Protocol

from kvtune.cache_impl.layout import ModelKVShape, kv_bytes_for
from kvtune.engine.options import CPU_BUDGET_CAP_BYTES
from kvtune.search_spaces.cards import Card
from kvtune.studies.study import StudyOptions
from kvtune.tuner.export import PRESETS_DIR, preset_path
from kvtune.tuner.protocol import BASELINE, WorkerSpec
from kvtune.tuner.workload import WorkloadSample


class CheckedJob(Protocol):
    """What the checks before Ray starts read of a run (:class:`kvtune.tuner.job.TuneJob` offers it;
    declared here so that these modules, which ``job`` imports, do not import ``job`` back)."""

    @property
    def options(self) -> StudyOptions: ...

    @property
    def sample(self) -> WorkloadSample: ...

    @property
    def spec(self) -> WorkerSpec: ...

    @property
    def card(self) -> Card: ...

    @property
    def write_preset(self) -> bool: ...

    @property
    def out(self) -> str | None: ...


SEED_MAX = 2**32 - 1  # numpy's and Optuna's samplers take seeds in [0, 2**32 - 1]
CPU_WORKER_OVERHEAD_BYTES = 1 << 30  # a CPU worker beside its KV budget: the model, PyTorch and Ray
CPU_BUDGET_FRACTION = 0.9  # of the available RAM, the default CPU budget (kvtune.engine.engine)


class ResourceError(ValueError):
    """The machine cannot give the study what it asks; the message is one line naming the flag."""


def check_seed(seed: int) -> None:
    if not 0 <= seed <= SEED_MAX:
        raise ResourceError(f"--seed {seed}: must be in [0, 2**32 - 1] (the samplers' seed range)")


def available_ram() -> int:
    """Bytes of RAM available now (``MemAvailable``: free plus what the kernel can reclaim)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cpu_budget(budget_bytes: int | None, available: int) -> int:
    """The KV budget each CPU worker allocates: the one given, else the engine's default for ``available``."""
    return budget_bytes or int(min(available * CPU_BUDGET_FRACTION, CPU_BUDGET_CAP_BYTES))


def cpu_ram_need(workers: int, budget_bytes: int) -> int:
    """The RAM a CPU study's workers hold: each its whole KV budget plus about 1 GiB."""
    return workers * (budget_bytes + CPU_WORKER_OVERHEAD_BYTES)


def check_ram(workers: int, budget_bytes: int | None, available: int | None = None) -> None:
    """``ResourceError`` when ``workers`` CPU workers would hold more RAM than is available now."""
    have = available_ram() if available is None else available
    budget = cpu_budget(budget_bytes, have)
    need = cpu_ram_need(workers, budget)
    if need <= have:
        return
    fits = have // workers - CPU_WORKER_OVERHEAD_BYTES
    advice = f"pass --kv-budget {fits >> 20}MiB or less, or fewer --workers" if fits >= 1 << 20 else ""
    raise ResourceError(
        f"--kv-budget / --workers: the study needs about {need / 2**30:.1f} GiB of RAM ({workers} worker(s) "
        f"x (KV budget {budget / 2**30:.3g} GiB + ~1 GiB)), {have / 2**30:.1f} GiB is available; "
        + (advice or "pass fewer --workers, or free memory first")
    )


def check_kv_budget(budget_bytes: int | None, need: int, longest: int) -> None:
    """``ResourceError`` when a given budget is below ``need``, the bytes of the longest request."""
    if budget_bytes is not None and budget_bytes < need:
        raise ResourceError(
            f"--kv-budget {budget_bytes} bytes: cannot hold one request of the sample (the longest, "
            f"{longest} tokens, needs {need} bytes in the unquantized baseline's layout); pass at least "
            f"{-(-need // 2**20)}MiB"
        )


def preset_folder(job: CheckedJob) -> Path:
    """The folder the study's preset will be written to."""
    if job.out is not None:
        return Path(job.out).parent
    return preset_path(job.card.id, job.spec.model, job.sample.path, PRESETS_DIR).parent


def check_preset_folder(job: CheckedJob) -> None:
    """``ResourceError`` when the preset could not be written where it goes (checked on the nearest folder
    that exists: the rest is created when the preset is written)."""
    if not job.write_preset:
        return
    if job.out is not None and Path(job.out).is_dir():
        raise ResourceError(f"--out {job.out}: a directory; name the preset file in it (e.g. preset.json)")
    folder = preset_folder(job).absolute()
    where = f"--out {job.out}" if job.out is not None else f"the presets folder {folder}"
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        raise ResourceError(f"{where}: {existing} is a file, not a directory")
    if not os.stat(existing).st_mode & 0o222:  # read-only by its permission bits (root could write anyway)
        raise ResourceError(f"{where}: the folder {existing} is read-only; pick another --out")
    if not os.access(existing, os.W_OK):  # another owner's, immutable, a read-only file system
        raise ResourceError(f"{where}: the folder {existing} is not writable; pick another --out")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:  # immutable, a read-only file system, ...
        raise ResourceError(
            f"{where}: the folder {existing} is not writable ({e.strerror or e}); pick another --out"
        ) from None


def ray_oom_line(error: BaseException) -> str | None:
    """One line for a worker Ray killed for memory (None for any other error)."""
    import ray.exceptions

    text = str(error)
    oom = isinstance(error, ray.exceptions.OutOfMemoryError) or (
        isinstance(error, ray.exceptions.RayError)
        and any(words in text for words in ("running low on memory", "memory monitor"))
    )
    if not oom:
        return None
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(error).__name__)
    return (
        f"--kv-budget / --workers: Ray killed a worker for lack of memory ({first[:160]}); lower --kv-budget "
        "or --workers. The study keeps every finished trial: --resume continues it"
    )


def raise_resource_error(error: BaseException, storage: str) -> None:
    """Re-raise ``error`` as a one-line :class:`ResourceError` when a resource ran out (memory, disk);
    return when it is another error (the caller re-raises it)."""
    from kvtune.studies.storage import disk_full, redact

    line = ray_oom_line(error)
    if line is not None:
        raise ResourceError(line) from None
    if disk_full(error):
        raise ResourceError(
            f"--storage {redact(storage)}: the disk is full; the study keeps every finished trial: free "
            "space, then run again with --resume"
        ) from None


def kv_shape(model: str, dtype: str) -> ModelKVShape | None:
    """The KV shape of ``model`` (as ``--model`` names it) from its spec alone, no weight read; None for a
    GGUF file other than smollm2 (its budget is checked when the worker loads it)."""
    import torch

    from kvtune.engine.weights import SHAPES, spec_from_hf_config

    if model == "smollm2":
        spec = SHAPES["smollm2-135m"]
    elif model.startswith("random:"):
        spec = SHAPES[model.removeprefix("random:")]
    elif Path(model).is_dir():
        spec = spec_from_hf_config(Path(model) / "config.json")
    else:
        return None
    heads = (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.num_heads)
    return ModelKVShape(*heads, getattr(torch, dtype))


def request_bytes(shape: ModelKVShape, tokens: int) -> int:
    """The bytes one request of ``tokens`` tokens takes in the unquantized baseline's layout."""
    return kv_bytes_for(BASELINE, shape, [tokens])
