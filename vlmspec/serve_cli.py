"""``vlmspec serve`` and the flags every front of a :class:`~vlmspec.serving.SpecServer` takes (``vlmspec batch``'s
too): the pair, batch size, prefix cache, default length, model name, chat template, processor settings, reasoning
parser, media access."""

from __future__ import annotations

import argparse
import os
import threading
from pathlib import Path
from typing import Any

from .cli import _example_image, add_pair_flags, gibibytes, json_object, load_pipeline, positive_int
from .errors import InputNotFoundError, InvalidInputError, VLMSpecError
from .named_pairs import DEFAULT_PAIR
from .reasoning import NO_PARSER, PARSER_NAMES


def add_serve_command(sub: Any) -> None:
    s = sub.add_parser("serve", help="serve the pair behind OpenAI's chat-completions API (vlmspec.serving)")
    add_server_flags(s)
    s.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)"
    )
    s.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: a free one)")
    s.add_argument(
        "--api-key",
        default=os.environ.get("VLMSPEC_API_KEY") or None,
        help="require Authorization: Bearer <key> on every request but /health and /metrics (default $VLMSPEC_API_KEY; "
        "none)",
    )
    s.set_defaults(func=serve)


def add_server_flags(s: argparse.ArgumentParser) -> None:
    """The pair and the chat-completions options of ``vlmspec serve`` that any front of a :class:`SpecServer`
    takes (the batch job's too): batch size, prefix cache, default length, model name, media access."""
    add_pair_flags(s)
    s.add_argument(
        "--batch-size", type=positive_int, default=8, help="requests decoding together (default 8)"
    )
    s.add_argument(
        "--prefix-cache-gb",
        type=gibibytes,
        default=2**30,
        help="memory for finished requests' KV caches, so that a request starting as an earlier one did (a "
        "conversation's next turn, another question about an image) prefills only the rest (default 1; 0: off; "
        "greedy replies stay generate()'s up to the floating-point difference of a prompt run in two pieces)",
    )
    s.add_argument(
        "--max-tokens",
        type=positive_int,
        default=512,
        help="a reply's length when a request sets none (default 512)",
    )
    s.add_argument(
        "--served-model-name", help="the model name clients send (default: --target, or the pair's name)"
    )
    s.add_argument(
        "--chat-template",
        type=chat_template,
        help="a chat template (a Jinja file, or the template itself) instead of the processor's own",
    )
    s.add_argument(
        "--default-chat-template-kwargs",
        type=template_defaults,
        default={},
        help="the chat template's variables for every request; a request's chat_template_kwargs win",
    )
    s.add_argument(
        "--mm-processor-kwargs",
        type=json_object("--mm-processor-kwargs", '{"max_pixels": 401408}'),
        help="the processor's settings for every request's pictures and videos (vLLM's); a request's "
        "mm_processor_kwargs win (default: a saved pipeline's, else none)",
    )
    s.add_argument(
        "--reasoning-parser",
        choices=PARSER_NAMES,
        help="a thinking model's tags (vLLM's names): replies carry their reasoning apart from their content "
        "(reasoning_content), and structured outputs and tool calls apply after it (default: a saved pipeline's, "
        f"else none; {NO_PARSER}: none, whatever was saved)",
    )
    s.add_argument(
        "--allowed-media-dir",
        type=Path,
        help="a folder whose files requests may name as media (default: none)",
    )
    s.add_argument(
        "--fetch-urls",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fetch http(s) media URLs (default on; a server others can reach fetches any address they name, this "
        "machine's network included: --no-fetch-urls takes data: URIs and allowed files only)",
    )


def build_server(args: argparse.Namespace, command: str) -> Any:
    """The :class:`~vlmspec.serving.SpecServer` of :func:`add_server_flags`' options (listening at ``--host``
    and ``--port`` where the command has them, else none), its pipeline loaded and warmed up."""
    import jinja2

    from .openai_api import MediaAccess
    from .prefix_cache import PrefixCache
    from .serving import SpecServer

    if args.allowed_media_dir is not None and not args.allowed_media_dir.is_dir():
        raise InputNotFoundError(f"--allowed-media-dir {str(args.allowed_media_dir)!r} is not a folder")
    pipe = load_pipeline(args, command)  # with --reasoning-parser and --mm-processor-kwargs, where given
    picture = {"type": "image", "image": str(_example_image())}
    warm_up = [{"role": "user", "content": [picture, {"type": "text", "text": "Describe this image."}]}]
    try:  # warm-up: not the first request's wait; and the chat template, with its defaults, tried once
        pipe(
            messages=warm_up, max_new_tokens=2, chat_template_kwargs=args.default_chat_template_kwargs or None
        )
    except (VLMSpecError, ValueError, TypeError, jinja2.TemplateError) as err:
        flags = ("--chat-template", "--default-chat-template-kwargs", "--mm-processor-kwargs")
        given = [flag for flag in flags if getattr(args, flag[2:].replace("-", "_"))]
        if not given:
            raise
        raise InvalidInputError(
            f"{'/'.join(given)}: a request with one picture fails under them: {err}"
        ) from err
    pipe.prefix_cache = PrefixCache(max_bytes=args.prefix_cache_gb) if args.prefix_cache_gb else None
    name = args.served_model_name or args.target or args.pair or DEFAULT_PAIR
    media = MediaAccess(allowed_dir=args.allowed_media_dir, fetch_urls=args.fetch_urls)
    listen = (
        {"host": args.host, "port": args.port, "api_key": args.api_key}
        if hasattr(args, "port")
        else {"port": None}
    )
    return SpecServer(
        pipe,
        name,
        batch_size=args.batch_size,
        max_tokens=args.max_tokens,
        media=media,
        template_kwargs=args.default_chat_template_kwargs,
        **listen,
    )


def serve(args: argparse.Namespace) -> int:
    """``vlmspec serve``: load the pair, then serve until Ctrl-C."""
    server = build_server(args, "vlmspec serve")
    name = server.model
    with server:
        print(f"serving {name!r} at {server.url}/v1 (POST /v1/chat/completions; Ctrl-C stops)", flush=True)
        threading.Event().wait()
    return 0


def chat_template(text: str) -> str:
    """An argparse ``type``: a chat template, given inline (text with ``{{`` or ``{%``) or from the file ``text``
    names (vLLM's ``--chat-template``). Whether it renders is found by the server's warm-up request."""
    if "{{" in text or "{%" in text:
        return text
    path = Path(text).expanduser()
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is neither a template file nor a template ('{{%...%}}')")
    return path.read_text(encoding="utf-8")


def template_defaults(text: str) -> dict[str, Any]:
    """An argparse ``type``: ``--default-chat-template-kwargs``, a JSON object of the template's variables,
    checked as a request's ``chat_template_kwargs`` are."""
    from .conversations import check_template_kwargs

    try:
        return check_template_kwargs(
            json_object("--default-chat-template-kwargs", '{"enable_thinking": false}')(text)
        )
    except VLMSpecError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
