"""How far the decoder's outputs move with the kernels and the dtype, on real weights and real text.

Prefills 8 windows of 1,024 tokens of the WikiText-2 excerpt through the real SmolLM2-135M (unquantized cache)
and compares the logits of the last 256 positions of each window with a float32 run on the PyTorch
references: float32 with the Triton kernels, bf16 with the Triton kernels, bf16 with the references
(``KVTUNE_KERNELS``). Prints max |Δlogit|, mean KL(reference ‖ run) and top-1 agreement.

    python benchmarks/kernel_precision.py        # on a CUDA machine with the SmolLM2 weights
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from kvtune.cache_impl.config import HybridConfig
from kvtune.engine.model import load_model
from kvtune.engine.quality import single_sequence_cache, text_token_ids
from kvtune.kernels.backend import kernel_choice

TEXT = "examples/text/wikitext2_excerpt.txt"
CONFIG = HybridConfig.from_json_file("examples/configs/q_unquantized.json")


def logits(dtype: torch.dtype, kernels: str, windows: int = 8, length: int = 1024) -> torch.Tensor:
    """float32 logits [windows · 256, V] of the last 256 positions of each window."""
    os.environ["KVTUNE_KERNELS"] = kernels
    kernel_choice.cache_clear()  # the launchers read the variable once: make them read it again
    loaded = load_model("smollm2", "cuda", dtype)
    ids = text_token_ids(loaded, Path(TEXT).read_text(encoding="utf-8"))
    out = []
    for w in range(windows):
        seq = ids[w * 3000 : w * 3000 + length]
        cache = single_sequence_cache(loaded, CONFIG, length + 76)
        cache.add_sequence(0, seq)
        out.append(loaded.model.prefill(cache, 0, torch.tensor(seq, device="cuda"), 0)[-256:])
    return torch.cat(out).float()


def main() -> None:
    ref = logits(torch.float32, "torch")
    for name, dtype, kernels in [("fp32 triton", torch.float32, "triton"),
                                 ("bf16 triton", torch.bfloat16, "triton"),
                                 ("bf16 torch", torch.bfloat16, "torch")]:  # fmt: skip
        x = logits(dtype, kernels)
        lp, lq = ref.log_softmax(-1), x.log_softmax(-1)
        kl = float((lp.exp() * (lp - lq)).sum(-1).mean())
        top1 = float((x.argmax(-1) == ref.argmax(-1)).float().mean())
        print(f"{name}: vs fp32 reference over {x.shape[0]} positions: max|dlogit| "
              f"{float((x - ref).abs().max()):.3g} mean KL {kl:.3e} top-1 {top1:.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
