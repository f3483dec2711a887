"""Everything a study can check before Ray starts or any weights load, so a bad input ends in seconds.

:func:`preflight` reads the trace (one streaming pass: a broken line is ``file:line: reason``), checks that
both models can be found without loading their weights (:func:`check_model`), that the study does not already
exist unless ``--resume`` is given, that no live driver runs it (:mod:`kvtune.studies.lease`), that the trace
holds enough requests for the windows asked, and counts what fitting the lengths to the model does to the
search and held-out samples (a warning when most of a sample is cut). The storage URL and the card are checked
when the job is built (:mod:`kvtune.studies.storage`, ``resolve_gpu``), the numeric options before that.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvtune.engine.traces import LengthCounts, TraceFile
from kvtune.studies.lease import check_free
from kvtune.studies.storage import redact
from kvtune.studies.study import stored_attrs
from kvtune.tuner.workload import length_warnings, load_trace

if TYPE_CHECKING:
    from kvtune.tuner.job import TuneJob

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class Preflight:
    """What the checks found: the trace (columns, not request objects), the model's context, and what
    fitting lengths to it does to each sample."""

    trace: TraceFile
    max_context: int
    lengths: dict[str, LengthCounts]
    warnings: tuple[str, ...]


def preflight(job: TuneJob) -> Preflight:
    """Check ``job``'s inputs (see the module docstring); ``ValueError`` (one line) on the first bad one."""
    trace = load_trace(job.sample.path)
    max_context = check_model(job.spec.model, "--model")
    check_model(job.spec.quality.model, "--quality-model")
    if stored_attrs(job.options.storage, job.options.name) is not None and not job.options.resume:
        raise ValueError(
            f"study {job.options.name!r} already exists in {redact(job.options.storage)}; pass --resume to "
            "continue it, or --study NAME to start another"
        )
    check_free(job.options.storage, job.options.name)  # a study that another live driver runs
    job.sample.search_windows(trace, max_context)  # enough requests for --windows x --requests
    job.sample.validation_requests(trace, max_context)
    lengths = job.sample.length_counts(trace, max_context)
    warnings = length_warnings(lengths, job.sample.length_cap, max_context)
    return Preflight(trace, max_context, lengths, warnings)


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
    import gguf

    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ValueError(f"{path}: not a GGUF file (it does not start with {GGUF_MAGIC!r})")
    try:
        fields = gguf.GGUFReader(str(path)).fields
        arch = fields["general.architecture"].contents()
        if arch != "llama":
            raise ValueError(f"{path}: general.architecture={arch!r}, expected 'llama'")
        context = int(fields["llama.context_length"].contents())
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a Llama GGUF (missing {e})") from None
    return context
