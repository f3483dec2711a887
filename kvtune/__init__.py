"""kvtune: tune a hybrid KV cache for one GPU model and one real workload.

The sub-packages live in top-level folders of the repository and are mapped into this namespace by
``pyproject.toml``: ``kvtune.kernels`` (Triton kernels + PyTorch references), ``kvtune.cache_impl``
(config, cache, model runner, engine), ``kvtune.search_spaces`` (card facts and spaces),
``kvtune.studies`` (study definitions), ``kvtune.tuner`` (driver, Ray workers, CLI).
"""

from pathlib import Path as _Path

__version__ = "0.1.0"

# In a source checkout that is not installed (``PYTHONPATH=<checkout>``, e.g. on a GPU machine that only
# receives the files), map the sibling folders the way the installed package does. Installed, the parent
# folder holds no ``cache_impl`` and nothing changes.
_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "cache_impl" / "hybrid_cache.py").is_file() and str(_checkout) not in __path__:
    __path__.append(str(_checkout))
