"""kvtune: tune a hybrid KV cache for one GPU model and one real workload.

The sub-packages live in top-level folders of the repository and are mapped into this namespace by
``pyproject.toml``: ``kvtune.kernels`` (Triton kernels + PyTorch references), ``kvtune.cache_impl``
(config, cache, model runner, engine), ``kvtune.search_spaces`` (card facts and spaces),
``kvtune.studies`` (study definitions), ``kvtune.tuner`` (driver, Ray workers, CLI).
"""

__version__ = "0.1.0"
