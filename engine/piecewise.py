"""Prompt and mixed forwards with their dense parts replayed as CUDA graphs, attention between them eager.

A forward that carries prompt tokens (a prompt chunk alone, several, or chunks beside decode rows) cannot be
one graph: its attention's shapes (the chunks, their cached prefixes, the decode rows' tables) change with
every iteration. Everything else is row by row and has the shape of its token count alone, so it is captured
per token-count *bucket* in pieces cut at each layer's attention, as vLLM's piecewise graphs do:

- piece 0: embeddings, RoPE's cos/sin of the positions, layer 0's RMSNorm, QKV projection and RoPE;
- piece i (1 … L-1): layer i-1's output projection, residual add + RMSNorm, MLP, then layer i's residual add
  + RMSNorm, QKV projection and RoPE;
- piece L: the last layer's output projection, residual add + RMSNorm and MLP.

Between pieces the forward's attention (``attend``: the cache's decode rows and prompt chunks) runs eagerly on
the first ``N`` rows of the static q, k, v buffers and writes its output into the static attention buffer.
The final norm and the LM head run eagerly on the rows whose logits are wanted. A forward of ``N`` tokens
runs in the smallest bucket ≥ N; the padding rows compute whatever their stale inputs give and nothing reads
them (every captured operation is row by row). A forward longer than the largest bucket runs eagerly (at
that size its launches are a small share of its device time).

So an eager layer's dense launches (4 matrix products, 2 norms, RoPE, SiLU: 8, and their copies) become one
graph replay. The attention and the cache's writes stay as they are. Every graph of every bucket is captured
when the runner is built (:meth:`PiecewiseForward.capture_all`), before any replay measures anything, into
one memory pool; buffers live outside it, so pieces may replay in any order. Without capture (a CPU) the
same piece functions run directly on the same padded buffers: what the CPU tests compare with the eager
forward.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from kvtune.engine.model import Attend, rope_cos_sin
from kvtune.kernels.elementwise import add_rms_norm, rope_qkv, silu_mul


def _bucket_steps(limit: int = 2048) -> tuple[int, ...]:
    """Token-count buckets whose padding costs at most a sixteenth above 512 rows (an eighth from 256): up to
    256 rows a forward of an 8B model reads its weights once whatever its rows, so coarse steps there (16, 32,
    64, 128, 192, 256); above it steps of 32 up to 1,024 and of 64 up to ``limit``."""
    out, n = [16, 32, 64, 128, 192, 256], 256
    while n < limit:
        n += 32 if n < 1024 else 64
        out.append(n)
    return tuple(out)


# token-count buckets: a forward of N tokens pads to the first one >= N. Doubling steps above 256 (…, 1,024,
# 1,536, 2,048) padded the 1,025-1,036-token prompts of the README's study to 1,536 rows: the dense pieces of
# forwards with prompt tokens computed 1.19-1.26x their rows (CPU count, lab/scripts/bucket_waste.py) and the
# unloaded replay's P99 TTFT, which the capacity limits derive from, read 34-35 ms in pieces or mixed graphs
# against 24-25 op by op.
PIECE_BUCKETS = _bucket_steps()


def piece_buckets(max_tokens: int) -> list[int]:
    """The buckets a runner for forwards of at most ``max_tokens`` tokens captures (at most 2,048)."""
    out = [b for b in PIECE_BUCKETS if b < max_tokens]
    top = next((b for b in PIECE_BUCKETS if b >= max_tokens), None)
    return out if top is None else [*out, top]


class PiecewiseForward:
    """The dense pieces of one model's forwards (see the module docstring).

    ``max_tokens``: the most tokens of a forward (the engine's ``max_num_batched_tokens``); ``capture``:
    replay CUDA graphs (needs the model on CUDA), otherwise run the pieces directly.
    """

    def __init__(self, model: Any, max_tokens: int, capture: bool) -> None:
        if capture and model.device.type != "cuda":
            raise ValueError("capturing CUDA graphs needs a CUDA model")
        self.model, self.capture = model, capture
        self.buckets = piece_buckets(max_tokens)
        s, dev, dt = model.spec, model.device, model.dtype
        rows = self.buckets[-1]
        self._tokens = torch.zeros(rows, dtype=torch.int64, device=dev)
        self._positions = torch.zeros(rows, dtype=torch.int64, device=dev)
        self._x = torch.zeros(rows, s.hidden_size, dtype=dt, device=dev)
        self._delta = torch.zeros(rows, s.hidden_size, dtype=dt, device=dev)
        self._cos = torch.zeros(rows, s.head_dim, dtype=torch.float32, device=dev)
        self._sin = torch.zeros(rows, s.head_dim, dtype=torch.float32, device=dev)
        self._q = torch.zeros(rows, s.num_heads, s.head_dim, dtype=dt, device=dev)
        self._k = torch.zeros(rows, s.num_kv_heads, s.head_dim, dtype=dt, device=dev)
        self._v = torch.zeros(rows, s.num_kv_heads, s.head_dim, dtype=dt, device=dev)
        self._attn = torch.zeros(rows, s.num_heads * s.head_dim, dtype=dt, device=dev)
        self._graphs: dict[tuple[int, int], Any] = {}
        self.capture_ms = 0.0

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def fits(self, tokens: int) -> bool:
        return 0 < tokens <= self.max_tokens

    def bucket(self, tokens: int) -> int:
        return next(b for b in self.buckets if b >= tokens)

    # ---- a forward ---------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        attend: Attend,
        rows: torch.Tensor | None = None,
        last_only: bool = False,
        between_layers: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """What :meth:`LlamaModel._forward` returns for these arguments: logits [N, V] float32 of every row,
        of the last (``last_only``) or of ``rows`` (indices); ``between_layers()`` before every layer's
        attention but the first."""
        n = len(token_ids)
        if not self.fits(n):
            raise ValueError(f"{n} tokens: the pieces take 1..{self.max_tokens}")
        nb = self.bucket(n)
        self._tokens[:n].copy_(token_ids)
        self._positions[:n].copy_(positions)
        self._piece(nb, 0)
        for i in range(len(self.model.layers)):
            if i and between_layers is not None:
                between_layers()
            out = attend(i, self._q[:n], self._k[:n], self._v[:n])
            self._attn[:n].copy_(out.reshape(n, -1))
            self._piece(nb, i + 1)
        x, delta = self._x[:n], self._delta[:n]
        if last_only:
            x, delta = x[-1:], delta[-1:]
        elif rows is not None:
            x, delta = x[rows], delta[rows]
        m = self.model
        return F.linear(add_rms_norm(x, delta, m.norm, m.spec.rms_eps)[1], m.lm_head).float()

    def stage_inputs(self, token_ids: torch.Tensor, positions: torch.Tensor, n: int) -> None:
        """The first ``n`` rows of the static inputs (device tensors; a captured iteration's own copy)."""
        self._tokens[:n].copy_(token_ids)
        self._positions[:n].copy_(positions)

    def forward_rows(self, nb: int, attend: Attend) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row of bucket ``nb`` through every layer, the pieces run directly (no graph: a caller
        capturing the whole forward captures them with it) and ``attend(i, q, k, v)`` given all ``nb`` rows;
        the residual stream and the last MLP's output [nb, hidden] (views of the static buffers), before the
        final norm."""
        self._run_piece(nb, 0)
        for i in range(len(self.model.layers)):
            out = attend(i, self._q[:nb], self._k[:nb], self._v[:nb])
            self._attn[:nb].copy_(out.reshape(nb, -1))
            self._run_piece(nb, i + 1)
        return self._x[:nb], self._delta[:nb]

    def _piece(self, nb: int, i: int) -> None:
        if self.capture:
            self._graphs[(nb, i)].replay()
        else:
            self._run_piece(nb, i)

    # ---- the pieces ----------------------------------------------------------------------------------------
    def _run_piece(self, nb: int, i: int) -> None:
        m = self.model
        eps, layers = m.spec.rms_eps, m.layers
        if i == 0:
            cos, sin = rope_cos_sin(m.inv_freq, self._positions[:nb])
            self._cos[:nb].copy_(cos)
            self._sin[:nb].copy_(sin)
            x, h = add_rms_norm(F.embedding(self._tokens[:nb], m.embed), None, layers[0].attn_norm, eps)
            self._x[:nb].copy_(x)
            self._qkv(nb, 0, h)
            return
        w = layers[i - 1]  # the layer whose attention ran before this piece
        x = self._x[:nb]  # the residual stream, added to in place (each row read before it is written)
        _, h = add_rms_norm(x, F.linear(self._attn[:nb], w.wo), w.ffn_norm, eps, sum_out=x)
        delta = F.linear(silu_mul(F.linear(h, w.w_gate_up)), w.w_down)
        if i == len(layers):
            self._delta[:nb].copy_(delta)
            return
        _, h = add_rms_norm(x, delta, layers[i].attn_norm, eps, sum_out=x)
        self._qkv(nb, i, h)

    def _qkv(self, nb: int, i: int, h: torch.Tensor) -> None:
        """Layer i's q, k, v of the normed ``h``, written into the static buffers."""
        s = self.model.spec
        qkv = F.linear(h, self.model.layers[i].wqkv)
        out = (self._q[:nb], self._k[:nb], self._v[:nb])
        rope_qkv(qkv, self._cos[:nb], self._sin[:nb], s.num_heads, s.num_kv_heads, out=out)

    # ---- capture -----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every piece of every bucket (on CUDA; nothing to do otherwise): each after one run of its
        function on a side stream (which compiles and loads its kernels and lets cuBLAS pick its plans at
        this shape), all into one pool. :attr:`capture_ms` says how long it took."""
        if not self.capture or self._graphs:
            return
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        pieces = len(self.model.layers) + 1
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for nb in self.buckets:
                for i in range(pieces):
                    self._run_piece(nb, i)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        for nb in self.buckets:
            for i in range(pieces):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._run_piece(nb, i)
                self._graphs[(nb, i)] = graph
        torch.cuda.synchronize()
        self.capture_ms += (time.perf_counter() - t0) * 1000.0
