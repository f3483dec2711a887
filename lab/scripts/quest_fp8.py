"""Would Quest select as well from a summary at half the bytes? Real SmolLM2-135M keys and queries, real text.

Quest's bound of a block for a query is ``Σ_d max(q_d · lo_d, q_d · hi_d)`` over the block's per-channel key
minimum ``lo`` and maximum ``hi``; the cache reads them as fp16 key mins and scales (512 bytes a block and KV
head at head dim 128), and at 16 × 32K those reads, 29.6 MB a layer, are most of the selection's time. This
script compares, per (layer, decode position, KV head), the blocks selected from

* ``fp16``: ``lo`` and ``hi`` rounded to fp16 (what the cache holds);
* ``e4m3`` / ``e5m2``: ``lo`` rounded down and ``hi`` up to float8 (half the bytes; still an upper bound),
  after a per-layer scale that keeps the largest |key| inside the format's range;

by the attention mass they keep: the softmax probability, summed over the KV head's query heads, of the keys
in the selected blocks plus the hot zone, against fp16's, and the share of fp16's selected blocks each keeps.

The model runs dense (no cache): every position's keys are exact. The last ``--steps`` positions act as
decode queries over the blocks of the keys before their hot zone (``--hot`` tokens), blocks of ``--block``
tokens, the ``--top`` best selected (the rest of the context, L1, is not modelled: the selection alone is
compared).

    python lab/scripts/quest_fp8.py [--tokens 2048] [--steps 32] [--block 16] [--top 32] [--hot 32]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from kvtune.engine.model import causal_attention, load_model
from kvtune.kernels.quest_summary import outward

TEXT = Path(__file__).resolve().parents[2] / "examples" / "text" / "wikitext2_excerpt.txt"
FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def select(qg: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, top: int) -> torch.Tensor:
    """The ``top`` blocks [H, top] of Quest's bound for queries ``qg`` [H, G, D] (summed over each KV head's
    G query heads) over blocks with per-channel key bounds ``lo``, ``hi`` [M, H, D]."""
    q = qg[:, :, None, :]
    lo, hi = lo.permute(1, 0, 2)[:, None], hi.permute(1, 0, 2)[:, None]  # [H, 1, M, D]
    bound = torch.maximum(q * lo, q * hi).sum(-1).sum(1)  # [H, M]
    return bound.topk(top, dim=-1).indices


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--top", type=int, default=32)
    ap.add_argument("--hot", type=int, default=32)
    args = ap.parse_args()
    loaded = load_model("smollm2")
    assert loaded.tokenizer is not None
    ids = torch.tensor(loaded.tokenizer.encode(TEXT.read_text(encoding="utf-8"))[: args.tokens])
    model, spec = loaded.model, loaded.spec
    qs: dict[int, torch.Tensor] = {}
    ks: dict[int, torch.Tensor] = {}

    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        qs[i], ks[i] = q.float(), k.float()
        return causal_attention(q, k, v)

    with torch.inference_mode():
        model._forward(ids, torch.arange(len(ids)), attend, True)
    group = spec.num_heads // spec.num_kv_heads
    scale = spec.head_dim**-0.5
    mass: dict[str, list[float]] = {name: [] for name in ("fp16", *FORMATS)}
    kept: dict[str, list[float]] = {name: [] for name in FORMATS}
    largest = 0.0
    for layer in sorted(ks):
        k, q = ks[layer], qs[layer]  # [T, H, D], [T, Hq, D]
        top = float(k.abs().max())
        largest = max(largest, top)
        for t in range(len(ids) - args.steps, len(ids)):
            n_blocks = (t + 1 - args.hot) // args.block
            if n_blocks <= args.top:
                continue
            cold = k[: n_blocks * args.block].view(n_blocks, args.block, spec.num_kv_heads, spec.head_dim)
            lo, hi = cold.amin(1), cold.amax(1)  # [M, H, D]
            qg = q[t].view(spec.num_kv_heads, group, spec.head_dim)  # [H, G, D]
            probs = torch.softmax((q[t][:, None, :] * k[: t + 1].repeat_interleave(group, 1).transpose(0, 1))
                                  .sum(-1) * scale, dim=-1)  # fmt: skip  # [Hq, t+1]
            block_mass = probs[:, : n_blocks * args.block].view(spec.num_heads, n_blocks, args.block).sum(-1)
            hot_mass = probs[:, n_blocks * args.block :].sum(-1)
            block_mass = block_mass.view(spec.num_kv_heads, group, n_blocks).sum(1)  # [H, M]
            hot_mass = hot_mass.view(spec.num_kv_heads, group).sum(1)

            chosen = {"fp16": select(qg, lo.half().float(), hi.half().float(), args.top)}
            s = 448.0 / top if top > 448.0 else 1.0
            for name, dtype in FORMATS.items():
                down, up = outward(lo * s, dtype, False) / s, outward(hi * s, dtype, True) / s
                chosen[name] = select(qg, down, up, args.top)
            for name, idx in chosen.items():
                got = (block_mass.gather(1, idx).sum(1) + hot_mass) / group
                mass[name].extend(got.tolist())
            ref = chosen["fp16"]
            for name in FORMATS:
                same = (chosen[name][:, :, None] == ref[:, None, :]).any(-1).float().mean(-1)
                kept[name].extend(same.tolist())
    print(
        f"SmolLM2-135M, {len(ids)} tokens of {TEXT.name}, last {args.steps} positions as queries, blocks of "
        f"{args.block}, top {args.top}, hot {args.hot}; largest |key| {largest:.1f}"
    )
    base = statistics.mean(mass["fp16"])
    for name, values in mass.items():
        line = f"  {name}: attention mass kept {statistics.mean(values):.4f} (min {min(values):.4f})"
        if name in kept:
            worse = statistics.mean(values) - base
            line += f", {worse:+.4f} against fp16; fp16's blocks kept {statistics.mean(kept[name]):.3f}"
            line += f" (min {min(kept[name]):.3f})"
        print(line)


if __name__ == "__main__":
    main()
