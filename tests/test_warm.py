"""Kernels compiled ahead (:mod:`kvtune.engine.warm`): a CPU process planning for a GPU takes that GPU's
kernels, Triton's JIT compiles them into the disk cache without running them, a second run only loads them,
and a config it cannot warm is reported, not raised. On a GPU: a worker's prime after the planning compiles
no kernel of the cache (``benchmarks/warm_ahead.py --check``)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from kvtune.cache_impl.config import HybridConfig
from kvtune.engine.compiles import CompileWatch
from kvtune.engine.options import warm_processes
from kvtune.engine.scheduler import SchedulerConfig
from kvtune.engine.traces import Request
from kvtune.engine.warm import (
    KernelWarmer,
    WarmSpec,
    planning_mlp,
    planning_spec,
    warm_replays,
    warm_requests,
    warm_scheduler,
)
from kvtune.engine.weights import SHAPES
from kvtune.kernels.aot import Launch, record_launches, specialization
from kvtune.kernels.arch import HOPPER, arch_of, num_sms
from kvtune.kernels.backend import Ahead, plan_ahead
from kvtune.tests.triton_testlib import HAS_CUDA, INTERPRETING

pytestmark = pytest.mark.skipif(INTERPRETING, reason="kernels defined under the interpreter do not compile")
ROOT = Path(__file__).resolve().parents[1]
INT4 = HybridConfig("hybrid_v2", 16, 32, 4)
INT8 = HybridConfig("hybrid_v2", 16, 16, 8)


@pytest.fixture
def ahead() -> Iterator[None]:
    plan_ahead(Ahead(HOPPER, 132))
    try:
        yield
    finally:
        plan_ahead(None)


def _recorded(
    config: HybridConfig, requests: tuple[Request, ...], scheduler: SchedulerConfig, times: int = 1
) -> list[Launch]:
    """The kernel launches of ``times`` engine replays on one engine on the CPU (recorded, not run),
    SmolLM2's attention shape."""
    from kvtune.engine.engine import Engine
    from kvtune.engine.model import LlamaModel, LoadedModel
    from kvtune.engine.weights import random_tensors

    spec = planning_spec(SHAPES["smollm2-135m"])
    model = LlamaModel(spec, random_tensors(spec, torch.device("cpu"), torch.bfloat16))
    engine = Engine(LoadedModel(model, spec, None, False), config, 64 << 20, torch.device("cpu"), scheduler)

    def replays() -> None:
        for _ in range(times):
            engine.replay(requests, 0.0, warmup_requests=2)

    return record_launches(replays)


def _replay_launches(config: HybridConfig) -> list[str]:
    """The kernels a replay of :func:`warm_requests` launches on the CPU, named with their code width."""
    launches = _recorded(config, warm_requests(config), warm_scheduler(SchedulerConfig()))
    kinds = [f" KIND={x.kwargs['KIND']}" if "KIND" in x.kwargs else "" for x in launches]
    return [x.fn.__name__ + kind for x, kind in zip(launches, kinds, strict=True)]


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_the_planning_models_mlp_kernel_specializes_as_the_workers(name: str, ahead: None) -> None:
    """Every catalog model's fused SiLU-multiply launch and its planning model's compile one kernel (an MLP
    of 256 compiled a block of 256 where a Llama-3.1-8B worker's took 1,024: run 39a's prime compiled it)."""
    from kvtune.kernels.elementwise import silu_mul

    def key(width: int) -> tuple[Any, ...]:
        gate_up = torch.zeros(3, 2 * width, dtype=torch.bfloat16)
        (launch,) = record_launches(lambda: silu_mul(gate_up))
        return specialization(launch)

    width = SHAPES[name].intermediate_size
    assert planning_spec(SHAPES[name]).intermediate_size == planning_mlp(width) <= width
    assert key(planning_mlp(width)) == key(width)
    assert [key(w) == key(planning_mlp(w)) for w in (100, 1000, 1030, 5000, 14336)] == [True] * 5


def test_planning_ahead_takes_the_gpus_kernels(ahead: None) -> None:
    """Planning for an sm_90 GPU of 132 multiprocessors, a CPU replay of a 4-bit config launches what a CUDA
    replay would: the Gluon cold kernel for 4-bit codes, the merge, the seal and the model's fused kernels."""
    assert num_sms(torch.device("cpu")) == 132 and arch_of(torch.device("cpu")) is HOPPER
    names = set(_replay_launches(INT4))
    assert {"_cold_kernel KIND=4", "_merge_kernel", "_seal_kernel", "_rope_qkv_kernel"} <= names, names


SPARSE = HybridConfig("hybrid_v2", 16, 16, 8, sparse_top_k=32, migration_throttling=True)


@pytest.mark.parametrize(
    ("config", "scheduler"),
    [(INT4, SchedulerConfig()), (INT8, SchedulerConfig()), (SPARSE, SchedulerConfig()),
     (INT4, SchedulerConfig(piecewise=True)), (INT8, SchedulerConfig(mixed=False)),
     (INT4, SchedulerConfig(mixed_graphs=True)), (SPARSE, SchedulerConfig(mixed_graphs=True))],
    ids=["int4", "int8", "int8-sparse", "int4-pieces", "int8-unmixed", "int4-mixed-graphs",
         "sparse-mixed-graphs"],
)  # fmt: skip
def test_the_warm_requests_reach_every_key_of_a_longer_replay(
    ahead: None, config: HybridConfig, scheduler: SchedulerConfig
) -> None:
    """Planning ahead, the four warm requests launch every kernel, with every JIT key, that a replay of 24
    other requests (longer prompts and outputs, a larger batch, other chunk sizes) launches under the same
    engine options: what the planning compiles is what a worker's replay then looks up."""
    from dataclasses import replace

    keys = lambda requests, options: {specialization(x) for x in _recorded(config, requests, options)}
    warm_options = warm_scheduler(scheduler)
    warm = {
        specialization(x)
        for x in _recorded(config, warm_requests(config), warm_options, warm_replays(scheduler))
    }
    other = tuple(Request(i, 2.0 * i, 40 + (i * 97) % 700, 8 + (i * 13) % 190) for i in range(24))
    replay = keys(other, replace(scheduler, max_num_batched_tokens=512))
    missing = replay - warm
    assert not missing, [(name, key) for name, key, _ in missing]


def test_without_planning_a_cpu_replay_launches_no_kernel() -> None:
    assert _replay_launches(INT4) == []
    assert num_sms(torch.device("cpu")) == 4


def _spec(*configs: dict[str, object]) -> WarmSpec:
    return WarmSpec(
        ("cuda", 90, 32), HOPPER, 132, SHAPES["smollm2-135m"], "bfloat16", SchedulerConfig(), configs
    )


def test_the_planning_processes_fill_the_disk_cache_and_a_second_run_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compiled for sm_90 into an empty Triton cache (no GPU here); a config that is no config is reported
    with its error; the same config warmed again compiles nothing and loads every kernel."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    bad = {**INT8.to_dict(), "block_size": 12}
    first = KernelWarmer(_spec(INT8.to_dict(), bad), processes=1)
    assert first.wait(timeout=240)
    report = first.report()
    assert report["warmed"] == 1 and report["failed"] == 1 and not report["running"], report
    assert "block_size=12" in report["errors"][0]
    done = next(r for r in first.results if not r["error"])
    assert done["compiled"] > 0 and done["loaded"] == 0, done
    assert {"_seal_kernel", "_merge_kernel"} <= set(done["kernels"]), done
    assert any((tmp_path / "triton").rglob("*.cubin"))

    again = KernelWarmer(_spec(INT8.to_dict()), processes=1)
    assert again.wait(timeout=240)
    (second,) = again.results
    assert second["compiled"] == 0 and second["loaded"] == done["compiled"] + done["loaded"], second


def test_a_ray_actor_starts_the_planning_processes(ray_cluster: Any, tmp_path: Path) -> None:
    """As a study's worker does: from a Ray actor's process, the planning processes find the package and
    Triton's cache folder through the environment the actor gives them, and report back."""

    @ray_cluster.remote(num_cpus=0)
    class Host:
        def warm(self, spec: WarmSpec, cache: str) -> dict[str, Any]:
            import os

            os.environ["TRITON_CACHE_DIR"] = cache
            warmer = KernelWarmer(spec, processes=1)
            warmer.wait(timeout=240)
            return warmer.report()

    report = ray_cluster.get(Host.remote().warm.remote(_spec(INT8.to_dict()), str(tmp_path / "triton")))
    assert report["warmed"] == 1 and report["compiled"] > 0 and not report["errors"], report


def test_a_stopped_warmer_ends_its_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    warmer = KernelWarmer(_spec(INT4.to_dict(), INT8.to_dict()), processes=2)
    warmer.stop()
    assert not warmer.running and warmer.wait(timeout=30)


@pytest.mark.parametrize(("arch", "sms"), [("sm_80", 108), ("sm_86", 80), ("sm_89", 58), ("sm_90", 132)])
def test_every_launch_of_a_replay_compiles_for_each_architecture(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str, sms: int
) -> None:
    """The compile matrix at the engine's scale: planning for each architecture of the catalog (A100, A10G,
    L4/L40S/RTX 4090, H100/H200) with its multiprocessors, whole replays of a 4-bit, a sparse 8-bit and an
    unquantized config compile every kernel they launch, with the launch options the dispatcher picks there
    (no programmatic dependent launch below sm_90, rings that fit the card's shared memory)."""
    from kvtune.kernels.arch import ARCHS

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    a = ARCHS[arch]
    configs = (INT4.to_dict(), SPARSE.to_dict(), HybridConfig("hybrid_v2", 16, 64, 0).to_dict())
    model = SHAPES["smollm2-135m"]
    warmer = KernelWarmer(
        WarmSpec(("cuda", a.target, 32), a, sms, model, "bfloat16", SchedulerConfig(), configs), 2
    )
    assert warmer.wait(timeout=300)
    report = warmer.report()
    assert report["warmed"] == 3 and not report["errors"], report
    kernels = {k for r in warmer.results for k in r["kernels"]}
    assert {"_cold_kernel", "_split_kernel", "_sparse_table_kernel", "_seal_kernel"} <= kernels, kernels


def test_a_planning_process_that_fails_is_reported_with_its_last_line() -> None:
    from dataclasses import replace

    warmer = KernelWarmer(replace(_spec(INT8.to_dict()), dtype="no_such_dtype"), processes=1)
    assert warmer.wait(timeout=120)
    report = warmer.report()
    assert report["warmed"] == 0 and not report["running"], report
    assert (
        "a planning process exited with 1" in report["errors"][0] and "no_such_dtype" in report["errors"][0]
    )


def test_processes_follow_the_cores_and_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVTUNE_WARM_PROCESSES", raising=False)
    assert warm_processes(100) >= 1 and warm_processes(100, workers=1000) == 1
    assert warm_processes(1) == 1
    monkeypatch.setenv("KVTUNE_WARM_PROCESSES", "3")
    assert warm_processes(100) == 3 and warm_processes(2) == 2
    monkeypatch.setenv("KVTUNE_WARM_PROCESSES", "none")
    with pytest.raises(ValueError, match=r"KVTUNE_WARM_PROCESSES='none': expected a positive number"):
        warm_processes(4)


def test_a_compile_watch_counts_disk_loads_and_restores_the_listener() -> None:
    from triton import knobs

    heard: list[bool] = []
    knobs.compilation.listener = lambda **kw: heard.append(kw["cache_hit"])
    try:
        with CompileWatch() as outer, CompileWatch() as inner:
            knobs.compilation.listener(src=None, cache_hit=True)
            knobs.compilation.listener(src=None, cache_hit=False)
        assert (outer.loaded, inner.loaded, heard) == (1, 1, [True, False])
        knobs.compilation.listener(src=None, cache_hit=True)
        assert outer.loaded == 1 and heard == [True, False, True]
    finally:
        knobs.compilation.listener = None


def test_a_cpu_worker_compiles_nothing_ahead() -> None:
    from kvtune.tuner.worker import local_worker

    worker = local_worker(
        "random:tiny", torch.device("cpu"), str(ROOT / "examples" / "text" / "wikitext2_excerpt.txt")
    )
    assert worker.warm_kernels([INT4.to_dict()]) is False and worker.warm_report() is None


@pytest.mark.gpu
def test_a_gpu_prime_after_the_planning_compiles_no_cache_kernel_gpu(tmp_path: Path) -> None:
    """On the GPU: a fresh process primes an engine (SmolLM2's shape, random weights) after the planning
    processes warmed its config, and Triton compiles none of the cache's kernels there (it loads them)."""
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "warm_ahead.py"), "--model", "random:smollm2-135m",
         "--configs", "4:32,8:64,0:32", "--check", "--json", str(tmp_path / "warm.json")],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_console_line_says_how_far_the_planning_got() -> None:
    from kvtune.tuner.job import warm_line

    report = {"configs": 32, "warmed": 30, "compiled": 180, "loaded": 12, "failed": 1, "processes": 6,
              "errors": ["{'block_size': 12}: ValueError: block_size=12 breaks the rule"], "seconds": 41.4,
              "running": True}  # fmt: skip
    line = warm_line(report)
    assert line.startswith(
        "kernels compiled ahead: 30 of 32 configs in 41 s on 6 processes (180 compiled, 12"
    )
    assert "1 failed ({'block_size': 12}: ValueError" in line and line.endswith("; still compiling)")
    assert warm_line(None) == "kernels compiled ahead: not started"


def _host_reads(
    monkeypatch: pytest.MonkeyPatch, owner: type, names: list[str]
) -> tuple[dict[str, int], list[str]]:
    """Watch ``owner``'s methods ``names``: their calls, and every device value read back on the host inside
    them (``.item()``, a boolean mask, ``nonzero``: what a host would wait for, and a capture refuses)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten  # under inference mode a read shows as ``item``, elsewhere ``_local_scalar_dense``
    reads = {aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default,
             aten.nonzero.default, aten.masked_select.default}  # fmt: skip
    seen: list[str] = []

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func in reads:
                seen.append(str(func))
            return func(*args, **(kwargs or {}))

    calls = dict.fromkeys(names, 0)

    def watched(name: str) -> Any:
        original = getattr(owner, name)

        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            with Reads():
                return original(self, *args, **kwargs)

        return call

    for name in names:
        monkeypatch.setattr(owner, name, watched(name))
    return calls, seen


@pytest.mark.parametrize(
    "config", [INT4, HybridConfig("hybrid_v2", 16, 16, 8, sparse_top_k=32)], ids=["int4", "sparse"]
)
def test_a_gpu_iterations_layers_read_nothing_back_on_the_host(
    ahead: None, config: HybridConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planning for sm_90 (every launch decided as on the GPU), the cache's work in each layer of a replay's
    iterations (decode rows, prompt chunks beside them or alone) reads no device value back on the host: no
    ``.item()``, no boolean mask or ``nonzero``, whose sizes a host would wait for. What a layer does can
    then be queued ahead of the device, and captured."""
    from kvtune.cache_impl.hybrid_cache import HybridCache

    calls, seen = _host_reads(monkeypatch, HybridCache, ["decode", "chunks_layer"])
    _recorded(config, warm_requests(config), SchedulerConfig(graphs=False))
    assert calls["decode"] > 0 and calls["chunks_layer"] > 0, calls
    assert not seen, sorted(set(seen))


@pytest.mark.parametrize(
    "config",
    [INT4, HybridConfig("hybrid_v2", 16, 16, 0), HybridConfig("hybrid_v2", 16, 16, 8, sparse_top_k=32)],
    ids=["int4", "bf16", "sparse"],
)
def test_a_mixed_graphs_function_reads_nothing_back_on_the_host(
    ahead: None, config: HybridConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planning for sm_90, what a mixed graph captures (:meth:`MixedGraphs._forward`: the decode rows and
    chunks of a whole forward, every layer, the logits' rows, the tokens) reads no device value back on the
    host, so a CUDA graph can capture it."""
    from kvtune.engine.mixed_graphs import MixedGraphs

    calls, seen = _host_reads(monkeypatch, MixedGraphs, ["_forward"])
    scheduler = SchedulerConfig(mixed_graphs=True)
    _recorded(config, warm_requests(config), scheduler, warm_replays(scheduler))
    assert calls["_forward"] > 0, calls
    assert not seen, sorted(set(seen))
