"""The SAGE sweep behind docs/sage.md runs (on the tiny `ci` calibration, so it cannot rot)."""

from __future__ import annotations

from vlmspec_eval.sage_sweep import VARIANTS, main


def test_sage_sweep_prints_every_variant_identical(capsys) -> None:
    assert main(["--pair", "testbed-mini@ci", "--n", "1", "--max-new-tokens", "12", "--threads", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "x |" in line]
    assert [row.split(" | ")[0][2:] for row in rows] == list(VARIANTS)
    assert all(row.endswith("| True |") for row in rows)
