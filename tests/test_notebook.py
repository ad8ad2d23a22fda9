"""``notebooks/quickstart.ipynb`` runs top to bottom in a real Jupyter kernel (on the testbed ``mini`` pair).

The notebook loads the default pair with ``VLMSpecPipeline.from_pretrained()``; the test points the default at the
CI-sized pair with ``VLMSPEC_DEFAULT_PAIR=testbed-mini`` (the README's demo uses the ``base`` pair).
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from vlmspec import testbed

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


def test_quickstart_notebook_executes(monkeypatch, tmp_path):
    testbed.pair_paths("mini", "qwen2_vl")  # built (or found) here, so the kernel only loads it
    monkeypatch.setenv("VLMSPEC_DEFAULT_PAIR", "testbed-mini")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = {
        i: cell.get("outputs", []) for i, cell in enumerate(notebook.cells) if cell.cell_type == "code"
    }
    assert not [o for cell in outputs.values() for o in cell if o.get("output_type") == "error"]
    text = "".join(
        o.get("text", "") for cell in outputs.values() for o in cell if o.get("output_type") == "stream"
    )
    assert "caption:" in text and "reference:" in text
    assert "identical to target.generate(): True" in text and "second half of the clip:" in text
    cached = [
        int(n)
        for n in re.findall(
            r"(\d+) of \d+ prompt tokens from the cache; identical to target.generate\(\): True", text
        )
    ]
    assert len(cached) == 2 and cached[0] == 0 and cached[1] > 0  # the second question reused the picture
    assert "identical to generate() with xgrammar's processor: True" in text and "{'shapes': " in text
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["policy", "tok/step"])
    rows = [line.split() for line in lines[header + 1 : header + 6]]
    assert [r[0] for r in rows] == ["ar", "chain", "eagle2", "pct", "sage"]
    assert all(r[-1] == "True" for r in rows)  # every policy's output equals ar's
    images = [o for cell in outputs.values() for o in cell if "image/png" in o.get("data", {})]
    assert len(images) >= 2  # the scene and the SAGE trace plot
