"""``kvtune export --study NAME [--out FILE]``: write a study's preset again from the database."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvtune.studies.names import DEFAULT_STORAGE
from kvtune.tuner.export import (
    PRESETS_DIR,
    describe_rate,
    export_from_study,
    interval_text,
    load_study,
    search_rate,
)

NAME = "export"
HELP = "write a finished study's preset (config, validated metrics, vLLM section) from the database"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--study", required=True, help="the study's name")
    parser.add_argument(
        "--storage", default=DEFAULT_STORAGE, help=f"study database URL (default {DEFAULT_STORAGE})"
    )
    parser.add_argument(
        "--out", help=f"output file (default {PRESETS_DIR}/<card>/<model>-<workload>.json); kept if it exists"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing file instead of adding -2, -3..."
    )


def run(args: argparse.Namespace) -> int:
    path = export_from_study(args.storage, args.study, out=args.out, overwrite=args.overwrite)
    print(f"kvtune: wrote {path}")
    rate = search_rate(load_study(args.storage, args.study).get_trials(deepcopy=False))
    if rate is not None:
        print(f"  search: {describe_rate(rate)}")
    preset = json.loads(Path(path).read_text())
    gain = preset["metrics"]["gain"]
    if gain.get("ratio") is not None:
        bounds = interval_text(gain, ".3f")
        print(f"  {gain['metric']}: {gain['ratio']:.3f}x against the unquantized baseline ({bounds}; > 1 is "
              f"better): {gain['verdict']}")  # fmt: skip
    if preset.get("engine") and "--max-num-seqs" not in preset["vllm"]["args"]:
        print(f"  {preset['vllm']['engine']}")
    for problem in preset["metrics"].get("inconclusive") or []:
        print(f"  inconclusive: {problem}")
    if "recommendation" in preset:
        print(f"  recommended: {preset['recommendation']['why']}")
    print(serve_lines(preset["vllm"]))
    return 0


def serve_lines(vllm: dict[str, Any]) -> str:
    """The preset's ``vllm serve`` command and what kvtune's plugin does with it."""
    plugin = vllm["plugin"]
    verdict = (
        "served by kvtune's vLLM plugin" if plugin["serves"] else f"not served by the plugin: {plugin['why']}"
    )
    return f"  vLLM ({plugin['tested_on']}; {verdict}):\n    {vllm['command']}"
