"""kvtune: tune a hybrid KV cache for one GPU model and one real workload.

The sub-packages live in top-level folders of the repository; ``kvtune/`` holds this file and committed
relative links to them (``kvtune/kernels -> ../kernels``, ...), so one tree serves the installed package, a
plain checkout on ``PYTHONPATH``, type checkers and IDEs. By stage of the data flow: ``kvtune.kernels``
(Triton kernels + PyTorch references) ← ``kvtune.cache_impl`` (the hybrid cache) ← ``kvtune.engine`` (model
runner, scheduler, replay, traces, quality) ← ``kvtune.tuner`` (driver, Ray workers, CLI), with
``kvtune.search_spaces`` (card facts and spaces) and ``kvtune.studies`` (the Optuna study and its names)
beside the tuner.
"""

__version__ = "0.1.0"
