"""Runs of a job script forked from one interpreter that has imported the job's modules once (``JobForks``).

Starting Python and importing torch, transformers and vlmspec takes about 10 s of CPU on the CI machines; a test
that starts a job ten times spends most of its time there. ``JobForks`` starts one interpreter that runs a setup
once (the imports, and whatever the test patches in), then forks a child per run. Each child is a process of its
own that runs the script as ``__main__`` from its first line: signals, exit codes, files and output are those of a
process started as ``python script.py``, imports aside. Run as a script, this file is that interpreter: it reads a
request per line on stdin and answers with the child's pid, then its exit code (``-N``: killed by signal N).
"""

from __future__ import annotations

import json
import os
import runpy
import select
import subprocess
import sys
from pathlib import Path


class JobForks:
    """``with JobForks(setup, env) as forks: run = forks.start(argv, log); os.kill(run.pid, sig); run.wait()``."""

    def __init__(self, setup: str, env: dict[str, str]):
        self.server = subprocess.Popen(
            [sys.executable, __file__, setup],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def start(self, argv: list[str], log: Path, timeout: float) -> ForkedRun:
        """Fork a child running ``python argv[0] argv[1:]``, its stdout and stderr written to ``log``."""
        self.server.stdin.write(json.dumps({"argv": argv, "log": str(log)}) + "\n")
        self.server.stdin.flush()
        return ForkedRun(self, int(self._answer(timeout)["pid"]), log)

    def _answer(self, timeout: float) -> dict[str, int]:
        answer = self._answer_within(timeout)
        if answer is None:
            raise TimeoutError(
                f"the fork server gave no answer in {timeout} s (exit code {self.server.poll()})"
            )
        return answer

    def _answer_within(self, timeout: float) -> dict[str, int] | None:
        ready, _, _ = select.select([self.server.stdout], [], [], timeout)
        line = self.server.stdout.readline() if ready else ""
        return json.loads(line) if line else None

    def __enter__(self) -> JobForks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stdin.close()
        self.server.wait(timeout=60)


class ForkedRun:
    """One forked child: ``pid`` to signal, ``wait()`` for its exit code, ``log`` for what it printed."""

    def __init__(self, forks: JobForks, pid: int, log: Path):
        self.forks, self.pid, self.log = forks, pid, log
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code once the child has ended, else None (as ``Popen.poll``)."""
        if self.returncode is None and (answer := self.forks._answer_within(0)) is not None:
            self.returncode = int(answer["returncode"])
        return self.returncode

    def wait(self, timeout: float) -> int:
        if self.returncode is None:
            self.returncode = int(self.forks._answer(timeout)["returncode"])
        return self.returncode

    def output(self) -> str:
        """What the child printed (stdout and stderr)."""
        return self.log.read_text(errors="replace")


def _serve(setup: str) -> None:
    exec(setup, {"__name__": "__job_setup__"})
    for line in sys.stdin:
        request = json.loads(line)
        # The log exists before the child runs: a child killed before it is first scheduled (a test may signal it
        # as soon as its pid is known) still leaves one to read.
        os.close(os.open(str(request["log"]), os.O_WRONLY | os.O_CREAT | os.O_TRUNC))
        pid = os.fork()
        if pid == 0:
            _child(request)  # raises SystemExit, or another exception, in the child: its own process's end
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


def _child(request: dict[str, object]) -> None:
    log = os.open(str(request["log"]), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.argv = [str(arg) for arg in request["argv"]]
    runpy.run_path(sys.argv[0], run_name="__main__")
    raise SystemExit(0)


if __name__ == "__main__":
    _serve(sys.argv[1])
