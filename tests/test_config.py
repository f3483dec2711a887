"""The hybrid_v2 config contract (docs/DESIGN.md §1): every rule, the nesting, the round trip, ``kvtune
check``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvtune.cache_impl.config import ConfigError, HybridConfig

SEED_EXAMPLE: dict[str, Any] = {
    "kv_cache_strategy": "hybrid_v2",
    "hot_tokens": 32,
    "quantization_bits": 8,
    "block_size": 64,
}


def _with(**changes: Any) -> dict[str, Any]:
    d = dict(SEED_EXAMPLE)
    d.update(changes)
    return {k: v for k, v in d.items() if v is not _DROP}


_DROP = object()

BROKEN = [
    pytest.param(_with(hot_tokens=33), "hot_tokens=33", "power of two", id="hot_tokens=33"),
    pytest.param(_with(hot_tokens=8), "hot_tokens=8", "[16, 1024]", id="hot_tokens=8"),
    pytest.param(_with(hot_tokens=2048), "hot_tokens=2048", "[16, 1024]", id="hot_tokens=2048"),
    pytest.param(_with(block_size=63), "block_size=63", "multiple of 8", id="block_size=63"),
    pytest.param(_with(block_size=1024), "block_size=1024", "[8, 512]", id="block_size=1024"),
    pytest.param(_with(quantization_bits=3), "quantization_bits=3", "[0, 4, 8]", id="bits=3"),
    pytest.param(_with(sparse_top_k=100), "sparse_top_k=100", "multiple of block_size=64", id="top_k=100"),
    pytest.param(_with(sparse_top_k=-64), "sparse_top_k=-64", "multiple of block_size", id="top_k<0"),
    pytest.param(_with(hot_token=32), "'hot_token'", "valid keys", id="unknown-key"),
    pytest.param(_with(hot_tokens="32"), 'hot_tokens="32"', "type str", id="string-for-int"),
    pytest.param(_with(hot_tokens=32.0), "hot_tokens=32.0", "type float", id="float-for-int"),
    pytest.param(_with(hot_tokens=True), "hot_tokens=true", "type bool", id="bool-for-int"),
    pytest.param(_with(block_size=_DROP), "'block_size'", "missing", id="missing-block_size"),
    pytest.param(_with(kv_cache_strategy="paged"), 'kv_cache_strategy="paged"', "hybrid_v2", id="paged"),
    pytest.param(_with(migration_throttling=1), "migration_throttling=1", "true or false", id="int-for-bool"),
    pytest.param(_with(migration_interval=0), "migration_interval=0", ">= 1", id="interval=0"),
    pytest.param(_with(migration_threshold_ms=0), "migration_threshold_ms=0", "> 0", id="threshold=0"),
    pytest.param(_with(max_migrations_per_step=0), "max_migrations_per_step=0", ">= 1", id="max_migr=0"),
]


@pytest.mark.parametrize(("data", "names", "rule"), BROKEN)
def test_each_broken_rule_names_key_value_and_rule(data: dict[str, Any], names: str, rule: str) -> None:
    with pytest.raises(ConfigError) as info:
        HybridConfig.from_dict(data)
    message = str(info.value)
    assert names in message and rule in message, message
    assert "\n" not in message


def test_seed_example_resolves_defaults() -> None:
    config = HybridConfig.from_dict(SEED_EXAMPLE)
    assert (config.sparse_top_k, config.migration_throttling, config.migration_interval) == (0, False, 100)
    assert config.migration_threshold_ms == 3000 and config.max_migrations_per_step is None
    assert config.kv_cache_debug is False


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"kv_cache_debug": True},
        {"sparse_top_k": 128, "migration_throttling": True, "max_migrations_per_step": 3},
        {"migration_threshold_ms": 12.5, "migration_interval": 1, "quantization_bits": 0},
    ],
)
def test_round_trip_through_json(extra: dict[str, Any]) -> None:
    config = HybridConfig.from_dict(_with(**extra))
    again = HybridConfig.from_json(config.to_json())
    assert again == config
    assert json.loads(again.to_json()) == json.loads(config.to_json())


def test_nested_additional_config_is_unwrapped() -> None:
    nested = {"additional_config": {"kvtune": _with(quantization_bits=4)}}
    assert HybridConfig.from_dict(nested) == HybridConfig.from_dict(_with(quantization_bits=4))


@pytest.mark.parametrize(
    "nested",
    [
        {"additional_config": {"kvtune": _with(hot_tokens=33)}},
        {"additional_config": {}},
        {"additional_config": {"kvtune": []}},
        {"additional_config": {"kvtune": SEED_EXAMPLE}, "x": 1},
    ],
)
def test_nested_errors(nested: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        HybridConfig.from_dict(nested)


def test_config_is_frozen_and_validated_at_construction() -> None:
    config = HybridConfig.from_dict(SEED_EXAMPLE)
    with pytest.raises(AttributeError):
        config.hot_tokens = 64  # type: ignore[misc]
    with pytest.raises(ConfigError):
        config.replace(block_size=12)


def test_unquantized_baseline_keeps_geometry() -> None:
    config = HybridConfig.from_dict(_with(quantization_bits=4, sparse_top_k=256))
    base = config.unquantized()
    assert (base.hot_tokens, base.block_size, base.quantization_bits, base.sparse_top_k) == (32, 64, 0, 0)


def _check(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtune", "check", str(path)], capture_output=True, text=True
    )


def test_check_command_prints_resolved_config(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(SEED_EXAMPLE))
    out = _check(path)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == HybridConfig.from_dict(SEED_EXAMPLE).to_dict()


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (json.dumps(_with(hot_tokens=33)), "hot_tokens=33"),
        (json.dumps(_with(hot_token=32)), "hot_token"),
        ("{not json", "not valid JSON"),
        ("", "not valid JSON"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_check_command_one_line_error(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(text)
    out = _check(path)
    assert out.returncode == 2
    assert out.stdout == ""
    assert needle in out.stderr and str(path) in out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr


def test_check_command_missing_file(tmp_path: Path) -> None:
    out = _check(tmp_path / "absent.json")
    assert out.returncode == 2 and "cannot read" in out.stderr and "Traceback" not in out.stderr
