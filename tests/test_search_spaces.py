"""Card catalog and per-card search spaces: only valid configs that fit, reproducible, clear errors."""

from __future__ import annotations

import optuna
import pytest
import torch

from kvtune.cache_impl.config import HybridConfig
from kvtune.cache_impl.layout import ModelKVShape, cache_layout, kv_bytes_for
from kvtune.search_spaces.cards import CARDS, MIB, match_card, resolve_gpu
from kvtune.search_spaces.space import SearchSpace, WorkloadStats
from kvtune.tuner.cli import main

optuna.logging.set_verbosity(optuna.logging.WARNING)
SMOLLM2 = ModelKVShape(30, 3, 64, 9, torch.bfloat16)
LLAMA3_8B = ModelKVShape(32, 8, 128, 32, torch.bfloat16)
WORKLOAD = WorkloadStats(max_length=8192, length_pctl=4096, percentile=99.0, concurrency=64)
GIB = 2**30


def _space(card: str = "h200", real: bool = True, shape: ModelKVShape = SMOLLM2, **kw: object) -> SearchSpace:
    return SearchSpace.build(resolve_gpu(card), "m", shape, kw.pop("workload", WORKLOAD), real, **kw)  # type: ignore[arg-type]


def _proposals(space: SearchSpace, n: int, sampler: optuna.samplers.BaseSampler) -> list[optuna.Trial]:
    study = optuna.create_study(sampler=sampler)
    return [study.ask() for _ in range(n)]


def _fits(space: SearchSpace, shape: ModelKVShape, config: HybridConfig) -> bool:
    """The workload's concurrent sequences fit a cache laid out for them, and their bytes fit the budget."""
    w, budget = space.workload, space.kv_budget_bytes
    layout = cache_layout(config, shape, budget, max_seqs=w.concurrency)
    return (
        kv_bytes_for(config, shape, [w.length_pctl] * w.concurrency) <= budget
        and layout.max_sequences(w.length_pctl) >= w.concurrency
        and kv_bytes_for(config, shape, [w.max_length]) <= budget
    )


# ---- spaces --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("real", [True, False])
@pytest.mark.parametrize(
    ("card", "shape"),
    [pytest.param(c, SMOLLM2, id=f"{c}-smollm2") for c in CARDS]
    + [pytest.param(c, LLAMA3_8B, id=f"{c}-llama-3-8b") for c in ("l4", "h200")],
)
def test_200_random_points_are_valid_configs_that_fit(card: str, shape: ModelKVShape, real: bool) -> None:
    space = _space(card, real, shape)
    trials = _proposals(space, 200, optuna.samplers.RandomSampler(seed=3))
    configs = [space.suggest(t) for t in trials]
    assert all(isinstance(c, HybridConfig) for c in configs)  # constructed = validated
    assert all(c.sparse_top_k % c.block_size == 0 for c in configs)
    assert all(_fits(space, shape, c) for c in configs)
    assert all(space.params_for(c) == t.params for c, t in zip(configs, trials))


@pytest.mark.parametrize("card", [c for c in CARDS if CARDS[c].is_gpu])
def test_a_card_offers_only_the_block_sizes_its_kernels_fit(card: str) -> None:
    """sm_86 / sm_89 cards (99 KB of shared memory per program) stop at 128-token blocks: the split kernel's
    256-token 8-bit block with per-block bits needs ~140 KB (tests/test_triton_compile.py); sm_80 and sm_90
    cards offer every size."""
    from kvtune.kernels.arch import arch_for

    c = CARDS[card]
    largest = 128 if c.compute_capability in ((8, 6), (8, 9)) else 256
    assert max(c.block_sizes) == arch_for(c.compute_capability).max_block_size == largest  # type: ignore[arg-type]
    assert set(_space(card).block_sizes) <= set(c.block_sizes)


def test_tight_budget_narrows_the_space_and_says_so() -> None:
    space = _space(
        "l4", False, LLAMA3_8B, workload=WorkloadStats(8192, 8192, 99.0, 16), kv_budget_bytes=8 * GIB
    )
    assert space.bits == (4,)
    assert any("bits 0 dropped" in n for n in space.notes)
    assert "bits 0 dropped" in space.describe()


def test_nothing_fits_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"card l4: .* do not fit the KV budget"):
        _space("l4", True, LLAMA3_8B, kv_budget_bytes=GIB)


def _tell_all(space: SearchSpace, seed: int) -> list[dict[str, object]]:
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=seed, n_startup_trials=5))
    study.optimize(lambda t: space.suggest(t).hot_tokens / space.suggest(t).block_size, n_trials=15)
    return [t.params for t in study.trials]


def test_same_seed_same_proposals() -> None:
    space = _space("h100-sxm", True)
    assert _tell_all(space, seed=11) == _tell_all(space, seed=11)
    assert _tell_all(space, seed=11) != _tell_all(space, seed=12)


@pytest.mark.parametrize(
    ("real", "tier_params"),
    [
        (True, {"sparse_blocks", "migration_throttling", "migration_interval", "migration_threshold_ms"}),
        (False, set()),
    ],
)
def test_tier_parameters_only_with_real_weights(real: bool, tier_params: set[str]) -> None:
    space = _space("h200", real)
    trials = _proposals(space, 100, optuna.samplers.RandomSampler(seed=5))
    configs = [space.suggest(t) for t in trials]
    asked = set().union(*(t.params for t in trials)) - {"quantization_bits", "block_size", "hot_tokens_log2"}
    assert asked == tier_params
    assert any(c.sparse_top_k > 0 for c in configs) == real
    assert ("sparse_top_k" in space.fixed()) != real


def test_enqueued_config_comes_back_from_suggest() -> None:
    space = _space("h200", True)
    config = HybridConfig(
        "hybrid_v2", 64, 32, 8, sparse_top_k=96, migration_throttling=True, migration_interval=50
    )
    study = optuna.create_study()
    study.enqueue_trial(space.params_for(config))
    assert space.suggest(study.ask()) == config


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (HybridConfig("hybrid_v2", 32, 512, 8), "block_size=512 is outside"),
        (
            HybridConfig("hybrid_v2", 32, 64, 8, sparse_top_k=64),
            "sparse_top_k=64 is outside the space: fixed at 0",
        ),
    ],
)
def test_config_outside_the_space_is_named(config: HybridConfig, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _space("h200", False).params_for(config)


def test_default_configs_lie_in_the_space() -> None:
    space = _space("h200", True)
    assert [c.quantization_bits for c in space.default_configs()] == [8, 4]
    assert all(space.params_for(c) for c in space.default_configs())


def test_fingerprint_detects_another_space() -> None:
    a, b = _space("h200", True), _space("h200", False)
    assert a.space_fingerprint() == _space("h200", True).space_fingerprint()
    assert a.space_fingerprint() != b.space_fingerprint()
    a.check_fingerprint(a.space_fingerprint(), "s")
    a.check_fingerprint(None, "s")
    with pytest.raises(ValueError, match="study 's' was created with search space"):
        a.check_fingerprint(b.space_fingerprint(), "s")


# ---- cards ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("nvml", "mib", "card"),
    [
        ("NVIDIA H100 80GB HBM3", 81559, "h100-sxm"),
        ("NVIDIA H100 PCIe", 81559, "h100-pcie"),
        ("NVIDIA H200", 143771, "h200"),
        ("NVIDIA A100-SXM4-40GB", 40536, "a100-40g"),
        ("NVIDIA A100-SXM4-80GB", 81920, "a100-80g"),
        ("NVIDIA A100 80GB PCIe", 81920, "a100-80g"),
        ("NVIDIA L40S", 46068, "l40s"),
        ("NVIDIA L4", 23034, "l4"),
        ("NVIDIA A10G", 23028, "a10g"),
        ("NVIDIA GeForce RTX 4090", 24564, "rtx-4090"),
    ],
)
def test_match_card_from_nvml(nvml: str, mib: int, card: str) -> None:
    assert match_card(nvml, mib * MIB).id == card


def test_unknown_nvml_name_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"'Tesla T4' with 15\.0 GiB matches no card"):
        match_card("Tesla T4", 15360 * MIB)


@pytest.mark.parametrize(
    ("arg", "present", "card"),
    [
        ("h100", [("NVIDIA H100 PCIe", 81559 * MIB)], "h100-pcie"),
        ("h100", [("NVIDIA H100 80GB HBM3", 81559 * MIB)] * 2, "h100-sxm"),
        ("H200", None, "h200"),
        ("a100_80g", None, "a100-80g"),
        ("4090", None, "rtx-4090"),
        ("h100-pcie", [("NVIDIA H100 80GB HBM3", 81559 * MIB)], "h100-pcie"),
    ],
)
def test_resolve_gpu(arg: str, present: list[tuple[str, int]] | None, card: str) -> None:
    assert resolve_gpu(arg, present).id == card


@pytest.mark.parametrize(
    ("arg", "present", "match"),
    [
        (
            "h100",
            None,
            r"--gpu 'h100' is ambiguous \(none of them is detected here\); "
            r"choose one of \['h100-sxm', 'h100-pcie'\]",
        ),
        (
            "h100",
            [("NVIDIA H100 PCIe", 81559 * MIB), ("NVIDIA H100 80GB HBM3", 81559 * MIB)],
            "several are present",
        ),
        ("a100", [("NVIDIA L4", 23034 * MIB)], "ambiguous"),
        ("tpu-v5", None, r"--gpu 'tpu-v5': unknown GPU; choose one of \["),
    ],
)
def test_resolve_gpu_errors(arg: str, present: list[tuple[str, int]] | None, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_gpu(arg, present)


def test_cpu_card_gets_host_memory() -> None:
    assert resolve_gpu("cpu").memory_bytes > 0


# ---- kvtune gpus -------------------------------------------------------------------------------------
def test_gpus_command_shows_cards_and_a_space(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["gpus", "--space", "h200", "--model", "random:llama-3-8b"]) == 0
    out = capsys.readouterr().out
    assert "h100-pcie" in out and "for h200 / random:llama-3-8b" in out
    assert "tier parameters are fixed" in out


def test_gpus_command_ambiguous_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gpus", "--space", "h100"]) == 2
    assert "kvtune: error: --space 'h100' is ambiguous" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--space", "b300"], "--space 'b300': unknown GPU"), (["--length", "-4"], "--length -4: must be >= 1"),
     (["--concurrency", "0"], "--concurrency 0: must be >= 1")],
)  # fmt: skip
def test_gpus_command_bad_input_is_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["gpus", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("kvtune: error: ") and message in err[-1]


@pytest.mark.parametrize("real", [False, True])
def test_warm_configs_cover_every_kernel_choice_once_defaults_first(real: bool) -> None:
    """What a study compiles ahead: the default points first, then every bit width × block size, and with
    the sparse tier each of those with one and two sparse blocks; each once, each inside the space."""
    space = _space(real=real)
    configs = space.warm_configs()
    assert configs[: len(space.default_configs())] == space.default_configs()
    assert len(set(configs)) == len(configs)
    dense = {(c.quantization_bits, c.block_size) for c in configs if c.sparse_top_k == 0}
    assert dense == {(q, b) for q in space.bits for b in space.block_sizes}
    sparse = {(c.quantization_bits, c.block_size, c.sparse_blocks) for c in configs if c.sparse_top_k}
    expected = {(q, b, k) for q in space.bits for b in space.block_sizes for k in (1, 2)}
    assert sparse == (expected if real else set())
    for c in configs:
        space.params_for(c)  # raises for a config outside the space
