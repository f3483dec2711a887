"""``kvtune quality --config CFG``: measure what a config costs in quality against the unquantized cache."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from kvtune.cache_impl.config import HybridConfig
from kvtune.engine.aggregation import AGGREGATION_PROMPTS
from kvtune.engine.engine import resolve_device
from kvtune.engine.metrics import json_safe
from kvtune.engine.model import load_model
from kvtune.engine.options import DTYPES
from kvtune.engine.quality import measure_quality
from kvtune.tuner.commands import Limits, check_numbers
from kvtune.tuner.console import progress_bar, table_console

NAME = "quality"
HELP = (
    "measure a hybrid_v2 config's quality (KL, top-1, perplexity, passkey, aggregation) against the "
    "unquantized cache"
)
EXCERPT = Path("examples") / "text" / "wikitext2_excerpt.txt"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="hybrid_v2 config JSON file")
    parser.add_argument(
        "--model", default="smollm2", help="smollm2 (default), a HF directory, a .gguf, random:<shape>"
    )
    parser.add_argument(
        "--text", default=None, help=f"UTF-8 text file (default: the WikiText-2 excerpt shipped in {EXCERPT})"
    )
    parser.add_argument("--windows", type=int, default=8, help="text windows (default 8)")
    parser.add_argument(
        "--prefill", type=int, default=2048, help="prefilled tokens per window (default 2048)"
    )
    parser.add_argument(
        "--decode", type=int, default=512, help="tokens decoded one by one per window (default 512)"
    )
    parser.add_argument(
        "--step-ms", type=float, default=50.0, help="virtual clock: ms per decode step (default 50)"
    )
    parser.add_argument("--no-passkey", action="store_true", help="skip the passkey check")
    parser.add_argument(
        "--no-aggregation",
        action="store_true",
        help="skip the aggregation probe (6 key-value pairs spread over --prefill tokens, recalled)",
    )
    parser.add_argument(
        "--aggregation-prompts",
        type=int,
        default=AGGREGATION_PROMPTS,
        help=f"the aggregation probe's prompts, 6 pairs each, decoded as one batch (default "
        f"{AGGREGATION_PROMPTS}); more prompts, a finer recall rate",
    )
    parser.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    parser.add_argument(
        "--dtype", choices=list(DTYPES), default="float32", help="model precision (default float32)"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="CPU threads for PyTorch (default: PyTorch's choice)"
    )
    parser.add_argument("--json", default=None, help="write the result to this file")


LIMITS: Limits = {
    "--windows": (1, True),
    "--prefill": (1, True),
    "--decode": (1, True),
    "--step-ms": (0, False),
    "--threads": (1, True),
    "--aggregation-prompts": (1, True),
}


def run(args: argparse.Namespace) -> int:
    check_numbers(args, LIMITS)
    config = HybridConfig.from_json_file(args.config)
    text_path = Path(args.text) if args.text else _default_text()
    try:
        text = text_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{text_path}: cannot read the text ({e.__class__.__name__}: {e})") from None
    device = resolve_device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    console = Console(stderr=True)
    with console.status(f"loading {args.model}"):
        loaded = load_model(args.model, device, DTYPES[args.dtype])
    if not loaded.real_weights:
        console.print("[yellow]warning:[/] random weights: attention patterns, and so quality, mean nothing")
    with progress_bar(console, remaining=True) as bar:
        task = bar.add_task("decode steps", total=None)
        result = measure_quality(
            loaded,
            config,
            text,
            args.windows,
            args.prefill,
            args.decode,
            args.step_ms,
            not args.no_passkey,
            progress=lambda done, total: bar.update(task, completed=done, total=total),
            aggregation=not args.no_aggregation,
            aggregation_prompts=args.aggregation_prompts,
        )
    d = result.to_dict()
    table_console().print(_table(d, args.model, text_path))
    if args.json:
        record = {**d, "text": str(text_path), "device": str(device), "dtype": args.dtype}
        Path(args.json).write_text(json.dumps(json_safe(record), indent=2) + "\n", encoding="utf-8")
    return 0


def _default_text() -> Path:
    candidates = [Path.cwd() / EXCERPT, Path(__file__).resolve().parents[2] / EXCERPT]
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the default text {EXCERPT} was not found (looked in {[str(c) for c in candidates]}); "
        "pass --text FILE"
    )


def _table(d: dict[str, Any], model: str, text: Path) -> Table:
    c = d["config"]
    bits = "unquantized" if c["quantization_bits"] == 0 else f"INT{c['quantization_bits']}"
    table = Table(
        title=f"kvtune quality: {model}, {bits}, hot {c['hot_tokens']}, block {c['block_size']}, "
        f"sparse_top_k {c['sparse_top_k']}"
    )
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("mean KL (base ‖ config)", f"{d['mean_kl']:.3e}")
    table.add_row("max KL", f"{d['max_kl']:.3e}")
    table.add_row("top-1 agreement", f"{100 * d['top1_agreement']:.2f} %")
    table.add_row("perplexity (config / base)", f"{d['ppl']:.4f} / {d['ppl_base']:.4f}")
    table.add_row("perplexity change", f"{d['ppl_change_pct']:+.3f} %")
    table.add_row("attention on cold blocks", f"{100 * d['cold_attention_share']:.1f} %")
    table.add_row("attention on L2 blocks", f"{100 * d['l2_attention_share']:.1f} %")
    table.add_row("passkey (config / base)", f"{_rate(d['passkey_rate'])} / {_rate(d['passkey_base_rate'])}")
    table.add_row(
        f"aggregation: pairs recalled of {d.get('aggregation_facts') or '-'} (config / base)",
        f"{_rate(d['aggregation_rate'])} / {_rate(d['aggregation_base_rate'])}",
    )
    if d["aggregation_nll"] is not None:
        table.add_row(
            "aggregation: NLL per value token (config / base)",
            f"{d['aggregation_nll']:.4f} / {d['aggregation_base_nll']:.4f}",
        )
    table.add_row(
        "windows × (prefill + decode)", f"{d['windows']} × ({d['prefill_tokens']} + {d['decode_tokens']})"
    )
    table.add_row("virtual step", f"{d['step_ms']:g} ms")
    table.add_row("text", f"{text.name} (sha256 {d['text_sha256'][:12]})")
    return table


def _rate(x: float | None) -> str:
    return "skipped" if x is None or not math.isfinite(x) else f"{100 * x:.0f} %"
