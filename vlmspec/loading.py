"""Loading a target/draft pair: named pairs resolved, every folder and the target's processor checked before any
weights load, EDD drafts, calibration, and the compatibility check."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
)

from .errors import InputNotFoundError, InvalidInputError
from .models import ASSISTANT_TYPES, TEXT_DRAFT_TYPES, EDDDraft, adapter_for, check_model_type
from .models.edd import is_edd_folder
from .models.gemma4_assistant import check_assistant, check_assistant_family
from .named_pairs import is_local_path, is_pipeline_folder, resolve_pair
from .quantization import in_memory, pair_quantization, with_quantization

MODEL_OPTIONS = (
    "attn_implementation",
    "dtype",
    "chat_template",
    "quantization_config",
    "draft_quantization_config",
)
"""Model-loading keywords :meth:`vlmspec.VLMSpecPipeline.from_pretrained` takes among its ``**policy_options``:
passed to both models' ``from_pretrained`` (``dtype`` is transformers 5's name for ``torch_dtype``),
``chat_template``, a template (its text) the target's processor takes instead of its own (vLLM's
``--chat-template``; a checkpoint without one needs it), and the target's and the draft's quantization
(:mod:`vlmspec.quantization`)."""
LOADING_KEYWORDS = (
    "device",
    "low_cpu_mem_usage",
    "load_in_8bit",
    "load_in_4bit",
    "max_memory",
    "offload_folder",
    "revision",
    "cache_dir",
    "token",
    "local_files_only",
    "force_download",
    "variant",
    "subfolder",
    "use_safetensors",
    "config",
    "tp_plan",
)
"""Other ``from_pretrained`` keywords: refused by name (as policy options they would be refused as unknown ones)."""


def model_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``from_pretrained``'s ``**policy_options`` split into the model-loading keywords it takes
    (:data:`MODEL_OPTIONS`, for :func:`load_pair`) and the policy's options.

    Raises:
        InvalidInputError: another model-loading keyword (:data:`LOADING_KEYWORDS`), named with what to use.
    """
    for name in options:
        if name in LOADING_KEYWORDS:
            place = (
                ": place them with device_map (device_map='cpu', device_map={'': 'cuda:1'}; without it they go to "
                "the GPU when there is one)"
                if name == "device"
                else ""
            )
            if name.startswith("load_in_"):
                bits = name.removeprefix("load_in_")
                place = (
                    f": quantize the target with quantization_config=BitsAndBytesConfig({name}=True) "
                    f"(or 'bnb-{bits}')"
                )
            raise InvalidInputError(
                f"{name!r} is an argument of the models' from_pretrained, not a policy option; "
                "VLMSpecPipeline.from_pretrained passes torch_dtype (or dtype), device_map, attn_implementation and "
                f"trust_remote_code to the models{place}; for other loading settings, load the models yourself with "
                "transformers and build VLMSpecPipeline(target, draft, processor)"
            )
    loading = {name: options[name] for name in MODEL_OPTIONS if name in options}
    return loading, {name: value for name, value in options.items() if name not in MODEL_OPTIONS}


def load_pair(
    target: str | Path | None,
    draft: str | Path | None,
    torch_dtype: str | torch.dtype | None = "auto",
    device_map: str | dict[str, Any] | None = None,
    trust_remote_code: bool = False,
    calibration: str | None = None,
    attn_implementation: str | None = None,
    dtype: str | torch.dtype | None = None,
    chat_template: str | None = None,
    quantization_config: Any = None,
    draft_quantization_config: Any = None,
) -> tuple[torch.nn.Module, torch.nn.Module | None, Any]:
    """The target, the draft (``None`` when none is named) and the target's processor, loaded as
    :meth:`vlmspec.VLMSpecPipeline.from_pretrained` documents: named pairs resolved, an EDD draft read on top of its
    target, a calibrated pair inflated where it will run, the draft checked against the target, both moved to the
    GPU when one is present (without ``device_map``).

    Both folders (or hub ids) and the target's processor are checked before any weights load, so that a mistyped
    draft is reported before a large target has loaded. Weights load from safetensors only (no pickle).
    ``quantization_config`` / ``draft_quantization_config`` quantize the target / the draft as they load
    (:func:`vlmspec.quantization.resolve_quantization_config` takes).
    """
    torch_dtype = _dtype_alias(torch_dtype, dtype)
    check_dtype(torch_dtype)  # before anything loads or builds
    check_device_map(device_map)
    check_attn_implementation(attn_implementation)
    pair = resolve_pair(target, draft)
    target, draft = pair.target, pair.draft
    if calibration is not None and pair.calibration is not None and calibration != pair.calibration:
        raise InvalidInputError(
            f"calibration={calibration!r} contradicts the pair name's '@{pair.calibration}'; give one of them"
        )
    calibration = pair.calibration if calibration is None else calibration
    edd = draft is not None and is_edd_folder(draft)
    quantization = pair_quantization(quantization_config, draft_quantization_config, draft, edd)
    target_type = check_source(target, "target", trust_remote_code)
    text_draft = False
    if draft is not None and not edd:
        draft_type = check_source(draft, "draft", trust_remote_code)
        text_draft = draft_type in (*TEXT_DRAFT_TYPES, *ASSISTANT_TYPES)  # loaded as causal language models
        if draft_type in ASSISTANT_TYPES:
            check_assistant_family(draft_type, target_type)
        elif not text_draft:
            check_series(target_type, draft_type)
    processor = load_processor(target, trust_remote_code, chat_template)
    draft_tokenizer = _load_tokenizer(draft, trust_remote_code) if draft is not None and not edd else None
    load = dict(
        dtype=torch_dtype, device_map=device_map, trust_remote_code=trust_remote_code, use_safetensors=True
    )
    if attn_implementation is not None:
        load["attn_implementation"] = attn_implementation
    on_load = quantization if calibration is None else (None, None)  # a calibration inflates dense weights
    target_model = _load_model(target, "target", with_quantization(load, on_load[0]))
    if draft is not None and not edd:
        draft_model = _load_model(draft, "draft", with_quantization(load, on_load[1]), text_draft)
    else:
        draft_model = None
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    base_target = target_model
    if calibration is not None:
        from .testbed.calibrate import calibrate

        # inflated where the models run (a 7B target built on the GPU), or on the CPU when it is then quantized
        where = device if device_map is None else target_model.device
        where = torch.device("cpu") if quantization[0] is not None else where
        target_model, draft_model = calibrate(target_model, draft_model, calibration, device=where)
        load = {**load, "device_map": device_map if device_map is not None else {"": str(device)}}
        target_model = _quantized_copy(target_model, "target", load, quantization[0])
        draft_model = _quantized_copy(draft_model, "draft", load, quantization[1])
    if edd:  # an EDD draft: trained for this target, read on top of it
        draft_model = _edd_draft(draft, base_target, target_model)
    if draft_model is not None and not edd:
        target_tokenizer = getattr(processor, "tokenizer", None)
        check_compatible(target_model, draft_model, target_tokenizer, draft_tokenizer)
    if device_map is None:
        for model in (target_model, draft_model):
            if model is not None and next(model.parameters()).device.type != device.type:
                model.to(device)  # not where transformers put it already (bitsandbytes' models refuse .to())
    return target_model, draft_model, processor


def _quantized_copy(model: torch.nn.Module | None, role: str, load: dict[str, Any], config: Any) -> Any:
    """``model`` (inflated in memory by a calibration) quantized by ``config`` the one way every method of
    transformers' takes: written to a temporary folder (``$TMPDIR``; the dense model's size, for the time of the
    load) and loaded back with it, where ``load``'s ``device_map`` places it (transformers quantizes weights as they
    load only). ``model`` itself without a config."""
    if model is None or config is None:
        return model
    with tempfile.TemporaryDirectory(prefix="vlmspec-quantize-") as folder:
        model.save_pretrained(folder)
        quantized = in_memory(_load_model(folder, role, with_quantization(load, config)))
    quantized.name_or_path = quantized.config._name_or_path = model.name_or_path
    return quantized


def _dtype_alias(torch_dtype: Any, dtype: Any) -> Any:
    """``torch_dtype``, or ``dtype`` (transformers 5's name for it) when that is given instead.

    Raises:
        InvalidInputError: both are given (``torch_dtype`` other than its default ``"auto"``).
    """
    if dtype is None:
        return torch_dtype
    if torch_dtype != "auto":
        raise InvalidInputError(
            f"torch_dtype={torch_dtype!r} and dtype={dtype!r} were both given; dtype is transformers 5's name for "
            "torch_dtype: give one of them"
        )
    return dtype


def check_attn_implementation(attn_implementation: Any) -> None:
    """Refuse an ``attn_implementation`` that cannot take a tree mask before the load (as :func:`check_attention`
    refuses a loaded model's), so that FlashAttention is named as the problem, not a missing package.

    Raises:
        InvalidInputError: naming the value and what to use.
    """
    if attn_implementation is None:
        return
    if not isinstance(attn_implementation, str) or "flash" in attn_implementation:
        raise InvalidInputError(
            f"attn_implementation={attn_implementation!r} is invalid: speculative verification attends through a "
            "tree attention mask, which FlashAttention cannot take; use 'sdpa' (transformers' default) or 'eager'"
        )


def _edd_draft(folder: str | Path, base: torch.nn.Module, target: torch.nn.Module) -> EDDDraft:
    """The EDD draft at ``folder`` for ``target``: trained for it (an EDD trained on a calibrated target), or for
    the ``base`` target a calibration inflated into ``target`` (the shipped EDD drafts), then inflated with it.

    Raises:
        ValueError: the draft was trained for neither (the error of the base target's check).
    """
    try:
        return EDDDraft.from_pretrained(folder, target)
    except InvalidInputError:
        if target is base:  # not calibrated: nothing else to try
            raise
        from .testbed.calibrate import inflate_edd

        return inflate_edd(EDDDraft.from_pretrained(folder, base), base, target)


def check_dtype(torch_dtype: Any) -> None:
    """Refuse a ``torch_dtype`` that ``from_pretrained`` cannot take: it takes ``"auto"``, ``None`` (torch's
    default), a floating-point ``torch.dtype``, its name (``"bfloat16"``) or a dict of them per sub-config. An
    integer or bool dtype (``"int8"``) is refused here: transformers would fail in the middle of the load, and
    quantized weights are not a dtype (``quantization_config`` quantizes them: :mod:`vlmspec.quantization`).

    Raises:
        ValueError: naming the value and what is taken.
    """
    values = torch_dtype.values() if isinstance(torch_dtype, dict) else (torch_dtype,)
    for value in values:
        dtype = getattr(torch, value, None) if isinstance(value, str) and value != "auto" else value
        if value is None or value == "auto" or (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            continue
        why = f"{dtype} is not a floating-point dtype; " if isinstance(dtype, torch.dtype) else ""
        raise InvalidInputError(
            f"torch_dtype={torch_dtype!r} is invalid: {why}use 'auto' (the checkpoint's dtype), a floating-point "
            "torch dtype (torch.float32, torch.bfloat16) or its name ('float32', 'bfloat16', 'float16')"
        )


def check_device_map(device_map: Any) -> None:
    """Refuse a ``device_map`` that names a CUDA device on a machine without one (transformers would fail deep in
    the load with "Found no NVIDIA driver").

    Raises:
        ValueError: naming the value and what to do.
    """
    values = device_map.values() if isinstance(device_map, dict) else (device_map,)
    wants_cuda = any(
        isinstance(v, int) or (isinstance(v, (str, torch.device)) and str(v).startswith("cuda"))
        for v in values
    )
    if wants_cuda and not torch.cuda.is_available():
        raise InvalidInputError(
            f"device_map={device_map!r} names a CUDA device, but torch sees no GPU here; leave device_map out (the "
            "GPU when there is one, else the CPU) or use 'cpu'"
        )


def check_attention(model: torch.nn.Module, role: str) -> None:
    """Refuse a model whose attention cannot take a tree mask: verification attends through a 4-D additive mask
    (each node sees its ancestors), which FlashAttention's kernels do not take (they take causal or padding masks).

    Raises:
        InvalidInputError: naming the model, its attention implementation and what to load instead.
    """
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None else None
    implementation = str(getattr(text, "_attn_implementation", None) or "")
    if "flash" in implementation:
        raise InvalidInputError(
            f"the {role} model uses attn_implementation={implementation!r}, which cannot take the tree attention "
            "mask speculative verification needs; load it with attn_implementation='sdpa' (or 'eager')"
        )


SERIES = {"qwen3_vl_moe": "qwen3_vl", "qwen3_5_moe": "qwen3_5", "glm4v_moe": "glm4v", "glm46v": "glm4v",
          "deepseek_vl_hybrid": "deepseek_vl"}  # fmt: skip
"""Model types that draft for each other though they differ: Qwen3-VL's and Qwen3.5's mixture-of-experts language
models have the dense ones' tokenizers, vision towers and processors (Qwen3-VL-2B drafts for Qwen3-VL-30B-A3B,
Qwen3.5-2B for Qwen3.5-35B-A3B); GLM-4.5V (``glm4v_moe``) and GLM-4.6V (``glm46v``) are GLM-4.1V's design
(``glm4v``: its processor, placeholders and tower layout) around a larger language model, so a 9B GLM-4.1V or
GLM-4.6V-Flash drafts for either; DeepSeek-VL 1.3B drafts for 7B, whose hybrid tower reads its pictures and more
(:mod:`vlmspec.models.janus`; not the other way round). The tokenizer and the visual-token layout of what the draft
reads are still checked (:func:`check_compatible`, :func:`check_visual_layout`)."""


def check_compatible(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    target_tokenizer: Any = None,
    draft_tokenizer: Any = None,
) -> None:
    """Refuse a draft that cannot draft for ``target``: another family, another vocabulary or another visual-token
    layout (:func:`check_visual_layout`). A language model (:data:`~vlmspec.models.TEXT_DRAFT_TYPES`) reads no
    pictures: only its vocabulary and tokenizer are checked, without the target's visual placeholders and without
    the special tokens the VLM's tokenizer added past the language model's table (LLaVA-1.5's ``<pad>`` after
    Vicuna's 32000, SmolVLM's tile markup after SmolLM2's 49152): the draft is fed a stand-in for those and never
    proposes them (:class:`vlmspec.draft.DraftVocab`), so the reply stays the target's.

    Embedding tables may differ in size: checkpoints of one series pad their vocabularies differently (Qwen2-VL-7B
    has 152064 rows, Qwen2-VL-2B 151936, with the same tokenizer). What must hold is that both share the tokenizer
    (compared when both are known) and that both tables cover every token of the target's tokenizer; the ids only
    one table holds are handled while decoding (:class:`vlmspec.draft.DraftVocab`).

    Raises:
        ValueError: naming what differs and what to do.
    """
    if draft.config.model_type in ASSISTANT_TYPES:
        # it reads the target's embeddings: only its head's ids matter
        check_assistant(draft, target)
        _check_vocabulary(target, draft, target_tokenizer, draft_tokenizer)
        return
    if draft.config.model_type in TEXT_DRAFT_TYPES:
        rows = draft.get_input_embeddings().weight.shape[0]
        added = getattr(target_tokenizer, "added_tokens_decoder", {})
        unread = frozenset(adapter_for(target).visual_token_ids()) | {i for i in added if i >= rows}
        _check_vocabulary(target, draft, target_tokenizer, draft_tokenizer, unread)
        return
    check_series(target.config.model_type, draft.config.model_type)
    _check_vocabulary(target, draft, target_tokenizer, draft_tokenizer)
    for key in ("image_token_id", "video_token_id"):
        t_id, d_id = getattr(target.config, key, None), getattr(draft.config, key, None)
        if t_id != d_id:
            raise InvalidInputError(
                f"the draft's {key} is {d_id} but the target's is {t_id}; they must share a tokenizer"
            )
    check_visual_layout(target, draft)


def _check_vocabulary(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    target_tokenizer: Any,
    draft_tokenizer: Any,
    unread: frozenset[int] = frozenset(),
) -> None:
    """Refuse a draft whose table does not cover the target's tokenizer, or whose tokenizer differs from the
    target's; ``unread``: ids the draft never reads (a language model's: the target's visual placeholders, which
    its table and tokenizer need not hold, as ``gemma-3-1b``'s table holds no ``<image_soft_token>``, and the special
    tokens the target's tokenizer added past the draft's table)."""
    t_rows = target.get_input_embeddings().weight.shape[0]
    d_rows = draft.get_input_embeddings().weight.shape[0]
    tokens = len(target_tokenizer) if target_tokenizer is not None else t_rows
    while tokens - 1 in unread:
        tokens -= 1
    if d_rows < tokens:
        raise InvalidInputError(
            f"the draft's vocabulary has {d_rows} entries but the target's tokenizer has {tokens} tokens; the draft "
            "must share the target's tokenizer"
        )
    if target_tokenizer is None or draft_tokenizer is None:
        return
    vocabularies = [
        {token: i for token, i in tokenizer.get_vocab().items() if i not in unread}
        for tokenizer in (target_tokenizer, draft_tokenizer)
    ]
    if vocabularies[0] != vocabularies[1]:
        raise InvalidInputError(
            "the draft's tokenizer differs from the target's (different vocabulary); use a draft that shares "
            "the target's tokenizer"
        )


def check_series(target_type: str, draft_type: str) -> None:
    """Refuse a draft whose ``model_type`` is of another family than the target's (:data:`SERIES` pairs the types
    that draft for each other though they differ).

    Raises:
        InvalidInputError: naming both types and what to use instead.
    """
    if SERIES.get(target_type, target_type) != SERIES.get(draft_type, draft_type):
        raise InvalidInputError(
            f"the draft model is a {draft_type!r} model but the target is {target_type!r}; vlmspec needs a draft of "
            "the same family (same tokenizer and visual token layout), e.g. a smaller checkpoint of the same series"
        )


def check_visual_layout(target: torch.nn.Module, draft: torch.nn.Module) -> None:
    """Refuse a draft whose vision settings turn a picture into other visual tokens than the target's: the draft
    reads the target's processor outputs (pixels, grids, placeholders), so its tower would fail mid-decode. Only
    the fields that decide the layout of what the draft reads (its family adapter's ``layout_fields``) are compared:
    a smaller vision tower (depth, width) is a legitimate draft.

    Raises:
        InvalidInputError: naming the field, both values and what to do.
    """
    for field in type(adapter_for(draft)).layout_fields:
        t_value, d_value = _config_value(target.config, field), _config_value(draft.config, field)
        if t_value != d_value:
            raise InvalidInputError(
                f"the draft's {field} is {d_value!r} but the target's is {t_value!r}: the draft reads the target's "
                "processor outputs, so it must turn a picture or video into the same visual tokens (its vision "
                "tower may be smaller, but this setting must match); use a draft of the target's series, or train "
                f"one with the target's {field}"
            )


def _config_value(config: Any, field: str) -> Any:
    """``config``'s value at a dotted path (``vision_config.patch_size``), tuples as lists (a config built in
    code and one read from JSON compare equal); ``None`` where it has none."""
    for name in field.split("."):  # a dict on the way (timm's model_args) is read by key
        config = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
    return _listed(config)


def _listed(value: Any) -> Any:
    """``value`` with its tuples as lists, nested (a config's values as JSON would give them)."""
    return [_listed(item) for item in value] if isinstance(value, (list, tuple)) else value


def check_source(source: str | Path, role: str, trust_remote_code: bool = False) -> str:
    """Check where a model comes from before any weights load: a local folder (:func:`check_model_folder`), or a
    hub id whose config is fetched (a missing id or no network is reported now, naming the role and the id); then
    that its config's ``model_type`` is one vlmspec takes.

    Returns:
        The config's ``model_type``.

    Raises:
        FileNotFoundError, ValueError: as :func:`check_model_folder`; the hub's failure, wrapped; a model type no
            adapter takes (:func:`vlmspec.models.check_model_type`).
    """
    if is_local_path(source):
        check_model_folder(source, role)
        model_type = _folder_model_type(Path(source).expanduser(), role)
    else:
        try:
            model_type = AutoConfig.from_pretrained(
                str(source), trust_remote_code=trust_remote_code
            ).model_type
        except OSError as err:
            raise _hub_error(source, role, err) from err
    check_model_type(model_type, f"the {role} model {str(source)!r}", draft=role == "draft")
    return model_type


def _folder_model_type(path: Path, role: str) -> str | None:
    """The ``model_type`` the folder's ``config.json`` names (``None`` when it names none)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InvalidInputError(
            f"{role} model folder {str(path)!r}: config.json is not valid JSON ({err}); write it again with "
            "save_pretrained, or copy the checkpoint's own"
        ) from None
    return config.get("model_type") if isinstance(config, dict) else None


def check_model_folder(source: str | Path, role: str) -> None:
    """Refuse a local model path (:func:`~vlmspec.named_pairs.is_local_path`) that is not a folder holding a ``config.json`` and safetensors
    weights; hub ids are left to the hub. Callers that check other things first (a policy that needs a draft)
    call it before them, so a mistyped folder is named as what it is.

    Raises:
        FileNotFoundError: the folder does not exist or holds no config.json (naming it, its role and what to do).
        ValueError: it is a file, a saved pipeline given as the draft, or holds pickle weights only.
    """
    if not is_local_path(source):
        return
    path, name = Path(source).expanduser(), str(source)
    if path.is_file():
        raise InvalidInputError(
            f"{role} model folder {name!r} is a file, not a folder; give the folder that holds the checkpoint "
            f"(config.json, model.safetensors, ...), here {str(path.absolute().parent)!r}"
        )
    if not path.is_dir():
        raise InputNotFoundError(f"{role} model folder {name!r} does not exist")
    if role == "draft" and is_pipeline_folder(path):
        raise InvalidInputError(
            f"draft model folder {name!r} is a saved pipeline folder (written by pipe.save_pretrained), not a model "
            "folder; pass it as the target (VLMSpecPipeline.from_pretrained(folder)) to load its pair, or give its "
            "draft/ subfolder as the draft"
        )
    if not (path / "config.json").is_file():
        raise InputNotFoundError(
            f"{role} model folder {name!r} has no config.json; point to a folder written by save_pretrained"
        )
    if not any(path.glob("*.safetensors")) and any(path.glob("*.bin")):
        raise InvalidInputError(
            f"{role} model folder {name!r} holds its weights only as pickle files (pytorch_model.bin), which vlmspec "
            "does not load (unpickling a file can run code); if you trust it, convert it once: load it with "
            "AutoModelForImageTextToText.from_pretrained(folder) and save it with .save_pretrained(folder), which "
            "writes model.safetensors"
        )
    if not any(path.glob("*.safetensors")):
        raise InputNotFoundError(
            f"{role} model folder {name!r} holds no weights (no *.safetensors file); point to a folder written by "
            "save_pretrained"
        )


def load_processor(
    source: str | Path, trust_remote_code: bool = False, chat_template: str | None = None
) -> Any:
    """The target's processor, with the chat template every prompt is built with: ``chat_template`` when given, else
    the processor's own, else its tokenizer's (a template kept only in ``tokenizer_config.json``, as a processor's own
    fallback would use).

    Raises:
        FileNotFoundError: the folder holds no processor transformers can load; the hub's failure, wrapped.
        InvalidInputError: neither has a chat template (naming the folder and what to add).
    """
    try:
        processor = AutoProcessor.from_pretrained(str(source), trust_remote_code=trust_remote_code)
    except OSError as err:
        if not is_local_path(source):
            raise _hub_error(source, "target", err) from err
        raise InputNotFoundError(
            f"target model folder {str(source)!r} holds no processor transformers can load ({_reason(err)}); copy "
            "the checkpoint's processor files into it (processor_config.json or preprocessor_config.json, the "
            "tokenizer files, chat_template.jinja), e.g. with AutoProcessor.from_pretrained(original).save_pretrained"
        ) from err
    if chat_template is not None:
        processor.chat_template = chat_template
        if getattr(processor, "tokenizer", None) is not None:
            processor.tokenizer.chat_template = chat_template
    if not getattr(processor, "chat_template", None):
        template = getattr(getattr(processor, "tokenizer", None), "chat_template", None)
        if not template:
            raise InvalidInputError(
                f"the target's processor (from {str(source)!r}) has no chat template, with which vlmspec builds "
                "every prompt; add the checkpoint's chat template to that folder (chat_template.jinja, as "
                "save_pretrained writes it), e.g. from the original checkpoint's files, or give one (from_pretrained("
                "..., chat_template=text); vlmspec serve --chat-template FILE)"
            )
        processor.chat_template = template
    return processor


def _load_model(source: str | Path, role: str, load: dict[str, Any], text: bool = False) -> torch.nn.Module:
    """The model at ``source`` (safetensors only; ``text``: a language model), a hub failure named with its role."""
    auto = AutoModelForCausalLM if text else AutoModelForImageTextToText
    try:
        return auto.from_pretrained(str(source), **load)
    except OSError as err:
        if is_local_path(source):
            raise
        raise _hub_error(source, role, err) from err


def _hub_error(source: str | Path, role: str, err: OSError) -> InputNotFoundError:
    """The hub's failure for a model id, naming the role and the id (transformers' names neither)."""
    return InputNotFoundError(
        f"{role} {str(source)!r} is no local folder, so it was fetched from the Hugging Face hub, which failed "
        f"({_reason(err)}); check the id, and without network or hub access give a local folder holding the "
        "checkpoint instead"
    )


def _reason(err: BaseException) -> str:
    """The first sentence of an error's message (transformers' go on with advice about the hub that misleads
    here), at most 300 characters."""
    lines = str(err).strip().splitlines()
    return (lines[0].split(". ")[0].rstrip(".") if lines else type(err).__name__)[:300]


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
)
"""A local folder holding none of these ships no tokenizer (``model.save_pretrained(folder)`` writes none)."""


def _load_tokenizer(source: str | Path, trust_remote_code: bool) -> Any:
    """The tokenizer saved with a checkpoint, or ``None`` when the checkpoint ships none.

    A local folder is judged by its files: ``AutoTokenizer`` does not fail on a folder without tokenizer files
    (it builds a one-token tokenizer from the config), which the vocabulary check would take for another
    vocabulary. Without one the draft uses the target's tokenizer. A hub id is asked for one.
    """
    path = Path(source)
    if path.is_dir() and not any((path / name).is_file() for name in TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(str(source), trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return None
