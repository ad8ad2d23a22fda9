"""Quantized targets and drafts: transformers' quantization configs, checked before anything loads.

A target quantized on load (``from_pretrained(...,
quantization_config=BitsAndBytesConfig(load_in_4bit=True))`` on a GPU, ``QuantoConfig(weights="int8")`` or
``TorchAoConfig(Int8WeightOnlyConfig())`` on a CPU too) or saved quantized (an AWQ, GPTQ, torchao checkpoint, whose ``config.json`` says so) decodes as any other: greedy
speculative output is the *quantized* target's own greedy ``generate()``, token for token, because the target's
verification forward is the only judge of what is accepted.
Quantizing the draft changes only how often its guesses are accepted, never the reply; the target's own
checkpoint, quantized, can draft for it (self-speculation: ``from_pretrained(target, target,
draft_quantization_config=...)``).

Why two options (``quantization_config`` for the target, ``draft_quantization_config`` for the draft) rather than
one for both, as vLLM keeps the draft's quantization apart from the target's (``speculative_config``): the target
is what must fit in memory, and a draft a tenth of its size is usually best left as it is (its forwards are the
cheap part, and a coarser draft accepts less); where the draft is quantized too, it may want another scheme.

Names for the command lines (``--quantization quanto-int8``; lmms-eval's ``quantization=bnb-4bit``), each one
config of transformers' (:data:`QUANTIZATION_NAMES`), named by method, as vLLM's ``--quantization`` is; any other
is given as the config's JSON (its ``to_dict()``, with ``quant_method``), which transformers reads as it reads a
checkpoint's. Each method's package is installed apart (``pip install 'vlmspec[quant]'`` brings optimum-quanto).
Installing torchao has a cost for every process, quantized or not: transformers imports it with its quantizers
whenever it is installed, at every model load.

A calibrated pair (:mod:`vlmspec.testbed.calibrate`) is inflated from dense weights, then quantized: written to a
temporary folder and loaded back with the config, the one way every method of transformers' takes.

A model quantized on load whose method transformers cannot save (quanto's) is refused by
:meth:`~vlmspec.VLMSpecPipeline.save_pretrained`: save the pipeline unquantized and quantize it where it loads
(``from_pretrained(folder, quantization_config=...)``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from .errors import InvalidInputError


def _quanto_int8() -> Any:
    from transformers import QuantoConfig

    return QuantoConfig(weights="int8")


def _torchao_int8() -> Any:
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    return TorchAoConfig(Int8WeightOnlyConfig())


def _bitsandbytes(bits: int) -> Callable[[], Any]:
    def config() -> Any:
        from transformers import BitsAndBytesConfig

        if bits == 8:
            return BitsAndBytesConfig(load_in_8bit=True)
        return BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True
        )

    return config


QUANTIZATION_NAMES: dict[str, tuple[Callable[[], Any], str]] = {
    "quanto-int8": (_quanto_int8, "optimum-quanto's int8 weights (CPU and GPU; needs optimum-quanto)"),
    "torchao-int8": (
        _torchao_int8,
        "torchao's int8 weight-only, per-row scales (CPU and GPU; needs torchao)",
    ),
    "bnb-8bit": (_bitsandbytes(8), "bitsandbytes' LLM.int8() (GPU; needs bitsandbytes)"),
    "bnb-4bit": (
        _bitsandbytes(4),
        "bitsandbytes' 4-bit NF4 with double quantization (GPU; needs bitsandbytes)",
    ),
}
"""The command lines' names for the usual quantization configs, with what each is."""


def means_none(value: Any) -> bool:
    """``None``, or a command line's or a config file's words for it (``none``, ``null``, empty)."""
    return value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", ""))


def resolve_quantization_config(value: Any, name: str = "quantization_config") -> Any:
    """``value`` as a config ``from_pretrained`` takes: a transformers ``QuantizationConfigMixin`` as it is, a
    name of :data:`QUANTIZATION_NAMES` built, a dict (or its JSON text) read by transformers'
    ``AutoQuantizationConfig.from_dict``; ``None`` (or ``"none"``, a command line's) is ``None``.

    Raises:
        InvalidInputError: naming ``name``, the value and what is taken (an unknown ``quant_method``, a method
            whose package is missing, a value of another type).
    """
    if means_none(value):
        return None  # nothing imported: the command lines check their flags before torch loads
    from transformers.utils.quantization_config import QuantizationConfigMixin

    if isinstance(value, QuantizationConfigMixin):
        return value
    if isinstance(value, str) and value in QUANTIZATION_NAMES:
        return _built(QUANTIZATION_NAMES[value][0], name, value)
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise InvalidInputError(f"{name}={value!r} is not valid JSON ({err.msg}); {_TAKEN}") from err
    if isinstance(value, Mapping) and "quant_method" in value:
        from transformers.quantizers.auto import AutoQuantizationConfig

        return _built(lambda: AutoQuantizationConfig.from_dict(dict(value)), name, value)
    raise InvalidInputError(f"{name}={value!r} is invalid; {_TAKEN}")


_TAKEN = (
    "give a transformers quantization config (BitsAndBytesConfig, TorchAoConfig, ...), its dict with "
    f"'quant_method' (or that dict's JSON text), or one of the names {', '.join(QUANTIZATION_NAMES)} ("
    + "; ".join(f"{key}: {what}" for key, (_, what) in QUANTIZATION_NAMES.items())
    + ")"
)


def _built(build: Callable[[], Any], name: str, given: Any) -> Any:
    """``build()``, its failure (a package missing, a method transformers does not know) named with ``name``."""
    try:
        return build()
    except ImportError as err:
        raise InvalidInputError(
            f"{name}={given!r} needs a package that is not installed ({err}); install it (optimum-quanto: pip "
            "install 'vlmspec[quant]'; torchao: pip install torchao; bitsandbytes: pip install bitsandbytes)"
        ) from err
    except (ValueError, KeyError, TypeError) as err:
        raise InvalidInputError(
            f"{name}={given!r} is not a quantization config transformers reads ({err})"
        ) from err


def check_usable(config: Any, name: str) -> None:
    """Refuse ``config`` (resolved) where transformers' own check of its method fails here (its package missing; a
    GPU where it needs one): run before any weights load, so that the draft's missing package is not found only
    once the target has loaded.

    Raises:
        InvalidInputError: naming ``name``, the method, what failed and how to install the packages.
    """
    if config is None:
        return
    import torch
    from transformers.quantizers.auto import AutoHfQuantizer

    try:
        AutoHfQuantizer.from_config(config).validate_environment(device_map=None, dtype=torch.float32)
    except (ImportError, RuntimeError, ValueError) as err:
        method = getattr(config.quant_method, "value", config.quant_method)
        raise InvalidInputError(
            f"{name} ({method}) cannot be used here: {err} (optimum-quanto: pip install 'vlmspec[quant]'; torchao: "
            "pip install torchao; bitsandbytes: pip install bitsandbytes)"
        ) from err


def quantization_description(model: Any) -> dict[str, Any] | None:
    """How ``model``'s weights are quantized (its config's ``quantization_config`` as a dict), ``None`` when they
    are not: the cost probe keys its readings by it, since a quantized model costs another time per forward."""
    found = getattr(model.config, "quantization_config", None)
    if found is None:
        return None
    as_dict = found.to_dict() if hasattr(found, "to_dict") else dict(found)
    return json.loads(json.dumps(as_dict, sort_keys=True, default=str))  # enums and classes as text


def check_savable(model: Any, role: str) -> None:
    """Refuse to save ``model`` where it was quantized on load by a method transformers cannot save (quanto's).

    Raises:
        InvalidInputError: naming the role, the method and what to do.
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and not quantizer.is_serializable():
        method = quantization_description(model) or {}
        option = "quantization_config" if role == "target" else "draft_quantization_config"
        raise InvalidInputError(
            f"the {role} model is quantized with {method.get('quant_method', '?')}, which transformers cannot save; "
            f"save the pipeline with the model unquantized, and quantize it where it loads "
            f"(VLMSpecPipeline.from_pretrained(folder, {option}=...))"
        )


def with_quantization(load: dict[str, Any], config: Any) -> dict[str, Any]:
    """``from_pretrained``'s keywords with ``config`` as its ``quantization_config`` (as they are without one)."""
    return load if config is None else {**load, "quantization_config": config}


def pair_quantization(target_config: Any, draft_config: Any, draft: Any, edd: bool) -> tuple[Any, Any]:
    """The target's and the draft's configs resolved (:func:`resolve_quantization_config`) and checked before any
    weights load: each usable here (:func:`check_usable`), the draft's only where a draft model loads (``draft``
    named, not an EDD draft: a layer read on top of the target's).

    Raises:
        InvalidInputError: naming the option and what to do.
    """
    configs = (
        resolve_quantization_config(target_config),
        resolve_quantization_config(draft_config, "draft_quantization_config"),
    )
    if configs[1] is not None and (draft is None or edd):
        what = "an EDD draft, a layer read on top of the target's," if edd else "no draft model"
        raise InvalidInputError(
            f"draft_quantization_config was given, but {what} loads here; leave it out (quantization_config "
            "quantizes the target)"
        )
    for config, name in zip(configs, ("quantization_config", "draft_quantization_config"), strict=True):
        check_usable(config, name)
    return configs


def in_memory(model: Any) -> Any:
    """``model`` with its CPU tensors copied out of the safetensors file they were loaded from (memory-mapped): a
    model loaded from a temporary folder would otherwise keep the deleted file's disk space for its life."""
    import torch

    for tensor in (*model.parameters(), *model.buffers()):
        if type(tensor.data) is torch.Tensor and tensor.device.type == "cpu":
            tensor.data = tensor.data.clone()
    return model
