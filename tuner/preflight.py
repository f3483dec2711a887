"""Everything a study can check before Ray starts or any weights load, so a bad input ends in seconds.

:func:`preflight` reads the trace (one streaming pass: a broken line is ``file:line: reason``), checks that
both models can be found without loading their weights (:func:`check_model`), that the trace holds enough
requests for the windows asked, what the study needs of the machine (:mod:`kvtune.tuner.resources`: the
seed, the KV budget, the preset's folder), that the study does not already exist unless ``--resume`` is
given (a new SQLite file is created private to its owner, :func:`new_study_attrs`), that no live driver runs
it (:mod:`kvtune.studies.lease`), and counts what fitting
the lengths to the model does to the search and held-out samples (a warning when most of a sample is cut).
The storage URL and the card are checked when the job is built (:mod:`kvtune.studies.storage`,
``resolve_gpu``), the numeric options before that.
"""

from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtune.engine.options import warm_processes
from kvtune.engine.traces import LengthCounts, Request, TraceFile
from kvtune.studies.lease import check_free
from kvtune.studies.storage import disk_full, private_sqlite_file, redact
from kvtune.studies.study import stored_attrs
from kvtune.tuner.resources import (
    CheckedJob,
    ResourceError,
    check_kv_budget,
    check_preset_folder,
    check_seed,
    kv_shape,
    request_bytes,
)
from kvtune.tuner.workload import length_warnings, load_trace

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class Preflight:
    """What the checks found: the trace (columns, not request objects), the model's context, and what
    fitting lengths to it does to each sample."""

    trace: TraceFile
    max_context: int
    lengths: dict[str, LengthCounts]
    warnings: tuple[str, ...]


def preflight(job: CheckedJob) -> Preflight:
    """Check ``job``'s inputs (see the module docstring); ``ValueError`` (one line) on the first bad one."""
    warm_processes(1)  # KVTUNE_WARM_PROCESSES, if set, is a number of processes
    trace = load_trace(job.sample.path)
    max_context = check_model(job.spec.model, "--model")
    check_model(job.spec.quality.model, "--quality-model")
    windows = job.sample.search_windows(trace, max_context)  # enough requests for --windows x --requests
    held_out = job.sample.validation_requests(trace, max_context)
    check_resources(job, (*itertools.chain(*windows), *held_out))
    if new_study_attrs(job.options.storage, job.options.name) is not None and not job.options.resume:
        raise ValueError(
            f"study {job.options.name!r} already exists in {redact(job.options.storage)}; pass --resume to "
            "continue it, or --study NAME to start another"
        )
    check_free(job.options.storage, job.options.name)  # a study that another live driver runs
    lengths = job.sample.length_counts(trace, max_context)
    warnings = length_warnings(lengths, job.sample.length_cap, max_context)
    return Preflight(trace, max_context, lengths, warnings)


def new_study_attrs(storage: str, name: str) -> dict[str, Any] | None:
    """The stored attributes of study ``name`` (None when new). An SQLite file that does not exist yet is
    created here readable by its owner only (0600, as presets are); if the disk cannot hold its first
    tables, the error is one line and the file is removed, not left empty."""
    created = None
    try:
        created = private_sqlite_file(storage)
        return stored_attrs(storage, name)
    except Exception as e:
        if created is not None:
            created.unlink(missing_ok=True)
        if disk_full(e):
            raise ResourceError(f"--storage {redact(storage)}: the disk is full; free space first") from None
        raise


def check_resources(job: CheckedJob, requests: Sequence[Request]) -> None:
    """The seed, the KV budget against the longest request, the preset's folder (:mod:`.resources`)."""
    check_seed(job.sample.seed)
    shape = kv_shape(job.spec.model, job.spec.dtype)
    if shape is not None and requests:
        longest = max(r.input_length + r.output_length for r in requests)
        check_kv_budget(job.spec.budget_bytes, request_bytes(shape, longest), longest)
    check_preset_folder(job)


def check_model(name: str, flag: str = "--model") -> int:
    """The context length of model ``name`` (as :func:`kvtune.engine.model.load_model` takes it), found
    without loading any weight: the GGUF of ``smollm2`` is there, a ``random:`` shape is known, a directory
    has a Llama ``config.json`` and ``*.safetensors``, a ``.gguf`` file is a GGUF of a Llama model. (The
    weights module reads specs only; it is imported here, not with the driver.)"""
    from kvtune.engine.weights import SHAPES, smollm2_gguf_path, spec_from_hf_config

    try:
        if name == "smollm2":
            smollm2_gguf_path()
            _needs_gguf_reader()
            return SHAPES["smollm2-135m"].max_context
        if name.startswith("random:"):
            shape = name.removeprefix("random:")
            if shape not in SHAPES:
                raise ValueError(f"unknown random shape {shape!r}, expected one of {list(SHAPES)}")
            return SHAPES[shape].max_context
        path = Path(name)
        if path.is_dir():
            spec = spec_from_hf_config(path / "config.json")
            if not any(path.glob("*.safetensors")):
                raise ValueError(f"{path}: no *.safetensors file (expected the weights next to config.json)")
            return spec.max_context
        if path.suffix == ".gguf" and path.is_file():
            _needs_gguf_reader()
            return _gguf_context(path)
    except (ValueError, NotImplementedError, OSError) as e:
        raise ValueError(f"{flag} {name}: {e}") from None
    raise ValueError(
        f"{flag} {name}: not found; expected smollm2, random:<{'|'.join(SHAPES)}>, a Hugging Face model "
        "directory (config.json + *.safetensors) or a .gguf file"
    )


def _needs_gguf_reader() -> None:
    """A GGUF model loads through the ``gguf`` package: missing, every trial would fail at its first load."""
    if importlib.util.find_spec("gguf") is None:
        raise ValueError("reading a GGUF needs the package gguf: pip install gguf")


def _gguf_context(path: Path) -> int:
    """The context length of a GGUF file's Llama model, from its header alone (no tensor is read)."""
    from kvtune.engine.gguf_file import read_gguf

    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ValueError(f"{path}: not a GGUF file (it does not start with {GGUF_MAGIC!r})")
    try:
        meta, _ = read_gguf(path)
        arch = meta["general.architecture"]
        if arch != "llama":
            raise ValueError(f"{path}: general.architecture={arch!r}, expected 'llama'")
        context = int(meta["llama.context_length"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a Llama GGUF (missing {e})") from None
    return context
