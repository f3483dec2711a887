"""The hybrid_v2 configuration contract (docs/DESIGN.md §1).

A configuration is a JSON object; it is also accepted in the forms kvtune writes, so its outputs are its
inputs: nested as ``{"additional_config": {"kvtune": {...}}}`` (what vLLM's config carries), as the
``{"kvtune": {...}}`` block a preset exports for ``--additional-config``, and as a whole preset file
(``{"format": "kvtune-preset/1", "config": {...}, ...}``: its ``config``, the one it recommends). Only the
config object itself is validated. Every rule below is enforced at construction: a missing required key, a
wrong type, a value outside its rule or an unknown key raises :class:`ConfigError` naming the key, the value
and the rule. Nothing is coerced. JSON text with a key given twice, or nested deeper than
:data:`MAX_JSON_DEPTH`, is refused before it is parsed further (one line, naming the file).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

Strategy = Literal["hybrid_v2"]
Bits = Literal[0, 4, 8]
STRATEGIES: tuple[str, ...] = get_args(Strategy)
BITS: tuple[int, ...] = get_args(Bits)
HOT_TOKENS_RANGE = (16, 1024)
BLOCK_SIZE_RANGE = (8, 512)
MAX_JSON_DEPTH = 32  # a preset nests 5 levels; deeper is not a config (and would exhaust the parser's stack)
PRESET_FORMAT_PREFIX = "kvtune-preset/"
SHOWN_CHARS = 100  # a value echoed in a message is cut to this many characters


class ConfigError(ValueError):
    """A configuration broke a rule of the hybrid_v2 contract."""


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """``value`` as JSON for a message, cut to ``limit`` characters (``...`` marks the cut). Encoded lazily:
    a list of millions of items costs what its first few do, and the message stays one short line."""
    text = ""
    for chunk in json.JSONEncoder(ensure_ascii=False, default=repr).iterencode(value):
        text += chunk
        if len(text) > limit:
            return text[:limit] + "..."
    return text


def shown_key(key: Any, limit: int = SHOWN_CHARS) -> str:
    """A key (as ``repr`` shows it, quoted) cut like :func:`shown`."""
    text = repr(key[: limit + 1] if isinstance(key, str) else key)
    return text if len(text) <= limit else text[:limit] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


@dataclass(frozen=True)
class _Rule:
    kind: str  # "int", "bool", "number", "str", "int|null"
    text: str  # the rule as users read it
    check: Callable[[Any], bool]
    required: bool = False

    def type_ok(self, value: Any) -> bool:
        if self.kind == "int":
            return _is_int(value)
        if self.kind == "int|null":
            return value is None or _is_int(value)
        if self.kind == "bool":
            return isinstance(value, bool)
        if self.kind == "number":
            return _is_number(value)
        return isinstance(value, str)


def _power_of_two(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


RULES: dict[str, _Rule] = {
    "kv_cache_strategy": _Rule("str", f"one of {list(STRATEGIES)}", lambda v: v in STRATEGIES, required=True),
    "hot_tokens": _Rule(
        "int",
        f"a power of two in [{HOT_TOKENS_RANGE[0]}, {HOT_TOKENS_RANGE[1]}]",
        lambda v: _power_of_two(v) and HOT_TOKENS_RANGE[0] <= v <= HOT_TOKENS_RANGE[1],
        required=True,
    ),
    "block_size": _Rule(
        "int",
        f"a multiple of 8 in [{BLOCK_SIZE_RANGE[0]}, {BLOCK_SIZE_RANGE[1]}]",
        lambda v: v % 8 == 0 and BLOCK_SIZE_RANGE[0] <= v <= BLOCK_SIZE_RANGE[1],
        required=True,
    ),
    "quantization_bits": _Rule("int", f"one of {list(BITS)}", lambda v: v in BITS, required=True),
    "sparse_top_k": _Rule("int", "0 or a positive multiple of block_size", lambda v: v >= 0),
    "migration_throttling": _Rule("bool", "true or false", lambda v: True),
    "migration_interval": _Rule("int", "an integer >= 1", lambda v: v >= 1),
    "migration_threshold_ms": _Rule("number", "a finite number > 0", lambda v: v > 0),
    "max_migrations_per_step": _Rule("int|null", "an integer >= 1, or absent", lambda v: v is None or v >= 1),
    "kv_cache_debug": _Rule("bool", "true or false", lambda v: True),
}


@dataclass(frozen=True)
class HybridConfig:
    """One hybrid_v2 configuration; see the table in README.md (and docs/DESIGN.md §1) for every field."""

    kv_cache_strategy: Strategy
    hot_tokens: int
    block_size: int
    quantization_bits: int
    sparse_top_k: int = 0
    migration_throttling: bool = False
    migration_interval: int = 100
    migration_threshold_ms: float = 3000.0
    max_migrations_per_step: int | None = None
    kv_cache_debug: bool = False

    def __post_init__(self) -> None:
        self.validate_dict(dataclasses.asdict(self))

    # ---- construction -------------------------------------------------------------------------------
    @staticmethod
    def validate_dict(d: Mapping[str, Any]) -> None:
        """Raise :class:`ConfigError` on the first rule ``d`` breaks (keys checked in table order)."""
        unknown = sorted(set(d) - set(RULES))
        if unknown:
            raise ConfigError(f"unknown key {shown_key(unknown[0])}; valid keys are {list(RULES)}")
        for key, rule in RULES.items():
            if key not in d:
                if rule.required:
                    raise ConfigError(f"missing required key {key!r} ({rule.text})")
                continue
            value = d[key]
            if not rule.type_ok(value):
                raise ConfigError(
                    f"{key}={shown(value)} has type {type(value).__name__}, but must be {rule.text}"
                )
            if not rule.check(value):
                raise ConfigError(f"{key}={shown(value)} breaks the rule: must be {rule.text}")
        top_k, block = d.get("sparse_top_k", 0), d["block_size"]
        if top_k % block:
            raise ConfigError(
                f"sparse_top_k={top_k} breaks the rule: must be 0 or a multiple of block_size={block}"
            )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> HybridConfig:
        """Build from a plain or nested (``additional_config.kvtune``) mapping."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"a config must be a JSON object, got {type(d).__name__}")
        d = _unnest(d)
        cls.validate_dict(d)
        return cls(**dict(d))

    @classmethod
    def from_json(cls, text: str, source: str = "<string>") -> HybridConfig:
        data = parse_json(text, source)
        try:
            return cls.from_dict(data)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def from_json_file(cls, path: str | Path) -> HybridConfig:
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{p}: cannot read the config file ({e.__class__.__name__}: {e})") from None
        return cls.from_json(text, source=str(p))

    # ---- output --------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The JSON object, defaults included (``max_migrations_per_step`` only when set)."""
        d = dataclasses.asdict(self)
        if d["max_migrations_per_step"] is None:
            del d["max_migrations_per_step"]
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def replace(self, **changes: Any) -> HybridConfig:
        return dataclasses.replace(self, **changes)

    # ---- derived ---------------------------------------------------------------------------------------
    @property
    def sparse_blocks(self) -> int:
        """L2 blocks attended per decode step and KV head (``sparse_top_k / block_size``)."""
        return self.sparse_top_k // self.block_size

    @property
    def cold_bits(self) -> int:
        return self.quantization_bits

    def unquantized(self) -> HybridConfig:
        """The baseline of this config: same hot zone and block size, nothing quantized, no sparse tier."""
        return self.replace(quantization_bits=0, sparse_top_k=0, migration_throttling=False)


def parse_json(text: str, source: str = "<string>") -> Any:
    """``text`` as JSON, refusing (one :class:`ConfigError` line naming ``source``) what is not plain
    configuration: invalid JSON, an object with a key given twice (JSON would keep the last silently), and
    nesting deeper than :data:`MAX_JSON_DEPTH` (checked before parsing, so no recursion limit is reached)."""
    depth, line = _max_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise ConfigError(
            f"{source}:{line}: nested more than {MAX_JSON_DEPTH} levels deep; a config is not (a preset "
            "nests 5)"
        )
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{source}:{e.lineno}:{e.colno}: not valid JSON ({e.msg})") from None
    except _DuplicateKeyError as e:
        key = shown_key(e.args[0])
        raise ConfigError(f"{source}: key {key} appears twice in one object; keep one") from None
    except RecursionError:
        raise ConfigError(f"{source}: nested too deeply to be a config") from None


class _DuplicateKeyError(Exception):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKeyError(key)
        out[key] = value
    return out


def _max_depth(text: str) -> tuple[int, int]:
    """The deepest nesting of ``[`` and ``{`` outside strings (stopping once past :data:`MAX_JSON_DEPTH`),
    and the line where it is reached."""
    depth = deepest = 0
    line = where = 1
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > deepest:
                deepest, where = depth, line
                if deepest > MAX_JSON_DEPTH:
                    break
        elif ch in "]}":
            depth -= 1
        elif ch == "\n":
            line += 1
    return deepest, where


def _unnest(d: Mapping[str, Any]) -> Mapping[str, Any]:
    """The config object of ``d``: ``d`` itself, or what one of the wrappers of the module docstring holds."""
    if isinstance(d.get("format"), str) and d["format"].startswith(PRESET_FORMAT_PREFIX):
        config = d.get("config")
        if not isinstance(config, Mapping):
            raise ConfigError(f"a preset ({d['format']}) needs a 'config' object")
        return config
    if "kvtune" in d:
        extra = sorted(set(d) - {"kvtune"})
        if extra:
            raise ConfigError(f"unknown key {shown_key(extra[0])} beside 'kvtune'; only 'kvtune' allowed")
        if not isinstance(d["kvtune"], Mapping):
            raise ConfigError(f"kvtune must be an object, got {type(d['kvtune']).__name__}")
        return d["kvtune"]
    if "additional_config" not in d:
        return d
    extra = sorted(set(d) - {"additional_config"})
    if extra:
        raise ConfigError(
            f"unknown key {shown_key(extra[0])} beside 'additional_config'; only 'additional_config' allowed"
        )
    inner = d["additional_config"]
    if not isinstance(inner, Mapping) or "kvtune" not in inner:
        raise ConfigError("additional_config must be an object holding a 'kvtune' object")
    kv = inner["kvtune"]
    if not isinstance(kv, Mapping):
        raise ConfigError(f"additional_config.kvtune must be an object, got {type(kv).__name__}")
    return kv
