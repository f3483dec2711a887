"""Small helpers for what a study stores: runtime versions, file digests, JSON-safe metric dicts."""

from __future__ import annotations

import hashlib
import math
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

import kvtune

VERSION_PACKAGES = ("torch", "triton", "ray", "optuna")


def versions() -> dict[str, str]:
    """kvtune and the versions of the packages a result depends on ("absent" when one is not installed)."""
    found = {"kvtune": kvtune.__version__, "python": platform.python_version()}
    for name in VERSION_PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "absent"
    return found


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def finite(metrics: dict[str, Any]) -> dict[str, Any]:
    """JSON-safe copy: non-finite floats become None."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
