"""Helpers for tests of the command line."""

from __future__ import annotations

import pytest


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    """The one line a refused command printed on stderr (``kvtune: error: ...``, no traceback)."""
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvtune: error: "), err
    assert "Traceback" not in err[0]
    return err[0]
