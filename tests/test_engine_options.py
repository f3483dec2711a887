"""``max_num_seqs``: its default and its caps, decided by :func:`kvtune.engine.options.max_num_seqs_for`
alone."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvtune.cache_impl.config import HybridConfig
from kvtune.cache_impl.layout import ModelKVShape, kv_bytes_for
from kvtune.engine.options import MAX_NUM_SEQS_CAP, max_num_seqs_for

SHAPE = ModelKVShape(num_layers=2, num_kv_heads=2, head_dim=16, num_q_heads=4, dtype=torch.float16)
CONFIG = HybridConfig("hybrid_v2", 32, 64, 8)
LENGTH = 300  # prompt + output tokens of the workload's mean request
CAP = MAX_NUM_SEQS_CAP


def budget_holding(n: int) -> int:
    """A KV budget that holds exactly ``n`` sequences of ``LENGTH`` tokens at once."""
    return n * kv_bytes_for(CONFIG, SHAPE, [LENGTH])


@pytest.mark.parametrize(
    ("holds", "options", "expected"),
    [
        pytest.param(8, {}, (8, 8), id="derived: what the budget holds"),
        pytest.param(8, {"batched_tokens": 5}, (5, 8), id="at most max_num_batched_tokens"),
        pytest.param(8, {"requests": 3}, (3, 8), id="at most the requests"),
        pytest.param(8, {"requests": 0}, (1, 8), id="no request counts as one"),
        pytest.param(8, {"given": 20}, (20, 8), id="given: not what the budget holds"),
        pytest.param(8, {"given": 20, "requests": 6, "batched_tokens": 10}, (6, 8), id="given, capped"),
        pytest.param(8, {"factor": 0.5}, (4, 8), id="factor below 1"),
        pytest.param(8, {"factor": 2.0}, (16, 8), id="factor above 1"),
        pytest.param(1, {"factor": 0.4}, (1, 1), id="at least 1"),
        pytest.param(CAP + 500, {}, (CAP, CAP), id="derived at most the cap"),
        pytest.param(CAP - 1, {"factor": 2.0}, (CAP, CAP - 1), id="the cap after the factor"),
        pytest.param(CAP + 500, {"given": CAP + 7}, (CAP + 7, CAP), id="a given value above the cap"),
    ],
)
def test_max_num_seqs_default_and_caps(
    holds: int, options: dict[str, Any], expected: tuple[int, int]
) -> None:
    assert max_num_seqs_for(CONFIG, SHAPE, budget_holding(holds), LENGTH, **options) == expected
