"""``vlmspec serve``: OpenAI's chat-completions API over a pipeline (:mod:`vlmspec.serving`).

Every reply is checked against what ``pipe(messages=...)`` gives for the same conversation (itself tested equal to
``generate()``): whole, streamed, under concurrent requests decoding together, cut at stop strings, sampled with a
seed. Bad requests get OpenAI's error shape with the field named, and the server goes on serving.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import http.server
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from functools import partial

import pytest
import torch
from conftest import make_image
from hypothesis import example, given, settings
from hypothesis import strategies as st

import vlmspec.batching as batching
import vlmspec.serving as serving
import vlmspec.serving_http as serving_http
from vlmspec import VLMSpecPipeline
from vlmspec.cli import main
from vlmspec.openai_api import APIError, MediaAccess, chat_request
from vlmspec.openai_replies import StopHolder
from vlmspec.serving import SpecServer

PROMPT = "Describe this image."


@pytest.fixture(scope="module")
def pipe(tiny_pairs):
    pair = tiny_pairs["qwen2_vl"]
    return VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="sage", torch_dtype=torch.float32)


@pytest.fixture(scope="module")
def server(pipe, tmp_path_factory):
    media = tmp_path_factory.mktemp("media")
    make_image(0).save(media / "cat.png")
    with SpecServer(pipe, "tiny", port=0, batch_size=3, max_tokens=24, media=MediaAccess(media)) as running:
        yield running


def png_uri(seed: int) -> str:
    buffer = io.BytesIO()
    make_image(seed).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def user_turn(url: str, prompt: str = PROMPT) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": prompt}]
    return [{"role": "user", "content": parts}]


def expected(pipe, picture: int, prompt: str = PROMPT, **options):
    content = [{"type": "image", "image": make_image(picture)}, {"type": "text", "text": prompt}]
    return pipe(messages=[{"role": "user", "content": content}], **options)


def post(server, body, path: str = "/v1/chat/completions") -> tuple[int, dict]:
    connection = http.client.HTTPConnection(*server._http.server_address[:2], timeout=120)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    connection.request("POST", path, data, {"Content-Type": "application/json"})
    response = connection.getresponse()
    return response.status, json.loads(response.read())


def post_stream(server, body) -> list[dict | str]:
    """The events of a streamed reply, ``"[DONE]"`` last."""
    connection = http.client.HTTPConnection(*server._http.server_address[:2], timeout=120)
    connection.request("POST", "/v1/chat/completions", json.dumps(dict(body, stream=True)))
    response = connection.getresponse()
    assert response.status == 200 and response.getheader("Content-Type") == "text/event-stream"
    events = [line[6:] for line in response.read().decode().splitlines() if line.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def test_a_completion_is_the_pipelines_reply_to_the_same_messages(server, pipe):
    status, reply = post(server, {"model": "tiny", "messages": user_turn(png_uri(0)), "max_tokens": 20})
    reference = expected(pipe, 0, max_new_tokens=20)
    assert status == 200 and reply["object"] == "chat.completion" and reply["model"] == "tiny"
    (choice,) = reply["choices"]
    assert choice["message"] == {"role": "assistant", "content": reference.text}
    assert choice["finish_reason"] == "length"  # the tiny pair's reply runs to max_tokens
    assert reply["usage"] == {
        "prompt_tokens": reference.stats.prompt_tokens,
        "completion_tokens": 20,
        "total_tokens": reference.stats.prompt_tokens + 20,
        "prompt_tokens_details": {"cached_tokens": 0},  # the server keeps no prefix cache here
    }
    assert (
        reply["vlmspec"]["policy"] == "sage" and 0 < reply["vlmspec"]["steps"] < 20
    )  # trees sized for batch 3


def test_a_streamed_reply_joins_to_the_same_text_and_ends_with_usage(server, pipe):
    events = post_stream(
        server, {"messages": user_turn(png_uri(1)), "stream_options": {"include_usage": True}}
    )
    reference = expected(pipe, 1, max_new_tokens=24)  # the server's default length
    assert events[-1] == "[DONE]" and events[0]["choices"][0]["delta"]["role"] == "assistant"
    chunks = events[:-1]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == reference.text
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"
    assert len(chunks) > 4  # pieces came step by step, not as one
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 24
    assert len({c["id"] for c in chunks}) == 1


def test_concurrent_requests_each_get_their_own_reply(server, pipe):
    results: dict[int, tuple[int, dict]] = {}
    prompts = ["Describe this image.", "What is in the picture?", "List the shapes."]

    def ask(i: int) -> None:
        results[i] = post(server, {"messages": user_turn(png_uri(i), prompts[i]), "max_tokens": 16})

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i, prompt in enumerate(prompts):
        status, reply = results[i]
        assert status == 200
        assert reply["choices"][0]["message"]["content"] == expected(pipe, i, prompt, max_new_tokens=16).text


def test_requests_waiting_together_decode_in_one_batch(pipe, monkeypatch):
    merged: list[int] = []
    run_merged = batching.run_merged
    monkeypatch.setattr(batching, "run_merged", lambda calls: merged.append(len(calls)) or run_merged(calls))
    server = SpecServer(pipe, "tiny", port=0, batch_size=3)
    futures = [server.submit(expected_kwargs(i)) for i in range(3)]  # queued before the scheduler starts
    with server:
        outputs = [future.result(timeout=120) for future in futures]
    assert max(merged) == 3
    assert [o.token_ids for o in outputs] == [
        expected(pipe, i, max_new_tokens=12).token_ids for i in range(3)
    ]


def expected_kwargs(seed: int) -> dict:
    content = [{"type": "image", "image": make_image(seed)}, {"type": "text", "text": PROMPT}]
    return {"messages": [{"role": "user", "content": content}], "max_new_tokens": 12}


def test_a_stop_string_ends_the_reply_before_it_whole_and_streamed(server, pipe):
    reference = expected(pipe, 2, max_new_tokens=24).text
    stop = reference[12:15]
    cut = reference[: reference.index(stop)]
    body = {"messages": user_turn(png_uri(2)), "stop": [stop, "never appears"]}
    status, reply = post(server, body)
    assert status == 200 and reply["choices"][0]["message"]["content"] == cut
    assert reply["choices"][0]["finish_reason"] == "stop"
    events = post_stream(server, body)[:-1]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == cut
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_a_seeded_sampled_request_is_the_pipelines_draw(server, pipe):
    body = {"messages": user_turn(png_uri(3)), "temperature": 0.8, "top_p": 0.9, "seed": 7, "max_tokens": 16}
    status, reply = post(server, body)
    sampling = {"do_sample": True, "temperature": 0.8, "top_p": 0.9, "seed": 7, "max_new_tokens": 16}
    (draw,) = pipe.batch([dict(expected_kwargs(3), **sampling)], batch_size=3)  # trees sized as the server's
    assert status == 200 and reply["choices"][0]["message"]["content"] == draw.text
    assert draw.text != expected(pipe, 3, max_new_tokens=16).text  # it did sample


@pytest.mark.parametrize(
    ("body", "status", "param", "words"),
    [
        ({"messages": []}, 400, "messages", "non-empty list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages", "role 'robot'"),
        ({"messages": user_turn("data:,x"), "n": 17}, 400, "n", "[1, 16]"),
        ({"messages": user_turn("data:,x"), "frequency_penalty": 2.5}, 400, "frequency_penalty", "[-2, 2]"),
        (
            {"messages": user_turn("data:,x"), "logit_bias": {"a": 1}},
            400,
            "logit_bias",
            "token ids to numbers",
        ),
        ({"messages": user_turn("data:,x"), "logit_bias": {"5": 101}}, 400, "logit_bias", "-100 to 100"),
        (
            {"messages": user_turn("data:,x"), "logit_bias": {"\u00b2": 1}},
            400,
            "logit_bias",
            "token ids to numbers",
        ),
        (
            {"messages": user_turn(png_uri(0)), "logit_bias": {"99999999": 1}},
            400,
            "logit_bias",
            "integers from 0",
        ),
        (
            {"messages": user_turn("data:,x"), "function_call": "auto"},
            400,
            "function_call",
            "does not implement",
        ),
        ({"messages": user_turn("data:,x"), "temprature": 0.5}, 400, "temprature", "unrecognized"),
        ({"messages": user_turn("data:,x"), "temperature": 3}, 400, "temperature", "[0, 2]"),
        ({"messages": user_turn("data:,x"), "max_tokens": 0}, 400, "max_tokens", "integer"),
        ({"messages": user_turn("data:,x"), "model": "gpt-4o"}, 404, "model", "serves 'tiny'"),
        ({"messages": user_turn("/etc/passwd")}, 400, "messages", "outside the folder"),
        ({"messages": user_turn("data:image/png;base64,AAAA")}, 400, "messages", "not an image"),
        (
            {"messages": user_turn(png_uri(0)), "structured_outputs": {"regex": "(ab"}},
            400,
            "response_format",
            "cannot be compiled",
        ),
        (
            {
                "messages": user_turn(png_uri(0)),
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "frob"}},
                },
            },
            400,
            "response_format",
            "Unsupported type",
        ),
    ],
)
def test_a_bad_request_gets_openai_s_error_naming_the_field_and_the_server_goes_on(
    server, body, status, param, words
):
    got, reply = post(server, body)
    assert got == status and reply["error"]["param"] == param and words in reply["error"]["message"]
    assert post(server, {"messages": user_turn(png_uri(0)), "max_tokens": 2})[0] == 200


def test_bodies_and_endpoints_that_are_not_the_api(server):
    status, reply = post(server, b"{not json")
    assert status == 400 and "not JSON" in reply["error"]["message"]
    assert post(server, {}, path="/v1/completions")[0] == 404
    connection = http.client.HTTPConnection(*server._http.server_address[:2], timeout=30)
    connection.request("GET", "/v1/models")
    models = json.loads(connection.getresponse().read())
    assert [m["id"] for m in models["data"]] == ["tiny"]


def test_media_from_an_allowed_folder_and_from_a_url(server, pipe, tmp_path):
    reference = expected(pipe, 0, max_new_tokens=8).text
    for url in ("cat.png", f"file://{server.media.allowed_dir / 'cat.png'}"):
        status, reply = post(server, {"messages": user_turn(url), "max_tokens": 8})
        assert status == 200 and reply["choices"][0]["message"]["content"] == reference
    make_image(0).save(tmp_path / "web.png")
    with web_folder(tmp_path) as base:
        status, reply = post(server, {"messages": user_turn(f"{base}/web.png"), "max_tokens": 8})
        assert status == 200 and reply["choices"][0]["message"]["content"] == reference
        with pytest.raises(APIError, match="does not fetch URLs"):
            chat_request({"messages": user_turn(f"{base}/web.png")}, "tiny", MediaAccess(fetch_urls=False), 8)


@contextlib.contextmanager
def web_folder(folder):
    """``folder`` served over http on a free local port; yields its base URL."""
    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{web.server_address[1]}"
    finally:
        web.shutdown()
        web.server_close()


class _Drip(http.server.BaseHTTPRequestHandler):
    """Sends a 300-byte body one byte every 20 ms (6 s in all), each byte well within a read's timeout."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "300")
        self.end_headers()
        for _ in range(300):
            self.wfile.write(b"x")
            self.wfile.flush()
            time.sleep(0.02)

    def log_message(self, *args) -> None:
        """Quiet."""


def test_a_media_url_that_sends_slowly_is_cut_off_at_the_fetch_timeout():
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Drip)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    body = {"messages": user_turn(f"http://127.0.0.1:{web.server_address[1]}/slow.png")}
    start = time.monotonic()
    try:
        with pytest.raises(APIError, match=r"took longer than 0.5 s to fetch") as refused:
            chat_request(body, "tiny", MediaAccess(timeout=0.5), 8)
    finally:
        web.shutdown()
        web.server_close()
    assert time.monotonic() - start < 3 and refused.value.param == "messages"


def test_a_pipeline_error_names_the_request_field_it_is_about():
    from vlmspec.errors import InvalidInputError
    from vlmspec.openai_api import refused_field

    assert refused_field(InvalidInputError("min_new_tokens=9 is more than max_new_tokens=4")) == "min_tokens"
    assert refused_field(ValueError("stop_strings must be strings")) == "stop"
    assert refused_field(OSError("cannot read the image 'x.png'")) == "messages"
    assert refused_field(RuntimeError("something else")) is None


def test_stop_strings_split_across_pieces_are_held_back():
    holder = StopHolder(["</s>", "STOP"])
    sent = [holder.push(piece) for piece in ["Hello wor", "ld ST", "O", "P and more"]]
    assert "".join(sent) == "Hello world " and holder.stopped
    assert holder.finish() == "" and holder.push("later") == ""
    free = StopHolder([])
    assert [free.push("a"), free.push("b"), free.finish()] == ["a", "b", ""]


def test_response_format_and_structured_outputs_are_the_pipeline_s_structured_replies(server, pipe):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    json_schema = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    cases = [
        ({"response_format": json_schema}, {"json": schema}),
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        ({"response_format": {"type": "text"}}, None),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, {"choice": ["yes", "no"]}),
        ({"guided_regex": "[a-z]{3}"}, {"regex": "[a-z]{3}"}),  # vLLM's older fields
        ({"guided_choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
    ]
    for fields, structure in cases:
        status, reply = post(server, {"messages": user_turn(png_uri(1)), "max_tokens": 24, **fields})
        reference = expected(pipe, 1, max_new_tokens=24, structured_outputs=structure)
        assert status == 200 and reply["choices"][0]["message"]["content"] == reference.text, fields
    assert reference.text in ("yes", "no")
    assert reference.text != expected(pipe, 1, max_new_tokens=24).text


def test_presence_and_frequency_penalties_and_logit_bias_are_the_pipeline_s(server, pipe):
    options = {"presence_penalty": 1.5, "frequency_penalty": 1.0}
    body = {
        "messages": user_turn(png_uri(2)),
        "max_tokens": 16,
        **options,
        "logit_bias": {"13": 100, "7": -50},
    }
    status, reply = post(server, body)
    reference = expected(pipe, 2, max_new_tokens=16, **options, logit_bias={13: 100.0, 7: -50.0})
    assert status == 200 and reply["choices"][0]["message"]["content"] == reference.text
    assert reference.token_ids != expected(pipe, 2, max_new_tokens=16).token_ids  # they changed the reply
    assert reference.token_ids[0] == 13  # +100 wins at first; the frequency penalty lets others in later


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.text(alphabet="abS", max_size=6), max_size=30),
    st.lists(st.text(alphabet="abS", min_size=1, max_size=4), max_size=3),
)
@example(["Sb", "a"], ["b", "Sba"])  # "b" stops the reply before "Sba", which begins earlier, is complete
def test_held_back_pieces_join_to_the_text_cut_at_its_first_stop_string(pieces, stops):
    """Whatever the pieces and stop strings: what is sent is the text up to the piece in which a stop string first
    appears (where generation stops: pieces are what the steps emit, cut at the token completing a stop string),
    cut before the earliest stop string in it, and no more than the longest stop string (less one character) is ever
    held back."""
    from vlmspec.openai_replies import cut_at_stop

    holder = StopHolder(stops)
    sent = ""
    for piece in pieces:
        sent += holder.push(piece)
        assert holder.stopped or len(holder.pending) <= max(map(len, stops), default=1) - 1
    sent += holder.finish()
    ends = [i for i in range(1, len(pieces) + 1) if cut_at_stop("".join(pieces[:i]), stops)[1]]
    assert (sent, holder.stopped) == cut_at_stop("".join(pieces[: ends[0] if ends else len(pieces)]), stops)


def test_the_serve_command_refuses_a_missing_media_folder_before_loading(capsys):
    assert main(["serve", "--allowed-media-dir", "/no/such/folder", "--port", "0"]) == 1
    assert "--allowed-media-dir '/no/such/folder' is not a folder" in capsys.readouterr().err


def test_the_serve_command_names_its_flag_for_a_setting_the_processor_refuses(capsys):
    # Only the loaded processor knows its settings; the error still names the flag that gave the setting.
    argv = ["serve", "--pair", "tiny", "--mm-processor-kwargs", '{"max_patches": 1}', "--port", "0"]
    assert main(argv) == 1
    assert "--mm-processor-kwargs sets max_patches, which the target's processor does not take" in (
        capsys.readouterr().err
    )


def test_the_openai_client_talks_to_it_whole_and_streamed(server, pipe):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    reference = expected(pipe, 6, max_new_tokens=10).text
    reply = client.chat.completions.create(model="tiny", messages=user_turn(png_uri(6)), max_tokens=10)
    assert reply.choices[0].message.content == reference and reply.usage.completion_tokens == 10
    stream = client.chat.completions.create(
        model="tiny", messages=user_turn(png_uri(6)), max_tokens=10, stream=True
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == reference
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_lmms_eval_s_openai_model_evaluates_through_it(server, pipe):
    """lmms-eval's own ``openai`` model (text first, then the image as a PNG data URI; temperature 0)."""
    from lmms_eval.api.instance import Instance
    from lmms_eval.models.simple.openai import OpenAICompatible

    lm = OpenAICompatible(model="tiny", base_url=f"{server.url}/v1", api_key="unused", max_retries=1)
    lm.task_dict = {"task": {"test": [{"image": make_image(7)}]}}
    args = ("What is in the picture?", {"max_new_tokens": 12}, lambda doc: [doc["image"]], 0, "task", "test")
    request = Instance("generate_until", args, idx=0, metadata={"task": "task", "doc_id": 0, "repeats": 1})
    (reply,) = lm.generate_until([request])
    content = [{"type": "text", "text": args[0]}, {"type": "image", "image": make_image(7)}]
    assert reply.text == pipe(messages=[{"role": "user", "content": content}], max_new_tokens=12).text
    assert reply.token_counts.output_tokens == 12  # read from the response's usage


def test_the_load_generator_prints_a_row_per_setting(capsys):
    from vlmspec_eval import serve_load

    serve_load.main(
        ["--target", "tiny", "--n", "2", "--clients", "2", "--batch-sizes", "1,2", "--max-tokens", "4"]
        + ["--turns", "2", "--prefix-cache-gb", "0,1"]
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("| batch | prefix cache GiB | requests/s |") and len(lines) == 6
    cells = [[cell.strip() for cell in line.strip("| ").split("|")] for line in lines[2:]]
    assert [row[:2] for row in cells] == [["1", "0.00"], ["1", "1.00"], ["2", "0.00"], ["2", "1.00"]]
    assert [row[-2] == "0%" for row in cells] == [True, False, True, False]  # cached prompt share
    assert all(row[-1] == "4/4" for row in cells)  # every reply the pipeline's own, two turns of two


def test_logprobs_are_the_targets_own_and_name_the_chosen_tokens(server, pipe):
    status, reply = post(
        server, {"messages": user_turn(png_uri(8)), "max_tokens": 6, "logprobs": True, "top_logprobs": 3}
    )
    reference = expected(pipe, 8, max_new_tokens=6, output_scores=True)
    assert status == 200
    entries = reply["choices"][0]["logprobs"]["content"]
    assert "".join(e["token"] for e in entries) == reply["choices"][0]["message"]["content"] == reference.text
    logprobs = torch.log_softmax(reference.scores.scores, dim=-1)
    for k, entry in enumerate(entries):
        token = reference.token_ids[k]
        assert entry["logprob"] == pytest.approx(logprobs[k, token].item(), abs=1e-4)
        assert len(entry["top_logprobs"]) == 3 and entry["top_logprobs"][0]["logprob"] == pytest.approx(
            entry["logprob"], abs=1e-4
        )  # greedy: the top one
        assert bytes(entry["bytes"]).decode() == entry["token"]
    assert (
        post(server, {"messages": user_turn(png_uri(8)), "max_tokens": 2})[1]["choices"][0]["logprobs"]
        is None
    )


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"logprobs": True, "stream": True}, "logprobs", "whole replies only"),
        ({"top_logprobs": 2}, "top_logprobs", '"logprobs": true'),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    ],
)
def test_logprobs_requests_that_cannot_be_served_are_refused(server, body, param, words):
    status, reply = post(server, {"messages": user_turn(png_uri(0)), **body})
    assert status == 400 and reply["error"]["param"] == param and words in reply["error"]["message"]


def test_an_api_key_is_required_when_the_server_has_one(pipe):
    with SpecServer(pipe, "tiny", port=0, max_tokens=2, api_key="s3cret") as keyed:
        address = keyed._http.server_address[:2]
        for headers, status in (
            ({}, 401),
            ({"Authorization": "Bearer nope"}, 401),
            ({"Authorization": "Bearer s3cret"}, 200),
        ):
            connection = http.client.HTTPConnection(*address, timeout=60)
            connection.request(
                "POST", "/v1/chat/completions", json.dumps({"messages": user_turn(png_uri(0))}), headers
            )
            response = connection.getresponse()
            body = json.loads(response.read())
            assert response.status == status
            assert status == 200 or body["error"]["type"] == "authentication_error"
        connection = http.client.HTTPConnection(*address, timeout=60)
        connection.request("GET", "/health")
        assert connection.getresponse().status == 200  # health needs no key


def raw_exchange(server, data: bytes, timeout: float = 30) -> bytes:
    """Send ``data`` on a fresh socket and read until the server closes it (or ``timeout``)."""
    with socket.create_connection(server._http.server_address[:2], timeout=timeout) as connection:
        connection.sendall(data)
        chunks = []
        while chunk := connection.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def request_bytes(
    body: bytes, method: str = "POST", path: str = "/v1/chat/completions", keep: bool = False, **headers: str
) -> bytes:
    headers = {"Connection": "keep-alive" if keep else "close", **headers}
    lines = [
        f"{method} {path} HTTP/1.1",
        "Host: x",
        *(f"{k.replace('_', '-')}: {v}" for k, v in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def statuses(reply: bytes) -> list[int]:
    return [int(status) for status in re.findall(rb"HTTP/1\.[01] (\d{3}) ", reply)]


@pytest.mark.parametrize(
    ("data", "status"),
    [
        (request_bytes(b"{}", Content_Length="-1"), 400),
        (request_bytes(b"{}", Content_Length="abc"), 400),
        (request_bytes(b"{}"), 411),
        (request_bytes(b'{"messages": [{"role": ["user"], "content": "x"}]}', Content_Length="50"), 400),
        (request_bytes(b"[" * 100000, Content_Length="100000"), 400),
        (request_bytes(b"", method="HEAD"), 405),
        (request_bytes(b"", method="PUT", Content_Length="0"), 405),
        (request_bytes(b"", method="GET"), 405),
    ],
)
def test_malformed_http_gets_a_json_error_never_a_dropped_connection(server, data, status):
    reply = raw_exchange(server, data)
    assert statuses(reply)[:1] == [status]
    if b"HEAD" not in data[:4]:
        assert b'"error"' in reply and b"<html" not in reply.lower()


def test_a_body_shorter_than_its_content_length_times_out_and_frees_the_thread(pipe, monkeypatch):
    monkeypatch.setattr(serving_http, "SOCKET_TIMEOUT", 1.0)
    with SpecServer(pipe, "tiny", port=0, max_tokens=2) as quick:
        reply = raw_exchange(quick, request_bytes(b"{}", Content_Length="100"), timeout=20)
    assert statuses(reply) == [408]


def test_a_kept_alive_connection_stays_in_step_after_errors_and_with_chunked_bodies(server):
    good = json.dumps({"messages": user_turn(png_uri(0)), "max_tokens": 2}).encode()
    chunked = hex(len(good))[2:].encode() + b"\r\n" + good + b"\r\n0\r\n\r\n"
    data = (
        request_bytes(b'{"x": 1}', path="/v1/completions", keep=True, Content_Length="8")
        + request_bytes(b"", method="GET", path="/health?probe=1", keep=True)
        + request_bytes(chunked, Transfer_Encoding="chunked")
    )
    assert statuses(raw_exchange(server, data)) == [404, 200, 200]


def test_a_streamed_request_refused_before_any_text_is_a_plain_error(server):
    status, reply = post(server, {"messages": user_turn("data:image/png;base64,AAAA"), "stream": True})
    assert status == 400 and "not an image" in reply["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_ends_its_request_and_frees_its_row(pipe, stream):
    """One row, a reply of thousands of tokens: the client leaving (after the first chunk when streamed) ends it
    at its next step, counted as failed, never as a finished reply."""
    with SpecServer(pipe, "tiny", port=0, batch_size=1) as alone:
        body = json.dumps({"messages": user_turn(png_uri(4)), "max_tokens": 3000, "stream": stream}).encode()
        with socket.create_connection(alone._http.server_address[:2]) as connection:
            connection.sendall(request_bytes(body, Content_Length=str(len(body))))
            if stream:
                assert connection.recv(4096).startswith(b"HTTP/1.1 200")
        wait_until(lambda: alone.metrics.requests_failed + alone.metrics.requests_ok == 1)
        assert (alone.metrics.requests_failed, alone.metrics.requests_ok, alone.in_flight) == (1, 0, 0)
        status, reply = post(alone, {"messages": user_turn(png_uri(5)), "max_tokens": 4})
        assert status == 200
        assert reply["choices"][0]["message"]["content"] == expected(pipe, 5, max_new_tokens=4).text


def wait_until(condition, seconds: float = 60) -> None:
    assert reached(condition, seconds), "timed out"


def reached(condition, seconds: float) -> bool:
    """Whether ``condition()`` held within ``seconds``."""
    deadline = time.time() + seconds
    while not condition():
        if time.time() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_closed_server_refuses_new_requests_with_503(pipe):
    closed = SpecServer(pipe, "tiny", port=0).start()
    closed.close()
    with pytest.raises(APIError, match="shutting down") as refused:
        closed.submit({"prompt": "hi"})
    assert refused.value.status == 503


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens", "more than max_tokens"),
        ({"stream_options": {"include_usage": True}}, "stream_options", '"stream": true'),
        ({"temperature": 1, "top_p": 0}, "top_p", "(0, 1]"),
        ({"response_format": {"type": "json"}}, "response_format", "text, json_object or json_schema"),
        ({"response_format": "json_object"}, "response_format", "use an object such as"),
        ({"response_format": {"type": "json_schema"}}, "response_format", '"json_schema": {"name"'),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {}},
            "structured_outputs",
            "not both",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"guided_regex": "a", "guided_json": {}}, "guided_regex", "got several"),
        ({"guided_choice": "yes"}, "guided_choice", "non-empty list of strings"),
        ({"guided_json": {}, "response_format": {"type": "json_object"}}, "guided_json", "not both"),
    ],
)
def test_settings_that_contradict_each_other_are_refused(fields, param, words):
    with pytest.raises(APIError, match=re.escape(words)) as refused:
        chat_request({"messages": user_turn("data:,x"), **fields}, "tiny", MediaAccess(), 8)
    assert refused.value.param == param


def test_file_urls_are_read_as_urls(server, pipe):
    folder = server.media.allowed_dir
    reference = expected(pipe, 0, max_new_tokens=4).text
    for url in (f"file://localhost{folder}/c%61t.png", f"file://{folder}/cat.png"):
        status, reply = post(server, {"messages": user_turn(url), "max_tokens": 4})
        assert status == 200 and reply["choices"][0]["message"]["content"] == reference
    with pytest.raises(APIError, match="another host"):
        chat_request({"messages": user_turn("file://example.com/cat.png")}, "tiny", MediaAccess(folder), 8)


def test_a_failure_of_the_batch_itself_fails_the_requests_it_took_and_the_server_goes_on(pipe, monkeypatch):
    calls = []
    batch_iter = type(pipe).batch_iter

    def fails_once(self, feed, batch_size):
        calls.append(batch_size)
        if len(calls) == 1:
            feed.take(True)  # it took a request, then broke
            raise RuntimeError("a bug in the batch")
        return batch_iter(self, feed, batch_size)

    monkeypatch.setattr(type(pipe), "batch_iter", fails_once)
    flaky = SpecServer(pipe, "tiny", port=0, max_tokens=3)
    taken, queued = (
        flaky.submit(expected_kwargs(i)) for i in range(2)
    )  # both queued before the scheduler runs
    with flaky:
        with pytest.raises(RuntimeError, match="a bug in the batch"):
            taken.result(timeout=60)
        assert queued.result(timeout=60).token_ids == expected(pipe, 1, max_new_tokens=12).token_ids
        status, reply = post(flaky, {"messages": user_turn(png_uri(0))})
        assert (
            status == 200
            and reply["choices"][0]["message"]["content"] == expected(pipe, 0, max_new_tokens=3).text
        )
    assert (flaky.metrics.requests_failed, flaky.metrics.requests_ok) == (1, 2)


def test_closing_without_draining_answers_the_decoding_and_the_queued_with_503(pipe):
    """Ctrl-C: the request decoding is ended at its next step, the queued one is never decoded, and both
    clients hear that the server shut down (503), not that their request was bad."""
    server = SpecServer(pipe, "tiny", port=0, batch_size=1)
    server.close()  # never started: returns at once
    server = SpecServer(pipe, "tiny", port=0, batch_size=1, max_tokens=3000).start()
    answers: dict[str, tuple[int, dict]] = {}

    def ask(name: str, stream: bool) -> None:
        answers[name] = post(server, {"messages": user_turn(png_uri(0)), "stream": stream})

    decoding = threading.Thread(target=ask, args=("decoding", False))
    decoding.start()
    wait_until(lambda: server._feed.taken == 1)
    queued = threading.Thread(target=ask, args=("queued", True))
    queued.start()
    wait_until(lambda: server.in_flight == 2)
    server.close(drain=False)
    for thread in (decoding, queued):
        thread.join(timeout=60)
    for name in ("decoding", "queued"):
        status, reply = answers[name]
        assert status == 503 and "shut down" in reply["error"]["message"], name


def test_logprobs_that_would_not_fit_in_memory_are_refused(server):
    body = {"messages": user_turn(png_uri(0)), "logprobs": True, "max_tokens": 2**30}
    status, reply = post(server, body)
    assert status == 400 and reply["error"]["param"] == "logprobs" and "GiB" in reply["error"]["message"]


def test_logprob_bytes_of_tokens_inside_a_character_join_to_it(pipe):
    from vlmspec.openai_replies import _token_entry

    ids = pipe.tokenizer("a😀b é", add_special_tokens=False)["input_ids"]
    entries = [_token_entry(pipe.tokenizer, i, 0.0) for i in ids]
    assert "\ufffd" in "".join(e["token"] for e in entries)  # the emoji's bytes are split over tokens
    assert bytes(b for e in entries for b in e["bytes"]).decode() == "a😀b é"


def test_an_api_key_is_matched_as_http_says_and_none_may_be_empty(pipe):
    with pytest.raises(ValueError, match="api_key=''"):
        SpecServer(pipe, port=0, api_key="")
    with SpecServer(pipe, "tiny", port=0, max_tokens=2, api_key="k3y") as keyed:
        connection = http.client.HTTPConnection(*keyed._http.server_address[:2], timeout=60)
        connection.request("GET", "/v1/models", headers={"Authorization": "bearer  k3y"})
        assert connection.getresponse().status == 200


@pytest.mark.slow
def test_the_serve_command_serves_until_interrupted(tmp_path):
    command = [
        sys.executable,
        "-m",
        "vlmspec.cli",
        "serve",
        "--pair",
        "tiny",
        "--port",
        "0",
        "--max-tokens",
        "3",
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    ) as process:
        try:
            line = ""
            while "serving" not in line:
                line = process.stdout.readline()
                assert line, "the server exited before serving"
            url = re.search(r"http://[\d.]+:\d+", line).group(0)
            host, port = url.removeprefix("http://").split(":")
            connection = http.client.HTTPConnection(host, int(port), timeout=60)
            body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}]}
            connection.request("POST", "/v1/chat/completions", json.dumps(body))
            response = connection.getresponse()
            reply = json.loads(response.read())
            assert response.status == 200 and reply["usage"]["completion_tokens"] == 3
        finally:
            process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 130


def test_n_replies_sampled_each_its_own_draw_greedy_the_same_one(server, pipe):
    sampling = {"temperature": 0.9, "seed": 11, "max_tokens": 8}
    status, reply = post(server, {"messages": user_turn(png_uri(9)), "n": 3, **sampling})
    draws = pipe.batch(
        [
            dict(expected_kwargs(9), do_sample=True, temperature=0.9, seed=11 + i, max_new_tokens=8)
            for i in range(3)
        ],
        batch_size=3,
    )
    assert status == 200 and [c["index"] for c in reply["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in reply["choices"]] == [d.text for d in draws]
    assert len({d.text for d in draws}) > 1 and reply["usage"]["completion_tokens"] == sum(
        len(d.token_ids) for d in draws
    )
    status, reply = post(server, {"messages": user_turn(png_uri(9)), "n": 2, "max_tokens": 5})
    texts = [c["message"]["content"] for c in reply["choices"]]
    assert (
        texts == [expected(pipe, 9, max_new_tokens=5).text] * 2 and reply["usage"]["completion_tokens"] == 10
    )
    status, reply = post(server, {"messages": user_turn(png_uri(9)), "n": 2, "stream": True})
    assert status == 400 and reply["error"]["param"] == "n"


def test_metrics_count_what_the_replies_say(pipe):
    with SpecServer(pipe, "tiny", port=0, max_tokens=6) as fresh:
        replies = [post(fresh, {"messages": user_turn(png_uri(i))})[1] for i in range(3)]
        assert (
            post(fresh, {"messages": user_turn("data:image/png;base64,AAAA")})[0] == 400
        )  # refused on arrival
        connection = http.client.HTTPConnection(*fresh._http.server_address[:2], timeout=30)
        connection.request("GET", "/metrics")
        response = connection.getresponse()
        assert response.getheader("Content-Type").startswith("text/plain; version=0.0.4")
        values = dict(
            line.split() for line in response.read().decode().splitlines() if not line.startswith("#")
        )
    assert (
        float(values["vlmspec_requests_ok_total"]) == 3
        and float(values["vlmspec_requests_failed_total"]) == 0
    )
    assert float(values["vlmspec_generation_tokens_total"]) == sum(
        r["usage"]["completion_tokens"] for r in replies
    )
    steps = sum(r["vlmspec"]["steps"] for r in replies)
    accepted = sum(r["vlmspec"]["mean_accepted"] * r["vlmspec"]["steps"] for r in replies)
    assert float(values["vlmspec_verification_steps_total"]) == steps
    assert float(values["vlmspec_accepted_draft_tokens_total"]) == pytest.approx(accepted)
    assert float(values["vlmspec_in_flight"]) == 0


def test_logprobs_of_a_reply_cut_at_a_stop_string_cover_the_text_returned(server, pipe):
    reference = expected(pipe, 2, max_new_tokens=24).text
    stop = reference[12:15]
    body = {"messages": user_turn(png_uri(2)), "stop": stop, "logprobs": True}
    status, reply = post(server, body)
    content = reply["choices"][0]["message"]["content"]
    tokens = "".join(entry["token"] for entry in reply["choices"][0]["logprobs"]["content"])
    assert status == 200 and content == reference[: reference.index(stop)]
    assert content.startswith(tokens) and len(content) - len(tokens) < 8  # at most the cut token's part


# ---- request fields, one by one (found by a mutation pass) ----------------------------------------------------
def kwargs_of(**fields) -> dict:
    return chat_request({"messages": user_turn("data:,x"), **fields}, "tiny", MediaAccess(), 8).kwargs


def test_request_fields_become_the_pipelines_arguments():
    assert (
        kwargs_of(temperature=0.5, top_k=0)["top_k"] is None
        and kwargs_of(temperature=0.5, top_k=-1)["top_k"] is None
    )
    assert kwargs_of(temperature=0.5, top_k=5)["top_k"] == 5 and kwargs_of(seed=0)["seed"] == 0
    assert kwargs_of(min_tokens=8, max_tokens=8)["min_new_tokens"] == 8  # as many as the maximum is fine
    assert "do_sample" not in kwargs_of(temperature=0, top_p=0.5)  # greedy: top_p does not apply
    system = chat_request(
        {"messages": [{"role": "developer", "content": "Be brief."}, *user_turn("data:,x")]},
        "t",
        MediaAccess(),
        8,
    )
    assert system.kwargs["messages"][0] == {"role": "system", "content": "Be brief."}
    assert (
        chat_request(
            {"messages": user_turn("data:,x"), "top_logprobs": 0}, "t", MediaAccess(), 8
        ).top_logprobs
        is None
    )


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": True}, "max_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["a", 3]}, "stop"),
        ({"seed": "1"}, "seed"),
    ],
)
def test_request_fields_of_the_wrong_kind_are_refused(fields, param):
    with pytest.raises(APIError) as refused:
        kwargs_of(**fields)
    assert refused.value.param == param


def test_the_earliest_stop_string_in_the_text_wins_and_eos_ends_as_stop():
    from types import SimpleNamespace

    from vlmspec.openai_replies import cut_at_stop, finish_reason

    assert cut_at_stop("abXcdY", ["Y", "X"]) == ("ab", True)
    assert finish_reason(SimpleNamespace(token_ids=[5, 2]), False, 2, (2,)) == "stop"
    assert finish_reason(SimpleNamespace(token_ids=[5, 6]), False, 2, (2,)) == "length"
    assert finish_reason(SimpleNamespace(token_ids=[5, 6]), True, 2, (2,)) == "stop"


def test_a_stop_string_on_the_last_allowed_token_still_ends_as_stop(server, pipe):
    reference = expected(pipe, 2, max_new_tokens=24).text
    stop = reference[12:15]
    stopped = expected(pipe, 2, max_new_tokens=24, stop_strings=[stop])
    body = {"messages": user_turn(png_uri(2)), "stop": stop, "max_tokens": len(stopped.token_ids)}
    status, reply = post(server, body)
    assert status == 200 and reply["choices"][0]["finish_reason"] == "stop"
    assert reply["usage"]["completion_tokens"] == len(stopped.token_ids) < 24  # decoding stopped there too
    events = post_stream(server, body)
    assert [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]][-1] == "stop"


def test_an_empty_streamed_reply_still_names_its_role(server, pipe):
    reference = expected(pipe, 2, max_new_tokens=24).text
    events = post_stream(server, {"messages": user_turn(png_uri(2)), "stop": reference[:2]})
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_logprobs_without_top_list_no_alternatives(server):
    status, reply = post(server, {"messages": user_turn(png_uri(0)), "max_tokens": 3, "logprobs": True})
    assert status == 200 and all(e["top_logprobs"] == [] for e in reply["choices"][0]["logprobs"]["content"])


def test_the_logprobs_memory_bound_counts_choices_and_both_score_tensors(pipe):
    vocab = pipe.target.config.get_text_config().vocab_size
    fits = serving.LOGPROBS_BYTES // (2 * vocab * 4)  # max_tokens whose logits and scores just fit, one draw
    server = SpecServer(pipe, "tiny", port=0)
    try:
        sampled = {"messages": user_turn("data:,x"), "logprobs": True, "temperature": 1}
        server._check_logprobs_memory(
            chat_request({**sampled, "max_tokens": fits}, "tiny", MediaAccess(), 8), 1
        )
        for draws, tokens in ((2, fits), (1, fits + 1)):
            request = chat_request({**sampled, "max_tokens": tokens, "n": draws}, "tiny", MediaAccess(), 8)
            with pytest.raises(APIError, match="GiB"):
                server._check_logprobs_memory(request, draws)
    finally:
        server.close()


def test_a_greedy_request_for_n_replies_is_decoded_once(pipe):
    with SpecServer(pipe, "tiny", port=0, max_tokens=3) as fresh:
        status, reply = post(fresh, {"messages": user_turn(png_uri(0)), "n": 3})
        assert status == 200 and len(reply["choices"]) == 3
        assert fresh.metrics.requests_ok == 1 and fresh._feed.taken == 1


@pytest.mark.parametrize(
    ("error", "status", "kind"),
    [
        (ValueError("a value the model refuses"), 400, "invalid_request_error"),
        (KeyError("a bug"), 500, "server_error"),
    ],
)
def test_errors_while_decoding_are_400_for_bad_input_and_500_for_the_server(
    pipe, monkeypatch, error, status, kind
):
    def fails(self, *args):
        raise error

    with SpecServer(pipe, "tiny", port=0, max_tokens=3) as fresh:
        monkeypatch.setattr(type(pipe), "_decode", fails)
        got, reply = post(fresh, {"messages": user_turn(png_uri(0))})
        assert (got, reply["error"]["type"]) == (status, kind)


def test_model_not_found_is_typed_as_openai_types_it(server):
    status, reply = post(server, {"messages": user_turn(png_uri(0)), "model": "gpt-4o"})
    assert status == 404 and reply["error"]["type"] == "not_found_error"


def test_keyed_servers_keep_metrics_and_health_open_and_the_rest_closed(pipe):
    with SpecServer(pipe, "tiny", port=0, api_key="k") as keyed:
        address = keyed._http.server_address[:2]
        for path, status in (("/metrics", 200), ("/health", 200), ("/v1/health", 200), ("/v1/models", 401)):
            connection = http.client.HTTPConnection(*address, timeout=30)
            connection.request("GET", path)
            assert connection.getresponse().status == status, path
        reply = raw_exchange(
            keyed, request_bytes(b"{}", keep=True, Content_Length="2") + request_bytes(b"", "GET", "/health")
        )
        assert statuses(reply) == [401]  # its body unread: the connection closes after the refusal


def test_refusals_that_leave_a_body_unread_close_the_connection_and_others_keep_it(server):
    bad_length = request_bytes(b"{}", keep=True, Content_Length="abc") + request_bytes(b"", "GET", "/health")
    assert statuses(raw_exchange(server, bad_length)) == [400]
    body = b'{"messages": []}'
    chunked = hex(len(body))[2:].encode() + b"\r\n" + body + b"\r\n0\r\nX-Trailer: 1\r\n\r\n"
    in_step = request_bytes(chunked, keep=True, Transfer_Encoding="chunked") + request_bytes(
        b"", "GET", "/health"
    )
    assert statuses(raw_exchange(server, in_step)) == [400, 200]
    posted = request_bytes(b"{}", keep=True, path="/health", Content_Length="2") + request_bytes(
        b"", "GET", "/health"
    )
    reply = raw_exchange(server, posted)
    assert statuses(reply) == [405, 200] and b"Allow: GET, POST" in reply
    head = raw_exchange(server, request_bytes(b"", "HEAD", "/health"))
    assert statuses(head) == [405] and head.endswith(b"\r\n\r\n")  # no body after the headers


def test_fetched_videos_are_deleted_once_answered(server, monkeypatch, tmp_path):
    made = []
    chat = serving.chat_request

    def recording(*args):
        request = chat(*args)
        temp = tmp_path / "fetched.mp4"
        temp.write_bytes(b"x")
        request.temp_files.append(temp)
        made.append(temp)
        return request

    monkeypatch.setattr(serving, "chat_request", recording)
    assert post(server, {"messages": user_turn(png_uri(0)), "max_tokens": 2})[0] == 200
    assert made and not made[0].exists()


def test_media_limits_and_a_server_that_reads_no_files(pipe, tmp_path):
    make_image(0).save(tmp_path / "big.png")
    with web_folder(tmp_path) as base:
        with pytest.raises(APIError, match="larger than 10 bytes") as refused:
            chat_request({"messages": user_turn(f"{base}/big.png")}, "t", MediaAccess(max_bytes=10), 8)
        assert refused.value.status == 413
    with SpecServer(pipe, "tiny", port=0) as no_files:
        status, reply = post(no_files, {"messages": user_turn("cat.png")})
        assert status == 400 and "reads none" in reply["error"]["message"]


def test_metrics_add_each_reply_s_prompt_and_tree_nodes():
    from types import SimpleNamespace

    from vlmspec.server_metrics import ServerMetrics

    metrics = ServerMetrics()
    stats = SimpleNamespace(
        prompt_tokens=7,
        cached_prompt_tokens=4,
        steps=2,
        accepted_tokens=3,
        tree_sizes=[3, 5],
        total_seconds=0.5,
    )
    metrics.count(SimpleNamespace(stats=stats, token_ids=[1, 2, 3, 4, 5]))
    metrics.count(RuntimeError("gone"))
    assert (metrics.prompt_tokens, metrics.draft_nodes, metrics.generation_tokens) == (7, 8, 5)
    assert metrics.cached_prompt_tokens == 4 and "vlmspec_cached_prompt_tokens_total 4" in metrics.text(0)
    assert (metrics.requests_ok, metrics.requests_failed, metrics.accepted_draft_tokens) == (1, 1, 3)


def test_a_feed_closed_dropping_its_queue_gives_the_queued_back_and_ends():
    from vlmspec import RequestFeed
    from vlmspec.requests import END

    feed = RequestFeed()
    feed.put("a")
    feed.put("b")
    assert feed.take(False) == (0, "a") and feed.taken == 1
    assert feed.close(drop_queued=True) == [(1, "b")]
    assert feed.take(False) is END and feed.take(True) is END


def test_a_feed_withdraws_only_the_requests_still_queued():
    from vlmspec import RequestFeed

    feed = RequestFeed()
    for request in "abc":
        feed.put(request)
    assert feed.take(False) == (0, "a")
    assert feed.withdraw({0, 2}) == [(2, "c")]  # "a" was taken: a batch decodes it
    assert feed.take(False) == (1, "b") and feed.take(False) is None


def test_an_idle_batch_waits_on_its_feed_instead_of_polling_it(pipe):
    from vlmspec import RequestFeed

    class Counting(RequestFeed):
        calls = 0

        def take(self, wait):
            Counting.calls += 1
            return super().take(wait)

    feed = Counting()
    consumer = threading.Thread(target=lambda: list(pipe.batch_iter(feed, batch_size=2)))
    consumer.start()
    time.sleep(0.5)
    feed.close()
    consumer.join(timeout=30)
    assert Counting.calls <= 2


def test_text_held_back_to_the_end_of_a_stream_is_sent_before_it_ends(server, pipe, monkeypatch):
    from vlmspec.streaming import TextPieces

    monkeypatch.setattr(TextPieces, "push", lambda self, ids: "")  # every piece held back (split characters)
    events = post_stream(server, {"messages": user_turn(png_uri(1)), "max_tokens": 8})
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"])
    assert text == expected(pipe, 1, max_new_tokens=8).text


def test_draws_already_queued_end_when_a_later_one_is_refused(pipe, monkeypatch):
    server = SpecServer(pipe, "tiny", port=0)
    streamers = []
    submit = server.submit

    def refuses_the_second(kwargs):
        streamers.append(kwargs["streamer"])
        if len(streamers) == 2:
            raise APIError("the server is shutting down", status=503)
        return submit(kwargs)

    monkeypatch.setattr(server, "submit", refuses_the_second)
    request = chat_request(
        {"messages": user_turn(png_uri(0)), "n": 3, "temperature": 1}, "tiny", MediaAccess(), 4
    )
    with pytest.raises(APIError, match="shutting down"):
        server.complete(request)
    assert streamers[0].cancelled.is_set()
    server.close(drain=False)


@pytest.mark.parametrize("stream", [True, False])
def test_a_request_whose_client_leaves_while_queued_is_never_prefilled(pipe, monkeypatch, stream):
    """One row, held by the request decoding: a request queued behind it (streamed or not) whose client leaves
    is dropped from the queue at once (counted as failed), never prefilled nor decoded; the server goes on."""
    references = [expected(pipe, i, max_new_tokens=4).text for i in (0, 5)]
    prefills = []
    target, prefill = pipe.target_adapter, pipe.target_adapter.prefill
    monkeypatch.setattr(target, "prefill", lambda inputs, **kw: prefills.append(1) or prefill(inputs, **kw))
    with SpecServer(pipe, "tiny", port=0, batch_size=1) as alone:
        first = _Holding()
        decoding = alone.submit(dict(expected_kwargs(0), max_new_tokens=4, streamer=first))
        wait_until(lambda: alone._feed.taken == 1)  # the first holds the row
        body = json.dumps({"messages": user_turn(png_uri(4)), "max_tokens": 3000, "stream": stream}).encode()
        with socket.create_connection(alone._http.server_address[:2]) as connection:
            connection.sendall(request_bytes(body, Content_Length=str(len(body))))
            wait_until(lambda: alone.in_flight == 2)
        left_the_queue = reached(lambda: alone.in_flight == 1, seconds=10)
        first.release.set()
        assert decoding.result(timeout=60).text == references[0]
        wait_until(lambda: alone.in_flight == 0)
        status, reply = post(alone, {"messages": user_turn(png_uri(5)), "max_tokens": 4})
        assert status == 200 and reply["choices"][0]["message"]["content"] == references[1]
    assert len(prefills) == 2  # the first request and the last: never the one whose client left
    assert left_the_queue and (alone.metrics.requests_failed, alone.metrics.requests_ok) == (1, 2)


class _Holding:
    """A streamer that holds its request (and the scheduler with it) before its prefill until ``release`` is
    set."""

    def __init__(self):
        self.release = threading.Event()

    def put(self, value):
        assert self.release.wait(timeout=60)

    def end(self):
        """Nothing to flush."""
