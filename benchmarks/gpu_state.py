"""What the GPU did while a benchmark ran: SM clock, power and throttle reasons sampled by ``nvidia-smi``.

    with GpuSampler() as gpu:
        run()
    gpu.summary()  # {"samples", "sm_mhz_min", "sm_mhz_median", "power_w_max", "temperature_c_max",
                   #  "throttle_reasons"}: {} without nvidia-smi

``nvidia-smi`` runs beside the block in a process of its own (``-lms``: one line every ``period_ms``), so
the sampling costs the measured process nothing. Used by ``engine_replay.py`` and ``probe_drift.py``: a
repeat that ran slower than the others can be told apart from a GPU that lowered its clock meanwhile.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
from types import TracebackType
from typing import Any

KEYS = ("clocks.sm", "power.draw", "temperature.gpu", "clocks_throttle_reasons.active")


class GpuSampler:
    """Samples GPU ``index`` every ``period_ms`` while the ``with`` block runs (not without nvidia-smi, nor
    when not ``enabled``)."""

    def __init__(self, index: int = 0, period_ms: int = 200, enabled: bool = True) -> None:
        self.index, self.period_ms, self.enabled = index, period_ms, enabled
        self._proc: subprocess.Popen[str] | None = None
        self.rows: list[tuple[float, float, float, str]] = []

    def __enter__(self) -> GpuSampler:
        if self.enabled and shutil.which("nvidia-smi") is not None:
            command = ["nvidia-smi", f"--query-gpu={','.join(KEYS)}", "--format=csv,noheader,nounits",
                       "-i", str(self.index), f"-lms={self.period_ms}"]  # fmt: skip
            self._proc = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
            )
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            out, _ = self._proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            out, _ = self._proc.communicate()
        self._proc = None
        for line in out.splitlines():
            cells = [c.strip() for c in line.split(",")]
            try:
                self.rows.append((float(cells[0]), float(cells[1]), float(cells[2]), cells[3]))
            except (ValueError, IndexError):  # "[N/A]" or a line cut by the termination
                continue

    def summary(self) -> dict[str, Any]:
        """The lowest and median SM clock, the highest power and temperature, the throttle reasons seen
        (nvidia-smi's bit masks other than 0x0); {} when nothing was sampled."""
        if not self.rows:
            return {}
        clocks = [r[0] for r in self.rows]
        return {
            "samples": len(self.rows),
            "sm_mhz_min": min(clocks),
            "sm_mhz_median": statistics.median(clocks),
            "power_w_max": max(r[1] for r in self.rows),
            "temperature_c_max": max(r[2] for r in self.rows),
            "throttle_reasons": sorted({r[3] for r in self.rows} - {"0x0000000000000000"}),
        }

    @staticmethod
    def describe(summary: dict[str, Any]) -> str:
        """One short text of a :meth:`summary` ("" when empty)."""
        if not summary:
            return ""
        throttle = ",".join(summary["throttle_reasons"]) or "none"
        return (
            f"SM {summary['sm_mhz_min']:.0f}-{summary['sm_mhz_median']:.0f} MHz, "
            f"≤ {summary['power_w_max']:.0f} W, throttle {throttle}"
        )
