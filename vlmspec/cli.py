"""``vlmspec`` command line. ``vlmspec demo`` captions the bundled example image and prints speed statistics."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from .errors import InputNotFoundError, InvalidInputError, VLMSpecError
from .named_pairs import DEFAULT_PAIR, ENV_DEFAULT_PAIR
from .quantization import QUANTIZATION_NAMES, resolve_quantization_config

EXAMPLE_IMAGE = "example.png"
EXAMPLE_META = "example.json"  # the testbed example the picture was drawn from


def _example_image() -> Path:
    return Path(str(resources.files("vlmspec") / "assets" / EXAMPLE_IMAGE))


def trace_summary(trace: list[dict]) -> str:
    """A short summary of a SAGE trace: depth and width ranges (alpha too where the tree followed it), tree sizes."""
    if not trace or "width" not in trace[0]:
        return ""
    depths = [t["depth"] for t in trace]
    widths = [t["width"] for t in trace]
    sizes = [t["tree_size"] for t in trace]
    alphas = [t["alpha"] for t in trace if "alpha" in t]
    alpha = (
        f"alpha {min(alphas):.2f}..{max(alphas):.2f} (mean {sum(alphas) / len(alphas):.2f}), "
        if alphas
        else ""
    )
    return (
        f"SAGE trace over {len(trace)} steps: {alpha}depth {min(depths)}..{max(depths)}, "
        f"width {min(widths)}..{max(widths)}, tree size {min(sizes)}..{max(sizes)}, "
        f"max depth now {trace[-1]['max_depth']}"
    )


def demo(args: argparse.Namespace) -> int:
    _check_files(args)
    structure = _structure(args)  # checked before the models load
    pipe = load_pipeline(args, "vlmspec demo")
    example = None if (args.image or args.video) else bundled_example()
    image = args.image or (None if args.video else _example_image())  # --image and --video: both
    default = "Describe what happens in this clip." if args.video else "Describe this image."
    prompt = args.prompt or (example["prompt"] if example else default)
    pipe(image, prompt, video=args.video, max_new_tokens=4)  # warm-up: torch's one-off first-call costs
    if args.chat:
        return _chat(pipe, image, prompt, args, structure)
    out = pipe(
        image, prompt, video=args.video, max_new_tokens=args.max_new_tokens, structured_outputs=structure
    )
    print(f"prompt:    {prompt}")
    print(f"caption:   {out.text}")
    if example is not None and structure is None:
        from .testbed import fact_accuracy

        correct, total = fact_accuracy(out.text, example["reference"])
        print(f"reference: {example['reference']}")
        print(
            f"scene facts right: {correct}/{total} (count, background, each shape's position/size/colour/kind)"
        )
    print(f"stats:     {out.stats.summary()}")
    summary = trace_summary(out.stats.trace)
    if summary:
        print(summary)
    if args.compare:
        _compare_with_generate(pipe, out, image, prompt, args, structure)
    return 0


def _structure(args: argparse.Namespace) -> Any:
    """The demo's ``structured_outputs`` from ``--json-schema`` (a file or JSON text), ``--regex`` or ``--choice``."""
    from .structured_outputs import StructuredOutputs

    whitespace = {"disable_any_whitespace": True} if args.disable_any_whitespace else {}
    if args.json_schema is not None:
        path = Path(args.json_schema)
        if path.suffix == ".json" and not path.is_file():
            raise InputNotFoundError(
                f"--json-schema {args.json_schema!r}: no such file (give a file or JSON text)"
            )
        text = path.read_text() if path.suffix == ".json" else args.json_schema
        return StructuredOutputs(json=text, **whitespace)
    if args.regex is not None:
        return StructuredOutputs(regex=args.regex, **whitespace)
    if args.choice is not None:
        return StructuredOutputs(
            choice=[c.strip() for c in args.choice.split(",") if c.strip()], **whitespace
        )
    return StructuredOutputs(json_object=True, **whitespace) if whitespace else None


def load_pipeline(args: argparse.Namespace, command: str) -> Any:
    """The pipeline the pair flags (:func:`add_pair_flags`) name, its policy checked before any model loads."""
    from .named_pairs import is_pair_name, is_pipeline_folder, resolve_pair
    from .pipeline import VLMSpecPipeline
    from .processor_settings import check_settings_form

    if args.target is None and args.draft is not None:
        raise InvalidInputError("--draft needs --target (or name neither for the default pair)")
    policy = _check_policy(args, command)
    if args.target is None and args.pair is not None and not is_pair_name(args.pair):
        raise InvalidInputError(
            f"--pair {args.pair!r} is not a pair name (e.g. testbed-base@cpu, testbed-mini)"
        )
    pair = resolve_pair(args.target if args.target is not None else args.pair, args.draft, family=args.family)
    if args.target is None:
        default = args.pair is None
        which = "No checkpoint named: using the embedded default pair" if default else "Using the named pair"
        print(f"{which} ({pair.source}).", flush=True)
    options = json.loads(args.policy_options) if args.policy_options else {}
    if getattr(args, "chat_template", None) is not None:  # the server fronts' --chat-template
        options["chat_template"] = args.chat_template
    for flag, option in (
        ("quantization", "quantization_config"),
        ("draft_quantization", "draft_quantization_config"),
    ):
        if getattr(args, flag) is not None:  # its name in an error: the flag's
            options[option] = resolve_quantization_config(getattr(args, flag), f"--{flag.replace('_', '-')}")
    saved = is_pipeline_folder(args.target)  # a saved pipeline brings its own settings
    # the command keeps its policy, so a draft it never runs (--policy ar) is not loaded
    draft = args.draft if saved else (pair.draft if policy.uses_draft else None)
    if options.get("draft_quantization_config") is not None and draft is None and not saved:
        raise InvalidInputError(f"--draft-quantization was given, but {command} runs no draft (policy ar)")
    # the server fronts' flags, in place of a saved pipeline's (their form checked before any model loads)
    settings = getattr(args, "mm_processor_kwargs", None)
    check_settings_form(settings, "--mm-processor-kwargs")
    pipe = VLMSpecPipeline.from_pretrained(
        args.target if saved else pair.target, draft, policy=args.policy,
        torch_dtype=args.dtype, calibration=pair.calibration, reasoning_parser=getattr(args, "reasoning_parser", None),
        **options,
    )  # fmt: skip
    if settings is not None:  # checked against the loaded processor under the flag's name
        pipe.mm_processor_kwargs = pipe.check_mm_processor_kwargs(settings, "--mm-processor-kwargs")
    if pair.calibration:
        from .testbed.calibrate import get_calibration

        print(f"calibration: {pair.calibration}: {get_calibration(pair.calibration).why}.", flush=True)
    return pipe


def _chat(pipe: Any, image: Any, prompt: str, args: argparse.Namespace, structure: Any = None) -> int:
    """``demo --chat``: the first turn is the image (or video) and the prompt; then one turn per line typed (or
    piped) until an empty line or end of input. Replies stream as each verification step accepts tokens; after
    each, its statistics and how much of the prompt came from the caches of the earlier turns."""
    from transformers import TextStreamer

    chat = pipe.chat(max_new_tokens=args.max_new_tokens, structured_outputs=structure)
    streamer = TextStreamer(pipe.tokenizer, skip_prompt=True, skip_special_tokens=True)
    typed = sys.stdin.isatty()
    text, media = prompt, {"images": image, "video": args.video}
    while text:
        if media or not typed:  # echo what was not typed here
            print(f"you> {text}")
        print("vlmspec> ", end="", flush=True)
        stats = chat.send(text, streamer=streamer, **media).stats
        print(
            f"  [{stats.summary()}; prompt {stats.prompt_tokens} tokens, {stats.cached_prompt_tokens} cached]"
        )
        media = {}
        try:
            text = input("you> " if typed else "").strip()
        except EOFError:
            text = ""
    return 0


def _check_files(args: argparse.Namespace) -> None:
    """The demo's cheap checks, before any model loads: the files exist, the length is positive."""
    for flag, path in (("--image", args.image), ("--video", args.video)):
        if path is not None and not Path(path).is_file():
            raise InputNotFoundError(f"{flag} {path!r} does not exist; pass an existing file")
    if args.max_new_tokens < 1:
        raise InvalidInputError(f"--max-new-tokens {args.max_new_tokens} is invalid: use an integer >= 1")


def _check_policy(args: argparse.Namespace, command: str) -> Any:
    """The policy the flags name, its options checked (before any model loads)."""
    from .named_pairs import is_pipeline_folder
    from .policies import check_greedy, get_policy
    from .saving import read_settings, saved_policy

    try:
        options = json.loads(args.policy_options) if args.policy_options else {}
    except json.JSONDecodeError as err:
        raise InvalidInputError(
            f"--policy-options {args.policy_options!r} is not valid JSON ({err})"
        ) from None
    if not isinstance(options, dict):
        raise InvalidInputError(
            f"--policy-options must be a JSON object of option: value, got {args.policy_options!r}"
        )
    if args.policy is None and is_pipeline_folder(args.target):
        # the saved policy, with these options on top (as from_pretrained)
        policy = saved_policy(args.target, read_settings(args.target), options)
    else:  # an unknown policy or option fails here, naming it
        policy = get_policy(args.policy or "sage", **options)
    instead = "use a lossless policy such as --policy sage, or the pipeline with do_sample=True from Python"
    check_greedy(policy, f"{command} decodes greedily", instead)
    return policy


def _compare_with_generate(
    pipe: Any, out: Any, image: Any, prompt: str, args: argparse.Namespace, structure: Any = None
) -> None:
    """Runs transformers' own greedy ``generate()`` on the target (with xgrammar's logits processor for a
    ``structure``); prints its speed, identity and the speed-up."""
    inputs = pipe.prepare_inputs(image, prompt, video=args.video)
    pipe.reference_generate(inputs, max_new_tokens=4)  # warm-up, as for the speculative run
    start = time.perf_counter()
    reference = pipe.reference_generate(inputs, args.max_new_tokens, structured_outputs=structure)
    seconds = time.perf_counter() - start
    same = "identical" if reference == out.token_ids else "DIFFERENT"
    print(f"transformers generate(): {len(reference)} tokens, {len(reference) / seconds:.1f} tokens/s")
    print(
        f"output vs generate(): {same}; speed-up {out.stats.tokens_per_second * seconds / len(reference):.2f}x "
        f"(tau {out.stats.mean_accepted:.2f})"
    )


def bundled_example() -> dict[str, str]:
    """The bundled scene's ``task``, ``seed``, ``prompt`` and ``reference`` (``assets/example.json``)."""
    return json.loads((_example_image().parent / EXAMPLE_META).read_text())


def _testbed_main(argv: list[str]) -> int:
    from .testbed.cli import main as testbed_main

    return testbed_main(argv, prog="vlmspec testbed")


class ArgumentParser(argparse.ArgumentParser):
    """The parser of every ``vlmspec`` command line: a bad flag is one line, ``<prog>: error: ... (see <prog>
    --help)``, and exit status 1, like every other user error (argparse's 2 is the caption job's "some videos
    failed"); subcommand parsers inherit it."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive_int(text: str, flag: str | None = None, words: str = "") -> int:
    """An argparse ``type``: ``text`` as an integer >= 1, else an error naming ``flag`` (when given) and what it
    takes (``words``)."""
    try:
        value = int(text)
    except ValueError as err:
        need = f"{flag} takes a positive integer{words}" if flag else "expected an integer >= 1"
        raise argparse.ArgumentTypeError(f"{need}, got {text!r}") from err
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"{flag} must be >= 1, got {value}" if flag else f"expected an integer >= 1, got {value}"
        )
    return value


def _number(text: str, expected: str, accept: Callable[[float], bool]) -> float:
    """``text`` as a number that ``accept`` takes, else an ``ArgumentTypeError`` saying what was ``expected``."""
    try:
        value = float(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from err
    if not accept(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
    return value


def fraction(text: str) -> float:
    """An argparse ``type``: a number in [0, 1)."""
    return _number(text, "a number in [0, 1)", lambda value: 0.0 <= value < 1.0)


def json_object(flag: str, example: str) -> Callable[[str], dict[str, Any]]:
    """An argparse ``type``: a JSON object, else an error naming ``flag`` with ``example``."""

    def parse(text: str) -> dict[str, Any]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as err:
            raise argparse.ArgumentTypeError(
                f"{flag} takes a JSON object, e.g. '{example}', got {text!r} ({err.msg})"
            ) from err
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"{flag} takes a JSON object, got {text!r}")
        return value

    return parse


def gibibytes(text: str) -> int:
    """An argparse ``type``: a size in GiB (a number >= 0, fractions allowed), as bytes."""
    size = _number(text, "a size in GiB (a number >= 0)", lambda value: 0.0 <= value < float("inf"))
    return int(size * 2**30)


def check_output_path(path: str | Path, flag: str, folder: bool = True) -> None:
    """Refuse, before any work, an output path no result could be written to: a file where a folder is wanted (or a
    folder where a file is), or a path under a file.

    Raises:
        InvalidInputError: naming the flag and the path.
    """
    path = Path(path)
    if path.exists() and path.is_dir() != folder:
        want, found = ("a folder", "a file") if folder else ("a file path", "a folder")
        raise InvalidInputError(f"{flag} {str(path)!r} is {found}: give {want}")
    parent = next((p for p in path.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise InvalidInputError(
            f"{flag} {str(path)!r} is under {str(parent)!r}, a file: give a path in a folder"
        )


def add_pair_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that name the pair, its policy and dtype (:func:`load_pipeline` reads them)."""
    d = parser
    d.add_argument(
        "--target", help="target model: hub id, folder or pair name; default: the embedded testbed pair"
    )
    d.add_argument("--draft", help="draft model (hub id or folder)")
    d.add_argument(
        "--pair",
        default=None,
        help=f"the embedded pair used when no --target is named (default ${ENV_DEFAULT_PAIR} or {DEFAULT_PAIR}: the "
        "trained testbed pair, "
        "its target inflated exactly to a real target's cost; testbed-base for the uninflated pair, testbed-mini, "
        "tiny; see vlmspec.named_pairs)",
    )
    d.add_argument("--family", default="qwen2_vl", help="family of the embedded pair (default qwen2_vl)")
    d.add_argument("--policy", help="tree policy (default: a saved pipeline's, else sage)")
    d.add_argument("--policy-options", help="JSON of policy options, e.g. '{\"n_max\": 32}'")
    d.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16", "auto"),
        default="float32",
        help="the models' dtype (default float32, the dtype the CPU lossless tests use; bfloat16 halves the "
        "models' memory)",
    )
    names = ", ".join(QUANTIZATION_NAMES)
    d.add_argument(
        "--quantization",
        help=f"quantize the target as it loads: {names}, or a transformers quantization config's JSON (with "
        "'quant_method'); the reply stays the quantized target's own (see vlmspec.quantization)",
    )
    d.add_argument("--draft-quantization", help=f"quantize the draft as it loads ({names} or JSON)")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="vlmspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser(
        "demo", help="caption the bundled example image (or your image/video) with speed stats"
    )
    add_pair_flags(d)
    d.add_argument("--image", help="image path (default: the bundled example)")
    d.add_argument("--video", help="video path (with --image: both, in that order)")
    d.add_argument(
        "--prompt",
        help="prompt (default: the bundled example's; 'Describe this image.', or for a video 'Describe what happens in this clip.')",
    )
    d.add_argument("--max-new-tokens", type=int, default=128)
    d.add_argument(
        "--compare",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run transformers' own greedy generate() on the target, check the output is identical and print "
        "the speed-up (default on)",
    )
    d.add_argument(
        "--chat",
        action="store_true",
        help="a conversation: the image/video and prompt first, then one turn per line you type (an empty line or "
        "end of input ends it); replies stream, the caches carry over between turns",
    )
    structured = d.add_mutually_exclusive_group()
    structured.add_argument(
        "--json-schema", help="the reply follows this JSON schema (a .json file, or JSON text)"
    )
    structured.add_argument("--regex", help="the reply matches this regular expression")
    structured.add_argument("--choice", help="the reply is one of these comma-separated strings")
    d.add_argument(
        "--disable-any-whitespace",
        action="store_true",
        help="JSON without free whitespace (alone: any JSON object); see vlmspec.structured",
    )
    d.set_defaults(func=demo)
    from .serve_cli import add_serve_command

    add_serve_command(sub)

    for command in _commands():  # vlmspec bench (eval/), vlmspec caption (pipelines/): installed with vlmspec
        command.load()(sub)

    # `vlmspec testbed ...` is handed whole to the testbed's own parser (see `main`); listed here for --help.
    sub.add_parser(
        "testbed", help="build (train) the testbed pairs: vlmspec testbed build [--size base|mini]"
    )
    # `vlmspec c2t ...` is handed whole to the C2T tool's own parser (see `main`); listed here for --help.
    sub.add_parser("c2t", help="collect labelled token trees / train the C2T classifier (vlmspec c2t --help)")
    # `vlmspec edd ...` is handed whole to the EDD tool's own parser (see `main`); listed here for --help.
    sub.add_parser("edd", help="train an EDD draft for a target (vlmspec edd train --help)")
    return parser


COMMANDS_GROUP = "vlmspec.commands"
"""Entry-point group of the subcommands that live outside the library (each entry: ``register(subparsers)``)."""


def _commands() -> list[Any]:
    """The ``vlmspec.commands`` entry points, by name (the library imports neither ``eval/`` nor ``pipelines/``)."""
    from importlib.metadata import entry_points

    return sorted(entry_points(group=COMMANDS_GROUP), key=lambda e: e.name)


def _c2t_main(argv: list[str]) -> int:
    from .c2t_tools import main as c2t_main

    return c2t_main(argv, prog="vlmspec c2t")


def _edd_main(argv: list[str]) -> int:
    from .edd_train import main as edd_main

    return edd_main(argv, prog="vlmspec edd")


EXIT_USER_ERROR = 1
EXIT_INTERRUPTED = 130
USER_ERRORS: tuple[type[BaseException], ...] = (VLMSpecError, ValueError, OSError, ImportError)
"""What a bad input raises: the library's own :class:`~vlmspec.errors.VLMSpecError`, and what the libraries below
it raise for bad values, missing or unwritable files and missing optional packages: one line on stderr, exit
status 1. Anything else is a bug and keeps its traceback."""
DEBUG_ENV = "VLMSPEC_DEBUG"


def main(argv: Sequence[str] | None = None) -> int:
    """``vlmspec <command> ...``; returns the exit status.

    The one boundary for user errors: a bad input (:data:`USER_ERRORS`) prints ``vlmspec <command>: error: ...``
    and exits 1, Ctrl-C prints one line and exits 130; ``--debug`` (anywhere) or ``VLMSPEC_DEBUG=1`` shows the
    traceback instead. ``vlmspec caption`` keeps its own statuses (0 all captioned, 2 some failed).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or bool(os.environ.get(DEBUG_ENV))
    argv = [a for a in argv if a != "--debug"]
    command = argv[0] if argv else ""
    try:
        if command == "c2t":
            return _c2t_main(argv[1:])
        if command == "edd":
            return _edd_main(argv[1:])
        if command == "testbed":
            return _testbed_main(argv[1:])
        args = build_parser().parse_args(argv)
        return args.func(args)
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"\nvlmspec {command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except USER_ERRORS as err:
        if debug:
            raise
        print(f"vlmspec {command}: error: {err} (--debug shows the traceback)", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
