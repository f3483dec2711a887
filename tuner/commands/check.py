"""``kvtune check CONFIG.json``: validate a hybrid_v2 config and print it resolved."""

from __future__ import annotations

import argparse

from kvtune.cache_impl.config import HybridConfig

NAME = "check"
HELP = "validate a hybrid_v2 config file and print it with every default resolved"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config", help="a JSON file: the hybrid_v2 object, or {'additional_config': {'kvtune': ...}}"
    )


def run(args: argparse.Namespace) -> int:
    config = HybridConfig.from_json_file(args.config)
    print(config.to_json())
    return 0
