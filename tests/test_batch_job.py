"""``vlmspec batch``: a file of OpenAI batch requests answered by the pair (:mod:`vlmspec_batch`), each reply what
``vlmspec serve`` (and so ``pipe(messages=...)``) gives, refused requests answered with their error, and a killed
run resumed without losing or repeating an answer."""

from __future__ import annotations

import json

import pytest
import torch
from test_serving import png_uri, user_turn

from vlmspec import VLMSpecPipeline
from vlmspec.cli import main

PROMPTS = ["Describe this image.", "What is in it?", "Name one colour."]


@pytest.fixture(scope="module")
def pair(tiny_pairs):
    return tiny_pairs["qwen2_vl"]


@pytest.fixture(scope="module")
def pipe(pair):
    return VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="sage", torch_dtype=torch.float32)


def request_line(custom_id: str, **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})


@pytest.fixture
def requests_file(tmp_path):
    lines = [
        request_line(f"r{i}", messages=user_turn(png_uri(i), p), max_tokens=8) for i, p in enumerate(PROMPTS)
    ]
    lines.append(request_line("bad", messages=user_turn(png_uri(0)), temperature=3))
    lines.append(
        request_line("yes-no", messages=user_turn(png_uri(1)), structured_outputs={"choice": ["yes", "no"]})
    )
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def run(pair, requests_file, out, *extra) -> int:
    args = [
        "batch",
        str(requests_file),
        "--out",
        str(out),
        "--target",
        str(pair.target),
        "--draft",
        str(pair.draft),
    ]
    return main([*args, "--batch-size", "2", "--max-tokens", "8", "--prefix-cache-gb", "0", *extra])


def by_id(out) -> dict[str, dict]:
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len({r["custom_id"] for r in records}) == len(records)  # no request answered twice
    return {r["custom_id"]: r for r in records}


def test_every_request_gets_the_server_s_answer_and_a_refused_one_its_error(
    pair, pipe, requests_file, tmp_path
):
    out = tmp_path / "results.jsonl"
    assert run(pair, requests_file, out) == 2  # one request refused
    records = by_id(out)
    assert set(records) == {"r0", "r1", "r2", "bad", "yes-no"}
    for i, prompt in enumerate(PROMPTS):
        record = records[f"r{i}"]
        assert record["id"].startswith("batch_req_") and record["error"] is None
        body = record["response"]["body"]
        assert record["response"]["status_code"] == 200 and body["object"] == "chat.completion"
        expected = pipe(messages=[{"role": "user", "content": [{"type": "image", "image": png_uri(i)},
                        {"type": "text", "text": prompt}]}], max_new_tokens=8)  # fmt: skip
        assert body["choices"][0]["message"]["content"] == expected.text
    refused = records["bad"]["response"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "temperature"
    assert records["yes-no"]["response"]["body"]["choices"][0]["message"]["content"] in ("yes", "no")


def test_a_killed_run_resumes_without_losing_or_repeating_an_answer(pair, requests_file, tmp_path, capsys):
    out = tmp_path / "results.jsonl"
    assert run(pair, requests_file, out) == 2
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:2]) + lines[2][:25])  # killed while writing the third line
    assert run(pair, requests_file, out) == 2
    assert out.read_text().startswith("".join(lines[:2]))  # what was written stays
    assert set(by_id(out)) == {"r0", "r1", "r2", "bad", "yes-no"}
    printed = capsys.readouterr()
    assert "removed a torn last line" in printed.err and "2 already done" in printed.out
    assert (
        run(pair, requests_file, out) == 2 and "5 already done" in capsys.readouterr().out
    )  # still one refused


def test_the_job_listens_nowhere_locks_first_and_loads_nothing_when_all_is_answered(
    pair, requests_file, tmp_path, monkeypatch, capsys
):
    import vlmspec.serving

    def no_listener(*args):
        raise AssertionError("vlmspec batch opened an HTTP listener")

    monkeypatch.setattr(vlmspec.serving, "HTTPServer", no_listener)
    out = tmp_path / "results.jsonl"
    assert run(pair, requests_file, out) == 2
    import vlmspec.cli

    monkeypatch.setattr(
        vlmspec.cli, "load_pipeline", lambda *a: pytest.fail("the pair loaded with nothing to do")
    )
    assert run(pair, requests_file, out) == 2 and "5 already done" in capsys.readouterr().out


def test_a_server_failure_is_answered_again_on_the_next_run(pair, requests_file, tmp_path, capsys):
    out = tmp_path / "results.jsonl"
    assert run(pair, requests_file, out) == 2
    records = [json.loads(line) for line in out.read_text().splitlines()]
    failed = next(r for r in records if r["custom_id"] == "r1")
    failed["response"] = {"status_code": 503, "request_id": "x", "body": {"error": {"message": "shut down"}}}
    from vlmspec_caption.store import encode_record

    out.write_bytes(b"".join(encode_record(r) for r in records))
    assert (
        run(pair, requests_file, out) == 2
        and "1 answered, 0 refused, 4 already done" in capsys.readouterr().out
    )
    assert by_id(out)["r1"]["response"]["status_code"] == 200


def test_another_job_s_output_is_refused_unchanged(pair, requests_file, tmp_path, capsys):
    out = tmp_path / "captions.jsonl"
    captions = b'{"id": "clips/a.mp4", "path": "clips/a.mp4", "caption": "a cat"}\n'
    out.write_bytes(captions)
    assert run(pair, requests_file, out) == 1
    assert "was not written by this job" in capsys.readouterr().err and out.read_bytes() == captions
    import vlmspec_caption

    batch = tmp_path / "batch.jsonl"
    assert run(pair, requests_file, batch) == 2
    with pytest.raises(vlmspec_caption.JobError, match="was not written by this job"):
        vlmspec_caption.read_output(batch, repair=True)  # and the caption job refuses a batch's


@pytest.mark.parametrize(
    "lines, words",
    [
        (['{"custom_id": "a", "body": {}}', '{"custom_id": "a", "body": {}}'], "custom_id 'a' is used twice"),
        (['{"body": {}}'], 'line 1 needs a "custom_id"'),
        (["not json"], "line 1 is not valid JSON"),
        (['{"custom_id": "a", "url": "/v1/embeddings", "body": {}}'], 'only "method": "POST" to'),
    ],
)
def test_a_file_that_is_not_a_batch_is_refused_before_any_model_loads(tmp_path, capsys, lines, words):
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(lines))
    assert main(["batch", str(path), "--out", str(tmp_path / "out.jsonl"), "--target", "nowhere/none"]) == 1
    assert words in capsys.readouterr().err


def test_an_interrupt_ends_the_requests_decoding_instead_of_waiting_for_them(tmp_path):
    """Ctrl-C while requests decode: each ends at its next step (the server's ``gone``), so the job stops at once;
    what was written stays, the rest is answered by a rerun."""
    import threading
    import time

    from vlmspec_batch import BatchRequest, run_batch
    from vlmspec_caption.store import ResultWriter

    from vlmspec.openai_api import MediaAccess, chat_request

    ended = []

    class Server:  # the first request answers at once; the others decode until their client is gone
        model, media, max_tokens, batch_size = "m", MediaAccess(), 8, 3

        def chat_request(self, body):
            return chat_request(body, self.model, self.media, self.max_tokens)

        def complete(self, chat, gone):
            if chat.kwargs["messages"][0]["content"] == "fast":
                return {"object": "chat.completion"}
            deadline = (
                time.monotonic() + 10
            )  # a bound: without the interrupt's stop the test fails, not hangs
            while not gone() and time.monotonic() < deadline:
                time.sleep(0.01)
            if gone():
                ended.append(threading.current_thread().name)
            return None

    class Interrupting(ResultWriter):
        def write(self, record):
            super().write(record)
            raise KeyboardInterrupt

    todo = [BatchRequest(f"r{i}", {"messages": [{"role": "user", "content": "slow"}]}) for i in range(2)]
    todo.append(BatchRequest("fast", {"messages": [{"role": "user", "content": "fast"}]}))
    start = time.perf_counter()
    with Interrupting(tmp_path / "out.jsonl") as writer, pytest.raises(KeyboardInterrupt):
        run_batch(Server(), todo, writer)
    assert time.perf_counter() - start < 5 and len(ended) == 2
    assert [json.loads(line)["custom_id"] for line in (tmp_path / "out.jsonl").read_text().splitlines()] == [
        "fast"
    ]


def test_chat_template_replaces_the_processor_s_and_a_bad_one_is_refused(pair, pipe, tmp_path, capsys):
    """``--chat-template FILE`` (vLLM's flag, on every server front): requests are rendered with it, so each reply is
    what the pipeline gives under that template; a file that does not parse, or a name that is no file and no
    template, is refused before any model loads."""
    template = "{{ 'You answer in one word.' }}\n" + pipe.processor.chat_template
    (tmp_path / "template.jinja").write_text(template)
    line = request_line("q", messages=user_turn(png_uri(0), PROMPTS[0]), max_tokens=8)
    (tmp_path / "in.jsonl").write_text(line + "\n")
    out = tmp_path / "out.jsonl"
    assert run(pair, tmp_path / "in.jsonl", out, "--chat-template", str(tmp_path / "template.jinja")) == 0
    body = by_id(out)["q"]["response"]["body"]
    messages = [
        {
            "role": "user",
            "content": [{"type": "image", "image": png_uri(0)}, {"type": "text", "text": PROMPTS[0]}],
        }
    ]
    plain = pipe(messages=messages, max_new_tokens=8)
    saved, pipe.processor.chat_template = pipe.processor.chat_template, template
    try:
        expected = pipe(messages=messages, max_new_tokens=8)
    finally:
        pipe.processor.chat_template = saved
    assert body["choices"][0]["message"]["content"] == expected.text
    assert body["usage"]["prompt_tokens"] == expected.stats.prompt_tokens > plain.stats.prompt_tokens
    inline = (
        tmp_path / "inline.jsonl"
    )  # the template itself on the command line (thousands of characters, at times)
    assert (
        run(pair, tmp_path / "in.jsonl", inline, "--chat-template", template + "{# " + "x" * 5000 + " #}")
        == 0
    )
    assert by_id(inline)["q"]["response"]["body"]["choices"] == body["choices"]
    (tmp_path / "broken.jinja").write_text("{% if %}")
    assert (
        run(
            pair,
            tmp_path / "in.jsonl",
            tmp_path / "bad.jsonl",
            "--chat-template",
            str(tmp_path / "broken.jinja"),
        )
        == 1
    )
    assert "--chat-template: a request with one picture fails" in capsys.readouterr().err
    for flag, bad, said in [
        ("--chat-template", "no-such.jinja", "neither a template file nor a template"),
        ("--default-chat-template-kwargs", '{"tokenize": true}', "chat_template_kwargs sets tokenize"),
    ]:
        with pytest.raises(SystemExit):
            run(pair, tmp_path / "in.jsonl", tmp_path / "bad.jsonl", flag, bad)
        assert said in capsys.readouterr().err


def test_chat_template_gives_a_template_to_a_checkpoint_without_one(pair, pipe, tmp_path, capsys):
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(pair.target, bare)
    (bare / "chat_template.jinja").unlink()
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    line = request_line("q", messages=user_turn(png_uri(0), PROMPTS[0]), max_tokens=8)
    (tmp_path / "in.jsonl").write_text(line + "\n")
    (tmp_path / "template.jinja").write_text(pipe.processor.chat_template)
    args = ["batch", str(tmp_path / "in.jsonl"), "--target", str(bare), "--draft", str(pair.draft)]
    args += ["--max-tokens", "8", "--prefix-cache-gb", "0"]
    assert main([*args, "--out", str(tmp_path / "none.jsonl")]) == 1
    said = capsys.readouterr().err
    assert "has no chat template" in said and "--chat-template FILE" in said
    out = tmp_path / "out.jsonl"
    assert main([*args, "--out", str(out), "--chat-template", str(tmp_path / "template.jinja")]) == 0
    expected = pipe(messages=[{"role": "user", "content": [{"type": "image", "image": png_uri(0)},
                    {"type": "text", "text": PROMPTS[0]}]}], max_new_tokens=8)  # fmt: skip
    assert by_id(out)["q"]["response"]["body"]["choices"][0]["message"]["content"] == expected.text


def test_a_large_input_is_read_one_line_at_a_time(tmp_path):
    """A 24 MB input (400 requests of 60 kB each, as pictures inline make them): checking it, and going through its
    requests, holds one line at a time, not the file (tracemalloc's peak stays well under its size)."""
    import tracemalloc

    from vlmspec_batch import read_requests

    filler = "x" * 60_000
    lines = [
        json.dumps({"custom_id": f"r{i}", "body": {"messages": [{"role": "user", "content": filler}]}})
        for i in range(400)
    ]
    path = tmp_path / "big.jsonl"
    path.write_text("\n".join(lines) + "\n")
    size = path.stat().st_size
    tracemalloc.start()
    try:
        batch = read_requests(path)
        _, checked = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        seen = [request.custom_id for request in batch.requests(skip={"r1", "r399"})]
        _, decoded = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(batch) == 400 and seen == [f"r{i}" for i in range(400) if i not in (1, 399)]
    assert max(checked, decoded) < size / 20, (checked, decoded, size)
