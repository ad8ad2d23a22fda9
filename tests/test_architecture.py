"""The house's import rules (docs: the README's layout section): the library never imports its evaluation or its
jobs; policies never reach models or caches. And the jobs ship with the wheel: a non-editable install runs them."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path, module: str) -> set[str]:
    """Absolute names of every module (and imported name) of ``path``, the module ``module``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = module.split(".")
            if node.level:  # relative: level 1 is the module's own package
                base = parts[: len(parts) - node.level]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            names.add(source)
            names.update(f"{source}.{alias.name}" for alias in node.names)
    return names


def test_policies_never_import_models_or_caches():
    forbidden = ("vlmspec.models", "vlmspec.cache", "vlmspec.probe", "vlmspec.pipeline")
    for path in sorted((ROOT / "vlmspec" / "policies").glob("*.py")):
        bad = {m for m in imported_modules(path, f"vlmspec.policies.{path.stem}") if m.startswith(forbidden)}
        assert not bad, f"{path.name} imports {sorted(bad)}: policies get costs and budgets as plain values"


def test_import_resolution_sees_relative_imports():
    names = imported_modules(ROOT / "vlmspec" / "policies" / "pct.py", "vlmspec.policies.pct")
    assert "vlmspec.costs" in names and "vlmspec.draft.DraftTree" in names


def test_the_library_never_imports_its_evaluation_or_its_jobs():
    forbidden = ("vlmspec_eval", "vlmspec_caption", "vlmspec_batch", "pipelines", "eval")
    for path in sorted((ROOT / "vlmspec").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        bad = {m for m in imported_modules(path, module) if m.split(".")[0] in forbidden}
        assert not bad, (
            f"{path.relative_to(ROOT)} imports {sorted(bad)}: subcommands come through entry points"
        )


@pytest.mark.slow
def test_a_wheel_installed_without_the_checkout_captions(tmp_path):
    """``pip install .`` (a wheel, not editable), then ``vlmspec caption`` from a folder outside the checkout. The
    wheel goes ``--no-deps`` into a target folder put in front of this environment's packages."""
    from vlmspec.testing import write_video

    wheels, site, source = tmp_path / "wheels", tmp_path / "site", tmp_path / "source"
    source.mkdir()
    for part in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / part, source / part)
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for part in (
        "vlmspec",
        "eval/vlmspec_eval",
        "pipelines/vlmspec_caption",
        "pipelines/vlmspec_batch",
    ):  # a copy: the checkout stays clean
        shutil.copytree(ROOT / part, source / part, ignore=skip)
    build = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        str(wheels),
    ]
    subprocess.run([*build, str(source)], check=True, capture_output=True, timeout=600)
    (wheel,) = wheels.glob("vlmspec-*.whl")
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)]
    subprocess.run(install, check=True, capture_output=True, timeout=600)
    videos, work = tmp_path / "videos", tmp_path / "elsewhere"
    videos.mkdir()
    work.mkdir()
    from vlmspec import testbed

    write_video(videos / "a.mp4", testbed.sample("video_caption", 1).video)
    env = {**os.environ, "PYTHONPATH": str(site)}
    # the caption command, then where the modules it ran came from (one interpreter start, ~10 s of imports)
    command = (
        "import sys; from vlmspec.cli import main; code = main(); "
        "import vlmspec, vlmspec_caption, vlmspec_batch; "
        "print(vlmspec.__file__, vlmspec_caption.__file__, vlmspec_batch.__file__); sys.exit(code)"
    )
    argv = ["caption", str(videos), "--out", "x.jsonl", "--target", "testbed-mini", "--max-new-tokens", "8",
            "--num-frames", "4", "--threads", "1", "--no-progress"]  # fmt: skip
    run = subprocess.run(
        [sys.executable, "-c", command, *argv], cwd=work, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr
    where = run.stdout.splitlines()[-1].split()
    assert len(where) == 3 and all(path.startswith(str(site)) for path in where), run.stdout  # the wheel's
    assert '"caption": ' in (work / "x.jsonl").read_text()


_NO_MODELS_PROBE = """
import sys
from vlmspec.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exit:  # a parser's refusal
    code = exit.code
heavy = sorted(name for name in ("torch", "transformers") if name in sys.modules)
print("imported:", ",".join(heavy) or "-")
sys.exit(code)
"""


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--n", "x"],  # every subcommand's parser built, one refuses a value
        ["caption", "missing-folder", "--out", "x.jsonl"],
        ["demo", "--image", "missing.png"],
    ],
)
def test_the_command_line_refuses_bad_input_before_it_imports_the_models(tmp_path, argv):
    """``vlmspec --help`` and a bad option or a missing input answer at once: the command line (and every entry-point
    subcommand's parser) imports neither torch nor transformers until a command runs (~10 s here)."""
    done = subprocess.run(
        [sys.executable, "-c", _NO_MODELS_PROBE, *argv],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert f"vlmspec {argv[0]}: error:" in done.stderr
    assert done.stdout.splitlines()[-1] == "imported: -", done.stdout
