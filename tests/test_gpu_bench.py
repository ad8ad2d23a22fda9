"""The GPU bench (``eval/gpu_bench.sh``) runs as it is, from the tree on ``PYTHONPATH``, here on the CPU at the tiny
``ci`` calibration, so it cannot rot between the sessions that have a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_bench_script_prints_the_table_and_the_cost_curve(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": ""}
    command = [
        "bash", str(ROOT / "eval" / "gpu_bench.sh"), "--pairs", "testbed-mini@ci,testbed-mini:llava_onevision@ci",
        "--n", "1", "--repeats", "1", "--max-new-tokens", "12", "--dtype", "float32", "--methods", "sage,hf_assisted",
        "--probe-sizes", "1,4", "--probe-runs", "1", "--threads", "1", "--quiet", "--out", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert out.count("# vlmspec bench") == 2
    assert "speed-up over transformers' generate() (hf_generate)" in out
    for method in ("ar", "hf_generate", "hf_assisted", "sage"):
        rows = [line for line in out.splitlines() if line.startswith(f"| {method} | image_caption |")]
        assert len(rows) == 2 and all("| yes |" in row for row in rows), (method, rows)
    assert "target roofline ms" in out and "GB/s" in out
    assert (tmp_path / "testbed-mini_ci" / "bench.md").is_file()
    assert (tmp_path / "testbed-mini_llava_onevision_ci" / "bench.json").is_file()


def test_gpu_bench_sections_run_with_the_script_s_own_defaults(tmp_path):
    """The script's defaults (bf16, two tasks, no plots, no pruning ablation) are not flags the sections refuse;
    a flag the user gives still is."""
    from vlmspec_eval import gpu_bench

    common = [
        "--pairs",
        "testbed-mini",
        "--n",
        "1",
        "--max-new-tokens",
        "4",
        "--dtype",
        "float32",
        "--threads",
        "1",
    ]
    argv = [*common, "--throughput", "1", "--throughput-policies", "chain", "--quiet", "--out", str(tmp_path)]
    assert gpu_bench.main(argv) == 0
    assert (tmp_path / "testbed-mini" / "throughput.md").is_file()
    assert gpu_bench.main([*common, "--conversation", "--repeats", "2", "--out", str(tmp_path / "x")]) == 1


def test_gpu_bench_serve_load_writes_the_conversation_table(tmp_path, capsys):
    from vlmspec_eval import gpu_bench

    argv = ["--pairs", "testbed-mini", "--n", "2", "--max-new-tokens", "4", "--dtype", "float32", "--serve-load",
            "--out", str(tmp_path)]  # fmt: skip
    assert gpu_bench.main(argv) == 0
    table = (tmp_path / "testbed-mini" / "serve_load.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| 8 |")]
    assert [row.split(" | ")[1] for row in rows] == ["0.00", "1.00"]  # prefix cache off, then on
    assert all(
        row.endswith("| 6/6 |") for row in rows
    )  # 2 conversations of 3 turns, each the pipeline's reply
    assert "| batch | prefix cache GiB |" in capsys.readouterr().out
