"""lmms-eval's command line, for runs of the plugin's own tasks alone (``--include_path``): ``python -m
lmms_own_tasks ...`` is ``python -m lmms_eval ...`` that does not index lmms-eval's ~2,000 shipped tasks first (~9 s of
every start on a 2-core CPU), which such a run never reads. The README's block of shipped tasks runs lmms-eval
itself (``test_lmms_eval.py``)."""

from typing import Any

from lmms_eval.__main__ import cli_evaluate
from lmms_eval.tasks import TaskManager

_index_tasks = TaskManager.__init__


def _own_tasks_only(self: TaskManager, *args: Any, include_defaults: bool = False, **kwargs: Any) -> None:
    _index_tasks(self, *args, include_defaults=include_defaults, **kwargs)


if __name__ == "__main__":
    TaskManager.__init__ = _own_tasks_only
    cli_evaluate()
