"""The ``vlmspec`` model's registration with lmms-eval (entry point group ``lmms_eval.models``).

lmms-eval 0.7.3 finds plugin models only through its model registry (``lmms_eval.models.MODEL_REGISTRY_V2``),
which it fills from its built-in table, the deprecated ``LMMS_EVAL_PLUGINS`` variable and the entry points of
the group ``lmms_eval.models``; a class decorated with ``@register_model`` alone is not found by the CLI. This
package declares, in ``pyproject.toml``::

    [project.entry-points."lmms_eval.models"]
    vlmspec = "vlmspec_eval.lmms.manifest:MANIFEST"

The manifest names both classes: lmms-eval uses the chat class by default and the simple one with
``--force_simple``. Loading it imports nothing heavy (lmms-eval loads every entry point at start-up).
"""

from __future__ import annotations

from lmms_eval.models.registry_v2 import ModelManifest

__all__ = ["MANIFEST", "MODEL_ID"]

MODEL_ID = "vlmspec"

MANIFEST = ModelManifest(
    model_id=MODEL_ID,
    simple_class_path="vlmspec_eval.lmms.model.VLMSpec",
    chat_class_path="vlmspec_eval.lmms.model.VLMSpecChat",
)
