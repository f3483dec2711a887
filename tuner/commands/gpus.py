"""``kvtune gpus``: the card catalog, the GPUs present, and each card's search space for a model."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from rich.table import Table

from kvtune.cache_impl.layout import ModelKVShape
from kvtune.engine.options import CPU_BUDGET_CAP_BYTES
from kvtune.engine.weights import SHAPES, ModelSpec, spec_from_hf_config
from kvtune.search_spaces.cards import CARDS, Card, Present, match_card, resolve_gpu
from kvtune.search_spaces.space import BUDGET_FRACTION, SearchSpace, WorkloadStats
from kvtune.tuner.commands import Limits, check_numbers
from kvtune.tuner.console import table_console

NAME = "gpus"
HELP = "list the known cards, the GPUs present, and the search space of each card for a model"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--space", metavar="GPU", help="show the search space of this card only (e.g. h200, cpu)"
    )
    parser.add_argument(
        "--model", default="smollm2", help="model whose KV shape sizes the space (default smollm2)"
    )
    parser.add_argument(
        "--length", type=int, default=4096, help="workload sequence length, p99 and max (4096)"
    )
    parser.add_argument("--concurrency", type=int, default=32, help="sequences running at once (default 32)")
    parser.add_argument("--no-spaces", action="store_true", help="list the cards only")


def present_gpus() -> list[Present]:
    """(NVML name, total bytes) of each CUDA device torch sees."""
    if not torch.cuda.is_available():
        return []
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    return [(p.name, int(p.total_memory)) for p in props]


def model_spec(name: str) -> tuple[ModelSpec, bool]:
    """The spec of a model name without loading its weights, and whether its weights are real."""
    if name == "smollm2":
        return SHAPES["smollm2-135m"], True
    if name.startswith("random:") and name.removeprefix("random:") in SHAPES:
        return SHAPES[name.removeprefix("random:")], False
    if Path(name, "config.json").is_file():
        return spec_from_hf_config(Path(name, "config.json")), True
    raise ValueError(f"--model {name!r}: expected smollm2, random:<{'|'.join(SHAPES)}> or a model directory")


def _card_table(present: list[Present]) -> Table:
    here = {_safe_match(p) for p in present}
    table = Table(title="cards (memory as NVML reports it; tensor cores)")
    for col in ("id", "memory GiB", "HBM GB/s", "L2 MiB", "SMs", "INT8", "FP8", "present"):
        table.add_column(col)
    for c in CARDS.values():
        table.add_row(*(_card_row(c) if c.is_gpu else ("cpu", "host RAM", "measured", "-", "-", "-", "-")),
                      _yes(c.id in here or not c.is_gpu))  # fmt: skip
    return table


def _card_row(c: Card) -> tuple[str, ...]:
    mem, l2 = f"{c.memory_bytes / 2**30:.1f}", f"{c.l2_bytes / 2**20:g}"
    return (
        c.id,
        mem,
        f"{c.hbm_bandwidth_gbs:g}",
        l2,
        str(c.sms),
        _yes(c.int8_tensor_cores),
        _yes(c.fp8_tensor_cores),
    )


def _safe_match(p: Present) -> str | None:
    try:
        return match_card(*p).id
    except ValueError:
        return None


def _yes(flag: bool) -> str:
    return "yes" if flag else "-"


def _space(card: Card, args: argparse.Namespace) -> SearchSpace:
    spec, real = model_spec(args.model)
    dtype = torch.bfloat16 if card.is_gpu else torch.float32
    shape = ModelKVShape(spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.num_heads, dtype)
    weights = spec.num_params * dtype.itemsize
    budget = int(BUDGET_FRACTION * max(card.memory_bytes - weights, 0))
    if not card.is_gpu:  # the tuner's CPU workers never take more (kvtune.engine.engine.default_budget_bytes)
        budget = min(budget, CPU_BUDGET_CAP_BYTES)
    workload = WorkloadStats(args.length, args.length, 99.0, args.concurrency)
    return SearchSpace.build(card, args.model, shape, workload, real, budget)


LIMITS: Limits = {"--length": (1, True), "--concurrency": (1, True)}


def run(args: argparse.Namespace) -> int:
    check_numbers(args, LIMITS)
    console = table_console()
    present = present_gpus()
    console.print(_card_table(present))
    console.print(f"GPUs present: {[name for name, _ in present] or 'none (cpu only)'}")
    if args.no_spaces:
        return 0
    cards = [resolve_gpu(args.space, present, "--space")] if args.space else [resolve_gpu(c) for c in CARDS]
    budget = (
        f"budget: {BUDGET_FRACTION:g} x (memory - weights), on a CPU at most "
        f"{CPU_BUDGET_CAP_BYTES / 2**30:g} GiB; the tuner measures the real one"
    )
    console.print(f"\nsearch spaces for {args.model}, {args.concurrency} x {args.length} tokens ({budget}):")
    for card in cards:
        try:
            console.print(_space(card, args).describe(), markup=False, highlight=False)
        except ValueError as e:
            console.print(str(e), markup=False, highlight=False)
    return 0
