"""lmms-eval's command line, for runs of the plugin's own tasks alone (``--include_path``): ``python -m
lmms_own_tasks ...`` is ``python -m lmms_eval ...`` that does not index lmms-eval's ~2,000 shipped tasks first (~9 s of
every start on a 2-core CPU), which such a run never reads. The README's block of shipped tasks runs lmms-eval
itself (``test_lmms_eval.py``)."""

from lmms_eval.__main__ import cli_evaluate
from lmms_eval.tasks import TaskManager

if __name__ == "__main__":
    # TaskManager(verbosity, include_path, include_defaults, model_name): the shipped tasks left out by default
    TaskManager.__init__.__defaults__ = ("INFO", None, False, None)
    cli_evaluate()
