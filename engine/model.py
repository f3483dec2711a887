"""A Llama-family decoder whose attention goes through a KV cache.

Per layer: ``x += o_proj(attention(rope(q), rope(k), v))`` after RMSNorm, then ``x += down(silu(gate(h)) *
up(h))`` after RMSNorm; grouped-query attention (``num_heads / num_kv_heads`` query heads share a KV head),
rotate-half RoPE with optional Llama-3.1 frequency scaling, tied or separate output embeddings. Queries and
keys are rotated here, so a cache stores rotated keys; positions are the model's business.

The cache is any object with ``prefill(layer, seq_id, q [T,Hq,D], k [T,H,D], v [T,H,D]) -> [T,Hq,D]`` and
``decode(layer, plan, q [B,Hq,D], k [B,H,D], v [B,H,D]) -> [B,Hq,D]`` (the hybrid cache, or a dense one).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from kvtune.cache_impl.chunks import upload
from kvtune.cache_impl.hybrid_cache import PREFILL_SDPA_BACKENDS
from kvtune.cache_impl.layout import ModelKVShape
from kvtune.engine.tokenizer import TextTokenizer, tokenizer_from_file, tokenizer_from_gguf_metadata
from kvtune.engine.weights import (
    SHAPES,
    ModelSpec,
    RopeScaling,
    expected_shapes,
    load_gguf,
    load_hf_dir,
    random_tensors,
    save_hf_dir,
    smollm2_gguf_path,
    spec_from_gguf,
    spec_from_hf_config,
)
from kvtune.kernels.elementwise import add_rms_norm, rope_qkv, silu_mul

__all__ = [
    "SHAPES",
    "LlamaModel",
    "LoadedModel",
    "ModelSpec",
    "RopeScaling",
    "export_hf_dir",
    "load_model",
    "model_names",
]

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class KVCacheLike(Protocol):
    def prefill(
        self, layer: int, seq_id: int, q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor | None: ...

    def decode(
        self, layer: int, plan: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...


class Pieces(Protocol):
    """What runs a forward's dense parts as pieces (:class:`kvtune.engine.piecewise.PiecewiseForward`)."""

    def fits(self, tokens: int) -> bool: ...

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        attend: Attend,
        rows: torch.Tensor | None = None,
        last_only: bool = False,
        between_layers: Callable[[], None] | None = None,
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer; projections [out, in], q/k/v and gate/up fused along ``out``."""

    attn_norm: torch.Tensor  # [hidden]
    wqkv: torch.Tensor  # [(Hq + 2 H) * D, hidden]
    wo: torch.Tensor  # [hidden, Hq * D]
    ffn_norm: torch.Tensor  # [hidden]
    w_gate_up: torch.Tensor  # [2 * ffn, hidden]
    w_down: torch.Tensor  # [hidden, ffn]


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """Inverse frequencies [D/2] float32: ``theta^(-2i/D)``, Llama-3.1-scaled when ``spec.rope_scaling``."""
    d = spec.head_dim
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    return inv if spec.rope_scaling is None else _llama3_scaled(inv, spec.rope_scaling)


def _llama3_scaled(inv: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama-3.1: long wavelengths divided by ``factor``, short ones kept, a smooth blend between."""
    wavelen = 2 * math.pi / inv
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, D] float32 for positions [N] (rotate-half layout: both halves share frequencies)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Dense causal GQA attention: q [T,Hq,D], k/v [T,H,D] -> [T,Hq,D], scale 1/sqrt(D). The grouped heads
    are SDPA's own (``enable_gqa``), as in the cache's prefill: K and V repeated per query head would send a
    CPU to SDPA's math kernel (a [T, T] score matrix per head; 9x slower at 4,096 tokens of SmolLM2)."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True,
        enable_gqa=True,
    )  # fmt: skip
    return out[0].transpose(0, 1)


class LlamaModel:
    """Inference-only Llama decoder (weights in one dtype on one device)."""

    def __init__(self, spec: ModelSpec, tensors: dict[str, torch.Tensor]) -> None:
        """Build from Hugging Face-named tensors; empties ``tensors`` as layers are fused (peak memory)."""
        self.spec = spec
        self.embed = tensors["model.embed_tokens.weight"]  # [V, hidden]
        self.lm_head = self.embed if spec.tie_embeddings else tensors["lm_head.weight"]  # [V, hidden]
        self.norm = tensors["model.norm.weight"]
        self.layers = [_layer_weights(tensors, i) for i in range(spec.num_layers)]
        self.inv_freq = rope_inv_freq(spec).to(self.embed.device)
        self.rows_warmed: set[int] = set()  # row counts :meth:`warm_rows` ran
        self.logits_warmed: set[int] = set()  # and the output projection's

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def kv_shape(self) -> ModelKVShape:
        """The KV shape and precision a cache needs for this model."""
        s = self.spec
        return ModelKVShape(s.num_layers, s.num_kv_heads, s.head_dim, s.num_heads, self.dtype)

    @torch.inference_mode()
    def warm_rows(self, counts: Iterable[int], logits: Iterable[int] = ()) -> int:
        """Run a layer's four projections and a prompt's causal attention once at each row count of
        ``counts``, and the output projection at each of ``logits`` (the rows a forward takes logits of),
        where this model has not run them before, on zeros, and wait for them; returns how many it ran.

        The matrix library picks a kernel per row count, and its first use in a process costs the host
        2-7 ms a projection (loading and setting up the kernel) where a repeat costs 0.03 ms: 10-60 ms over a
        prompt's first layer at a row count the process had not met, on an H100 with Llama-3.1-8B's shapes,
        longer than the gated clock's first gate. Run ahead of a replay for the prompts' token counts, that
        set-up falls outside the clock (and outside a wall clock's first-token times)."""
        new = sorted({int(n) for n in counts if n > 0} - self.rows_warmed)
        heads = sorted({int(n) for n in logits if n > 0} - self.logits_warmed)
        if not new and not heads:
            return 0
        s, w = self.spec, self.layers[0]
        width = max(s.hidden_size, w.w_down.shape[1], s.num_heads * s.head_dim)
        zeros = torch.zeros(max(new + heads), width, device=self.device, dtype=self.dtype)
        for n in new:
            h = zeros[:n]
            for weight in (w.wqkv, w.wo, w.w_gate_up, w.w_down):
                F.linear(h[:, : weight.shape[1]], weight)
            q = h[:, : s.num_heads * s.head_dim].view(n, s.num_heads, s.head_dim)
            kv = h[:, : s.num_kv_heads * s.head_dim].view(n, s.num_kv_heads, s.head_dim)
            with sdpa_kernel(PREFILL_SDPA_BACKENDS):  # the cache's prompt attention
                causal_attention(q, kv, kv)
        for n in heads:
            F.linear(zeros[:n, : s.hidden_size], self.lm_head)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.rows_warmed.update(new)
        self.logits_warmed.update(heads)
        return len(new) + len(heads)

    @torch.inference_mode()
    def prefill(
        self,
        cache: KVCacheLike,
        seq_id: int,
        token_ids: torch.Tensor,
        start_pos: int,
        last_only: bool = False,
        between_layers: Callable[[], None] | None = None,
        pieces: Pieces | None = None,
    ) -> torch.Tensor:
        """Logits [T, V] float32 (``last_only``: [1, V]) of T tokens at positions ``start_pos + arange(T)``.

        Calls ``cache.prefill(layer, seq_id, q, k, v)`` once per layer with the rotated q/k of these tokens
        (and ``between_layers()`` before every layer but the first: the engine's gated clock). ``pieces``: a
        :class:`~kvtune.engine.piecewise.PiecewiseForward` of this model that runs the dense parts (where
        the tokens fit its buckets).
        """
        positions = torch.arange(start_pos, start_pos + len(token_ids), device=self.device)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out = cache.prefill(i, seq_id, q, k, v)
            assert out is not None  # a prefill given queries attends
            return out

        return self._forward(
            token_ids, positions, attend, last_only, between_layers=between_layers, pieces=pieces
        )

    @torch.inference_mode()
    def decode(
        self,
        cache: KVCacheLike,
        plan: Any,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        between_layers: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Logits [B, V] float32 of one new token per sequence (token_ids, positions [B]).

        Calls ``cache.decode(layer, plan, q, k, v)`` once per layer (and ``between_layers()`` as ``prefill``).
        """
        attend: Attend = lambda i, q, k, v: cache.decode(i, plan, q, k, v)
        return self._forward(token_ids, positions.to(self.device), attend, False, None, between_layers)

    @torch.inference_mode()
    def forward_mixed(
        self,
        cache: KVCacheLike,
        plan: Any,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        num_decode: int,
        chunks: Sequence[tuple[int, int]],
        between_layers: Callable[[], None] | None = None,
        pieces: Pieces | None = None,
    ) -> torch.Tensor:
        """One forward over ``num_decode`` decode tokens then prompt chunks, logits [num_decode + len(chunks),
        V] float32: each decode row's, then each chunk's last token's (``pieces``: as :meth:`prefill`).

        token_ids, positions [N]: the decode tokens (one per sequence of ``plan``), then each chunk's tokens
        (``chunks``: (seq_id, length), in order). Embeddings, norms, projections and the MLP see all N rows
        as one batch; attention is split by segment: the decode rows through ``cache.decode(layer, plan,
        ...)``, the chunks through ``cache.prefill_chunks(layer, chunks, ...)`` where the cache has it
        (all chunks of a layer in one call), else each through ``cache.prefill(layer, seq_id, ...)``.
        """
        bounds = [num_decode]
        for _, n in chunks:
            bounds.append(bounds[-1] + n)
        if bounds[-1] != len(token_ids):
            raise ValueError(
                f"{len(token_ids)} tokens for {num_decode} decode rows and chunks {list(chunks)}"
            )

        fused = hasattr(cache, "prefill_chunks")  # a fixed number of launches a layer, one chunk or many

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            outs = (
                [cache.decode(i, plan, q[:num_decode], k[:num_decode], v[:num_decode])] if num_decode else []
            )
            if fused and chunks:  # every chunk in one call: the cache fuses their writes
                n = num_decode
                outs.append(cache.prefill_chunks(i, chunks, q[n:], k[n:], v[n:]))  # type: ignore[attr-defined]
            else:
                for (seq_id, _), a, b in zip(chunks, bounds, bounds[1:]):
                    out = cache.prefill(i, seq_id, q[a:b], k[a:b], v[a:b])
                    assert out is not None  # a prefill given queries attends
                    outs.append(out)
            return outs[0] if len(outs) == 1 else torch.cat(outs)

        rows = upload(torch.tensor(list(range(num_decode)) + [b - 1 for b in bounds[1:]]), self.device)
        positions = positions.to(self.device)
        return self._forward(token_ids, positions, attend, False, rows, between_layers, pieces)

    @torch.inference_mode()
    def forward_dense(
        self,
        token_ids: torch.Tensor,
        rows: torch.Tensor | None = None,
        kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """Logits [T, V] float32 of a whole sequence with dense causal attention (no cache); ``rows``: only
        those positions' [len(rows), V]; ``kv``: a list that gets each layer's rotated keys and values [T,
        H, D] (what a prefill of these tokens writes to a cache, layer by layer)."""
        positions = torch.arange(len(token_ids), device=self.device)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if kv is not None:
                kv.append((k, v))
            return causal_attention(q, k, v)

        return self._forward(token_ids.to(self.device), positions, attend, False, rows)

    def _forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        attend: Attend,
        last_only: bool,
        rows: torch.Tensor | None = None,
        between_layers: Callable[[], None] | None = None,
        pieces: Pieces | None = None,
    ) -> torch.Tensor:
        """Residual stream ``x``; each layer adds attention then MLP, the add fused with the next RMSNorm.
        Logits of every row, of the last (``last_only``) or of ``rows`` (indices). ``between_layers()`` is
        called before every layer but the first. ``pieces`` (where the tokens fit it) runs the same with the
        dense parts as its pieces."""
        if pieces is not None and pieces.fits(len(token_ids)):
            ids = token_ids.to(self.device)
            return pieces.forward(ids, positions, attend, rows, last_only, between_layers)
        eps = self.spec.rms_eps
        x = F.embedding(token_ids.to(self.device), self.embed)  # [N, hidden]
        cos, sin = rope_cos_sin(self.inv_freq, positions)
        delta: torch.Tensor | None = None
        for i, w in enumerate(self.layers):
            if i and between_layers is not None:
                between_layers()
            x, h = add_rms_norm(x, delta, w.attn_norm, eps)
            x, h = add_rms_norm(x, self._attention(i, w, h, cos, sin, attend), w.ffn_norm, eps)
            delta = F.linear(silu_mul(F.linear(h, w.w_gate_up)), w.w_down)
        if last_only:
            x, delta = x[-1:], None if delta is None else delta[-1:]
        elif rows is not None:
            x, delta = x[rows], None if delta is None else delta[rows]
        return F.linear(add_rms_norm(x, delta, self.norm, eps)[1], self.lm_head).float()

    def _attention(
        self, i: int, w: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """o_proj(attention) of the normed input ``h`` [N, hidden]."""
        s, n = self.spec, h.shape[0]
        q, k, v = rope_qkv(F.linear(h, w.wqkv), cos, sin, s.num_heads, s.num_kv_heads)
        return F.linear(attend(i, q, k, v).reshape(n, s.num_heads * s.head_dim), w.wo)


def _layer_weights(t: dict[str, torch.Tensor], i: int) -> LayerWeights:
    """Pop layer ``i``'s tensors from ``t`` and fuse q/k/v and gate/up."""
    p = f"model.layers.{i}."
    attn, mlp = p + "self_attn.", p + "mlp."
    return LayerWeights(
        attn_norm=t.pop(p + "input_layernorm.weight"),
        wqkv=torch.cat(
            [t.pop(attn + "q_proj.weight"), t.pop(attn + "k_proj.weight"), t.pop(attn + "v_proj.weight")]
        ),
        wo=t.pop(attn + "o_proj.weight"),
        ffn_norm=t.pop(p + "post_attention_layernorm.weight"),
        w_gate_up=torch.cat([t.pop(mlp + "gate_proj.weight"), t.pop(mlp + "up_proj.weight")]),
        w_down=t.pop(mlp + "down_proj.weight"),
    )


# ---------------------------------------------------------------------------------------------- loading


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to run, its spec, its tokenizer (None for random weights), whether weights are real."""

    model: LlamaModel
    spec: ModelSpec
    tokenizer: TextTokenizer | None
    real_weights: bool


def model_names() -> list[str]:
    """The names :func:`load_model` accepts besides paths."""
    return ["smollm2", *(f"random:{name}" for name in SHAPES)]


def load_model(
    name: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0
) -> LoadedModel:
    """Load ``smollm2`` (the real SmolLM2-135M GGUF), ``random:<shape>``, a Hugging Face dir or a .gguf."""
    dev = torch.device(device)
    if name == "smollm2":
        return _from_gguf(smollm2_gguf_path(), dev, dtype)
    if name.startswith("random:"):
        shape = name.removeprefix("random:")
        if shape not in SHAPES:
            raise ValueError(f"model {name!r}: unknown shape {shape!r}, expected one of {list(SHAPES)}")
        spec = SHAPES[shape]
        return LoadedModel(LlamaModel(spec, random_tensors(spec, dev, dtype, seed)), spec, None, False)
    path = Path(name)
    if path.is_dir():
        return _from_hf_dir(path, dev, dtype)
    if path.suffix == ".gguf" and path.is_file():
        return _from_gguf(path, dev, dtype)
    raise ValueError(
        f"model {name!r}: not found; expected one of {model_names()}, a Hugging Face model directory "
        "(config.json + *.safetensors) or a .gguf file"
    )


def model_spec(name: str) -> ModelSpec | None:
    """The spec of the model :func:`load_model` would load for ``name``, read without its weights (a shape,
    ``config.json`` or the GGUF header); None where the name is no model."""
    path = Path(name)
    try:
        if name == "smollm2":
            return SHAPES["smollm2-135m"]
        if name.startswith("random:"):
            return SHAPES.get(name.removeprefix("random:"))
        if path.is_dir():
            return spec_from_hf_config(path / "config.json")
        if path.suffix == ".gguf" and path.is_file():
            from kvtune.engine.gguf_file import read_gguf

            return spec_from_gguf(str(path), read_gguf(path)[0])
    except (OSError, ValueError, KeyError):
        return None
    return None


def model_parameters(name: str) -> int | None:
    """The parameter count of the model :func:`load_model` would load for ``name``, from its spec alone
    (:func:`model_spec`; no weights read); None where the name is no model."""
    spec = model_spec(name)
    if spec is None:
        return None
    return sum(math.prod(shape) for shape in expected_shapes(spec).values())


def _from_gguf(path: Path, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    spec, tensors, meta = load_gguf(path, device, dtype)
    return LoadedModel(LlamaModel(spec, tensors), spec, tokenizer_from_gguf_metadata(meta), True)


def _from_hf_dir(path: Path, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    spec, tensors = load_hf_dir(path, device, dtype)
    tok_file = path / "tokenizer.json"
    tokenizer = (
        tokenizer_from_file(tok_file, spec.bos_token_id, spec.eos_token_id) if tok_file.is_file() else None
    )
    return LoadedModel(LlamaModel(spec, tensors), spec, tokenizer, True)


def export_hf_dir(
    name: str, out_dir: str | Path, dtype: torch.dtype = torch.float16, shard_mb: float = 0
) -> Path:
    """Write ``smollm2``, a .gguf or a directory as config.json + safetensors (+ tokenizer.json).

    ``shard_mb > 0`` splits the weights into files of at most about that size, so a machine without ``gguf``
    can load the real weights from parts copied one by one.
    """
    path = smollm2_gguf_path() if name == "smollm2" else Path(name)
    cpu = torch.device("cpu")
    tokenizer: TextTokenizer | None = None
    if path.is_dir():
        spec, tensors = load_hf_dir(path, cpu, dtype)
    else:
        spec, tensors, meta = load_gguf(path, cpu, dtype)
        tokenizer = tokenizer_from_gguf_metadata(meta)
    out = save_hf_dir(spec, tensors, out_dir, shard_mb)
    if tokenizer is not None:
        tokenizer.backend.save(str(out / "tokenizer.json"))
    return out
