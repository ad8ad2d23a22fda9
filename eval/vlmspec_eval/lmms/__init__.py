"""lmms-eval integration: the ``vlmspec`` model (any image/video benchmark, with speed metrics) and local tasks.

* :mod:`.manifest`: the entry-point registration (``--model vlmspec``).
* :mod:`.model`: the model classes (chat and simple request paths, ``loglikelihood``, speed files).
* :mod:`.options`: ``--model_args`` and pair configs (``configs/models/*.yaml``).
* :mod:`.media`, :mod:`.generation`: requests' visuals/messages and generation kwargs as pipeline arguments.
* :mod:`.speed`: per-task tau, tokens/s, speed-up; ``vlmspec_speed_<task>.json`` and the summary.
* :mod:`.text_metrics`: exact match, token F1 and ROUGE-L, implemented locally (no downloads).
* :mod:`.make_tasks`: ``python -m vlmspec_eval.lmms.make_tasks --out eval/tasks/data --n 20``.
* :mod:`.standins`: stand-in data for lmms-eval's own ``mme``, ``videomme`` and ``seedbench_ppl`` (offline runs).

Nothing here is imported by ``import vlmspec_eval.lmms`` itself: the submodules import lmms-eval and torch.
"""
