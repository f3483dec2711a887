"""One module per ``kvtune`` command: ``NAME``, ``HELP``, ``add_arguments(parser)``, ``run(args) -> int``."""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping

# flag -> (the lowest value allowed, whether that value itself is allowed); the value is argparse's attribute
# for the flag (``--length-cap`` -> ``length_cap``)
Limits = Mapping[str, tuple[float, bool]]


def check_numbers(args: argparse.Namespace, limits: Limits) -> None:
    """One line naming the flag, for the first numeric option out of its range (unset options pass), so a bad
    value fails before anything loads or runs."""
    for flag, (low, inclusive) in limits.items():
        value = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if value is None:
            continue
        if not math.isfinite(value) or value < low or (value == low and not inclusive):
            raise ValueError(f"{flag} {value:g}: must be {'>=' if inclusive else '>'} {low:g}")
