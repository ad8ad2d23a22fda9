"""Thinking models (:mod:`vlmspec.reasoning`): a reply's reasoning apart from its answer, whole and streamed, with
structured outputs and tool calls applied after ``</think>`` and the reply still the target's own.

The thinking pair is the tiny Qwen2-VL pair with ``<think>`` and ``</think>`` added to its vocabulary (both models'
embeddings and heads resized) and Qwen3's thinking chat template: the prompt opens the reasoning, or, with
``enable_thinking=False``, writes an empty one. The new rows are set (embeddings copied, the heads' rows the mean
of the others), and the random models reach ``</think>`` under a ``logit_bias`` towards it; the references are ``generate()`` under this file's own logits processor (the grammar after ``</think>``,
written apart from vlmspec's)."""

from __future__ import annotations

import json
import re
from concurrent.futures import Future
from functools import partial
from types import SimpleNamespace

import pytest
import torch
import xgrammar
import xgrammar.contrib.hf
from conftest import make_image
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_serving import png_uri, post, post_stream
from test_structured import grammar_of
from test_tool_calls import no_whitespace

from vlmspec import InputTypeError, InvalidInputError, ReasoningParser, VLMSpecPipeline
from vlmspec.openai_api import ChatRequest, MediaAccess
from vlmspec.openai_tools import tool_calling
from vlmspec.reasoning import ReplySplitter, reasoning_parser, reply_reasoning, split_reply
from vlmspec.serving import SpecServer
from vlmspec.structured import _unpack

QWEN3 = reasoning_parser("qwen3")
THINKING_PROMPT = (
    "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
ANSWER = {"regex": "(yes|no), (red|blue)"}
BIAS = 4.0
"""``logit_bias`` towards ``</think>``: the tiny models then reason for a few tokens before closing it."""


@pytest.fixture(scope="module")
def thinking(tiny_pairs):
    pair = tiny_pairs["qwen2_vl"]
    base = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="ar", torch_dtype=torch.float32)
    processor, tokenizer = base.processor, base.processor.tokenizer
    tokenizer.add_tokens(["<think>", "</think>"])
    for model in (base.target, base.draft):  # the new rows set, not drawn: the same models on every run
        old = model.get_input_embeddings().weight.shape[0]
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
        with torch.no_grad():
            model.get_input_embeddings().weight[old:] = model.get_input_embeddings().weight[:2]
            head = model.get_output_embeddings().weight  # not tied in the tiny pairs
            head[old:] = head[:old].mean(dim=0)
    template = processor.chat_template.replace("<|im_start|>assistant\n{% endif %}", THINKING_PROMPT)
    assert template != processor.chat_template
    processor.chat_template = tokenizer.chat_template = template
    pipe = VLMSpecPipeline(base.target, base.draft, processor, policy="sage")
    pipe.reasoning_parser = "qwen3"
    return pipe


def end_id(pipe) -> int:
    return pipe.tokenizer.convert_tokens_to_ids("</think>")


def messages(picture: int = 3, text: str = "Is it red?") -> list[dict]:
    return [
        {
            "role": "user",
            "content": [{"type": "image", "image": make_image(picture)}, {"type": "text", "text": text}],
        }
    ]


class GrammarAfterEnd:
    """The reference: ``generate()``'s logits untouched until the reply holds ``end``, then masked by a fresh
    xgrammar matcher fed the tokens after it (the test's own, not vlmspec's guide)."""

    def __init__(self, compiled, end: int) -> None:
        self.compiled, self.end, self.prompt = compiled, end, None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.prompt = input_ids.shape[1] if self.prompt is None else self.prompt
        reply = input_ids[0, self.prompt :].tolist()
        if self.end not in reply:
            return scores
        matcher = xgrammar.GrammarMatcher(self.compiled)
        assert all(matcher.accept_token(t) for t in reply[reply.index(self.end) + 1 :])
        bitmask = xgrammar.allocate_token_bitmask(1, scores.shape[-1])
        matcher.fill_next_token_bitmask(bitmask)
        return scores.masked_fill(~_unpack(bitmask, scores.shape[-1]), float("-inf"))


def reference(pipe, structure, max_new_tokens=24, **options) -> list[int]:
    """``generate()`` under the grammar after ``</think>`` (:class:`GrammarAfterEnd`), or, for a prompt that closed
    the reasoning (``enable_thinking=False``), under xgrammar's own processor from the first token."""
    inputs = pipe.prepare_messages(messages(), **options)
    compiled = grammar_of(pipe, structure).compiled
    closed = options.get("chat_template_kwargs", {}).get("enable_thinking") is False
    processor = (
        xgrammar.contrib.hf.LogitsProcessor(compiled) if closed else GrammarAfterEnd(compiled, end_id(pipe))
    )
    out = pipe.target.generate(
        **inputs, max_new_tokens=max_new_tokens, do_sample=False, logits_processor=[processor],
        sequence_bias={(end_id(pipe),): BIAS},
    )  # fmt: skip
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def saved_with_bias(thinking, folder, parser=None):
    """The thinking pair saved with a ``sequence_bias`` towards ``</think>`` in its generation config, so that the
    commands that load it reach ``</think>`` as the in-process calls do under ``logit_bias``, and with ``parser``
    as its reasoning parser (none: the commands' flag sets it)."""
    thinking.target.generation_config.sequence_bias = [[[end_id(thinking)], BIAS]]
    own, thinking.reasoning_parser = thinking.reasoning_parser, parser
    try:
        return thinking.save_pretrained(folder)
    finally:
        thinking.target.generation_config.sequence_bias = None
        thinking.reasoning_parser = own


def batch_command(folder, saved, out, *flags) -> list[str]:
    """``vlmspec batch`` on ``folder/in.jsonl`` with the saved pair, 24 tokens, no prefix cache, and ``flags``."""
    head = ["batch", str(folder / "in.jsonl"), "--out", str(out), "--target", str(saved)]
    return [*head, "--max-tokens", "24", "--prefix-cache-gb", "0", *flags]


# ---- the reply, split --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("I look.</think>yes", ("I look.", "yes")),
        ("\n <think>I look.</think>yes</think>", ("I look.", "yes</think>")),  # a <think> it opens itself
        ("I look <think>twice", ("I look <think>twice", "")),  # cut while reasoning: all reasoning
        ("</think>", ("", "")),
        ("", ("", "")),
    ],
)
def test_a_reply_splits_at_its_first_end_tag(text, expected):
    assert split_reply(QWEN3, text) == expected
    assert split_reply(None, text) == (None, text)


@pytest.mark.parametrize(
    ("prompt", "opens"),
    [
        ("<|im_start|>assistant\n<think>\n", True),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # enable_thinking=False
        ("<|im_start|>assistant\n", True),  # no tag: DeepSeek-R1 reasons without one
        ("<think>a</think> earlier turn <|im_start|>assistant\n<think>\n", True),
    ],
)
def test_a_reply_opens_in_reasoning_unless_the_prompt_closed_it(prompt, opens):
    assert QWEN3.opens_reasoning(prompt) is opens


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.sampled_from([" ", "\n", "<", "/", "think", ">", "<think>", "</think>", "</", "a", "b "]),
        max_size=14,
    ),
    st.data(),
)
@example(["<th", "ink>", "x</thi", "nk>y"], None)
@example([" ", "\n<", "thi"], None)
def test_the_streamed_reply_splits_as_the_whole_one_however_it_is_cut(parts, data):
    """Any text, cut into any pieces: the reasoning and content each side's pieces join to are :func:`split_reply`'s,
    and no piece of either is ever taken back (they are sent as they come)."""
    text = "".join(parts)
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)))) if data is not None else set())
    pieces = (
        [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        if data is not None
        else parts
    )
    splitter, reasoning, content = ReplySplitter(QWEN3), "", ""
    for piece in pieces:
        more_reasoning, more_content = splitter.feed(piece)
        reasoning, content = reasoning + more_reasoning, content + more_content
    assert (reasoning + splitter.finish(), content) == split_reply(QWEN3, text)


def test_parsers_are_found_by_name_and_bad_ones_refused(thinking):
    assert reasoning_parser("deepseek_r1").end == "</think>" and reasoning_parser(None) is None
    assert reasoning_parser("none") is None
    with pytest.raises(
        InvalidInputError,
        match=r"reasoning_parser='qwen' is not a parser; did you mean 'qwen3'\?: use a name",
    ):
        thinking.reasoning_parser = "qwen"
    with pytest.raises(InputTypeError, match="reasoning_parser=3 is not a parser: use a name"):
        thinking.reasoning_parser = 3
    with pytest.raises(InvalidInputError, match="end=''"):
        ReasoningParser("mine", end="")
    assert thinking.reasoning_parser is QWEN3  # a refused value leaves the parser as it was
    with pytest.raises(InvalidInputError, match=r"end tag '</answer>' to be one token.*spells it in \d+"):
        ReasoningParser("mine", "<answer>", "</answer>").end_token(thinking.tokenizer)


def test_chat_template_kwargs_reach_the_template_and_bad_ones_are_refused(thinking):
    closed = thinking.prepare_messages(messages(), chat_template_kwargs={"enable_thinking": False})[
        "input_ids"
    ]
    text = thinking.tokenizer.decode(closed[0])
    assert text.endswith("<think>\n\n</think>\n\n"), text[-40:]
    with pytest.raises(InvalidInputError, match="chat_template_kwargs sets add_generation_prompt, tools"):
        thinking(messages=messages(), chat_template_kwargs={"tools": [], "add_generation_prompt": False})
    with pytest.raises(InputTypeError, match="chat_template_kwargs=.* is invalid"):
        thinking(messages=messages(), chat_template_kwargs=["enable_thinking"])
    with pytest.raises(InvalidInputError, match="chat_template_kwargs go with messages"):
        thinking(make_image(0), "Hi.", chat_template_kwargs={"enable_thinking": False})


# ---- structured outputs after the reasoning -----------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["ar", "chain", "sage", "eagle2"])
def test_a_structure_applies_after_the_reasoning_and_the_reply_is_the_target_s_own(thinking, policy):
    thinking.policy = policy
    out = thinking(
        messages=messages(), max_new_tokens=24, structured_outputs=ANSWER, logit_bias={end_id(thinking): BIAS}
    )
    assert out.token_ids == reference(thinking, ANSWER)
    assert out.token_ids.index(end_id(thinking)) > 0  # it reasoned first, freely: no answer there
    assert not re.fullmatch("(yes|no), (red|blue)", out.reasoning) and out.reasoning
    assert re.fullmatch("(yes|no), (red|blue)", out.content), out.content
    assert out.text == f"{out.reasoning}</think>{out.content}"


def test_with_thinking_off_the_structure_applies_from_the_first_token(thinking):
    thinking.policy = "sage"
    out = thinking(
        messages=messages(), max_new_tokens=24, structured_outputs=ANSWER,
        logit_bias={end_id(thinking): BIAS}, chat_template_kwargs={"enable_thinking": False},
    )  # fmt: skip
    assert out.reasoning is None and out.content == out.text
    assert re.fullmatch("(yes|no), (red|blue)", out.text)
    assert out.token_ids == reference(thinking, ANSWER, chat_template_kwargs={"enable_thinking": False})


def test_reference_generate_applies_the_structure_after_the_reasoning_too(thinking):
    inputs = thinking.prepare_messages(messages())
    thinking.target.generation_config.sequence_bias = {(end_id(thinking),): BIAS}
    try:
        ids = thinking.reference_generate(inputs, 24, structured_outputs=ANSWER)
    finally:
        thinking.target.generation_config.sequence_bias = None
    assert ids == reference(thinking, ANSWER)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_while_reasoning_each_node_is_masked_by_the_grammar_after_the_first_end_on_its_path(thinking, data):
    """Any tree over tokens that include the end token: the verification's masks are, for every node, all-allowed
    while its path has not ended the reasoning, else a fresh matcher's after the tokens that follow the path's first
    end (all-allowed where the grammar rejects them); the draft's are all-allowed while the reply reasons."""
    grammar = grammar_of(thinking, ANSWER)
    end = end_id(thinking)
    vocab = sorted(
        {t for p in ["yes", "no", ",", " red", " blue", "x"] for t in thinking.tokenizer.encode(p)}
    )
    guide = grammar.after(QWEN3, thinking.tokenizer).start()
    n = data.draw(st.integers(1, 20))
    parents = [-1] + [data.draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = [0] + [data.draw(st.sampled_from([*vocab, end, end])) for _ in range(1, n)]
    expected = []
    for node in range(n):
        path = []
        while node > 0:
            path, node = [tokens[node], *path], parents[node]
        row = xgrammar.allocate_token_bitmask(1, grammar.width)
        if end in path:
            matcher = xgrammar.GrammarMatcher(grammar.compiled)
            if (
                all(matcher.accept_token(t) for t in path[path.index(end) + 1 :])
                and not matcher.is_terminated()
            ):
                matcher.fill_next_token_bitmask(row)
        expected.append(_unpack(row, grammar.width)[0])
    expected = torch.stack(expected)
    logits = torch.zeros(n, grammar.width)
    tree = type("Tree", (), {"tokens": torch.tensor(tokens), "parents": torch.tensor(parents)})
    assert torch.equal(guide.tree(logits, tree) == 0, expected)
    assert guide.allowed(torch.tensor(tokens), torch.tensor(parents), torch.arange(n)).all()


# ---- the server ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(thinking):
    with SpecServer(
        thinking, "thinking", port=0, batch_size=2, max_tokens=24, media=MediaAccess()
    ) as running:
        yield running


def body(**fields):
    turn = [{"type": "image_url", "image_url": {"url": png_uri(3)}}, {"type": "text", "text": "Is it red?"}]
    return {"messages": [{"role": "user", "content": turn}], "max_tokens": 24, **fields}


def test_the_server_gives_the_reasoning_apart_whole_and_streamed(server, thinking):
    thinking.policy = "sage"
    bias = {str(end_id(thinking)): BIAS}
    expected = thinking(messages=messages(), max_new_tokens=24, logit_bias={end_id(thinking): BIAS})
    assert expected.reasoning and expected.content
    status, reply = post(server, body(logit_bias=bias))
    message = reply["choices"][0]["message"]
    assert status == 200, reply
    assert (message["reasoning_content"], message["content"]) == (expected.reasoning, expected.content)
    assert message["reasoning"] == expected.reasoning
    deltas = [
        e["choices"][0]["delta"] for e in post_stream(server, body(logit_bias=bias))[:-1] if e["choices"]
    ]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == expected.reasoning
    assert "".join(d.get("content") or "" for d in deltas) == expected.content
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    status, reply = post(server, body(logit_bias=bias, chat_template_kwargs={"enable_thinking": False}))
    assert status == 200 and "reasoning_content" not in reply["choices"][0]["message"]


def test_a_forced_tool_call_is_decoded_after_the_reasoning(server, thinking):
    tool = {
        "type": "function",
        "function": {
            "name": "colour",
            "parameters": {
                "type": "object",
                "properties": {"c": {"enum": ["red", "blue"]}},
                "required": ["c"],
            },
        },
    }
    chosen = {"type": "function", "function": {"name": "colour"}}
    bias = {str(token): value for token, value in no_whitespace(thinking).items()} | {
        str(end_id(thinking)): BIAS
    }
    status, reply = post(server, body(tools=[tool], tool_choice=chosen, logit_bias=bias, max_tokens=40))
    assert status == 200, reply
    message = reply["choices"][0]["message"]
    (call,) = message["tool_calls"]
    assert json.loads(call["function"]["arguments"])["c"] in ("red", "blue")
    assert message["reasoning_content"], message


def test_a_bad_chat_template_kwargs_is_a_400_naming_it(server):
    status, reply = post(server, body(chat_template_kwargs={"tokenize": True}))
    assert status == 400 and reply["error"]["param"] == "chat_template_kwargs", reply


# ---- lmms-eval ----------------------------------------------------------------------------------------------------
def test_the_lmms_eval_model_scores_the_answer_after_the_reasoning(thinking, tmp_path):
    """``reasoning_parser=qwen3`` in ``--model_args``: a thinking model's reply is scored on its answer; without
    it, on the whole reply (the reasoning and ``</think>`` included). The pair is saved with a ``sequence_bias``
    towards ``</think>`` in its generation config, so the plugin's own calls reach it."""
    from lmms_eval.api.instance import Instance
    from vlmspec_eval.lmms.model import VLMSpec

    saved = saved_with_bias(thinking, tmp_path / "thinking")
    args = ("<image>\nIs it red?", {"max_new_tokens": 24}, lambda doc: [doc["image"]], 0, "t", "test")
    request = Instance("generate_until", args, idx=0, metadata={"task": "t", "doc_id": 0, "repeats": 1})
    replies = {}
    for parser in ("", ",reasoning_parser=qwen3"):
        lm = VLMSpec.create_from_arg_string(f"target={saved},speed_dir={tmp_path}{parser}", {"batch_size": 1})
        lm.task_dict = {"t": {"test": [{"image": make_image(3)}]}}
        (replies[parser],) = (r.text for r in lm.generate_until([request]))
    whole, answer = replies[""], replies[",reasoning_parser=qwen3"]
    assert "</think>" in whole and whole.index("</think>") > 0, whole
    assert answer.strip() == whole.split("</think>", 1)[1].strip() and answer.strip()


def test_a_bad_reasoning_parser_in_model_args_is_named():
    from vlmspec_eval.lmms import options

    with pytest.raises(
        InvalidInputError, match="reasoning_parser='qwen' is invalid: use one of qwen3, deepseek_r1"
    ):
        options.parse_model_args({"target": "tiny", "reasoning_parser": "qwen"})


def test_vlmspec_batch_takes_the_reasoning_parser_flag(thinking, tmp_path):
    """``--reasoning-parser`` (a flag of every server front, ``vlmspec serve`` and ``vlmspec batch``) reaches the
    server: a thinking pair saved with a bias towards ``</think>`` answers with its reasoning apart; so does one saved
    with its parser, without the flag; ``--reasoning-parser none`` drops a saved one."""
    from vlmspec.cli import main

    saved = saved_with_bias(thinking, tmp_path / "thinking")
    line = {"custom_id": "q", "method": "POST", "url": "/v1/chat/completions", "body": body()}
    (tmp_path / "in.jsonl").write_text(json.dumps(line) + "\n")
    expected = thinking(messages=messages(), max_new_tokens=24, logit_bias={end_id(thinking): BIAS})
    with_parser = saved_with_bias(thinking, tmp_path / "with-parser", parser="qwen3")
    runs = (([], saved), (["--reasoning-parser", "qwen3"], saved), ([], with_parser))
    for flag, folder in (*runs, (["--reasoning-parser", "none"], with_parser)):
        out = tmp_path / f"out{len(flag)}{folder.name}{''.join(flag)}.jsonl"
        assert main(batch_command(tmp_path, folder, out, *flag)) == 0
        message = json.loads(out.read_text())["response"]["body"]["choices"][0]["message"]
        if (flag, folder) in runs[1:]:  # the flag, or the saved pipeline's own parser (`none` drops it)
            assert (message["reasoning_content"], message["content"]) == (
                expected.reasoning,
                expected.content,
            )
        else:
            assert "reasoning_content" not in message and message["content"] == expected.text


# ---- the server's stream against its whole reply, on replayed replies ----------------------------------------------
def replay(thinking, text: str, cuts: list[int], stop: list[str], auto_tools: bool, opens: bool):
    """``SpecServer.stream`` and ``SpecServer._choice`` (as they are) on a reply replayed as text pieces cut at
    ``cuts`` after a prompt that opens the reasoning or closes it: the streamed (reasoning, content, calls), the
    whole reply's, and the streamed deltas."""
    prompt = "<|im_start|>assistant\n<think>\n" + ("" if opens else "\n</think>\n\n")
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    reasoning, content = split_reply(QWEN3 if opens else None, text)
    output = SimpleNamespace(text=text, token_ids=[5] * 3, reasoning=reasoning, content=content, stats=None)
    tools = tool_calling({"tools": [{"type": "function", "function": {"name": "f"}}]}) if auto_tools else None

    def submit(kwargs):
        future, streamer = Future(), kwargs["streamer"]
        streamer.put(torch.tensor(thinking.tokenizer.encode(prompt)))
        for piece in pieces:
            streamer.out.put(SimpleNamespace(text=piece, token_ids=[]))
        future.set_result(output)
        return future

    server = SimpleNamespace(pipe=thinking, model="m", _closing=False, eos_ids=(0,), submit=submit)
    server._reasoning = partial(SpecServer._reasoning, server)
    request = ChatRequest(kwargs={}, stream=True, stop=stop, max_tokens=100, tools=tools)
    sent: list[dict] = []
    SpecServer.stream(server, request, sent.append)
    deltas = [event["choices"][0]["delta"] for event in sent if event["choices"]]
    message = SpecServer._choice(server, 0, output, request)["message"]

    def parts(holder):
        calls = [call["function"]["name"] for call in holder.get("tool_calls") or []]
        return holder.get("reasoning_content") or "", holder.get("content") or "", calls

    streamed = (
        ["".join(part) for part in zip(*[parts(d)[:2] for d in deltas], strict=True)] if deltas else ["", ""]
    )
    return (*streamed, [c for d in deltas for c in parts(d)[2]]), parts(message), deltas


ATOMS = [
    "a",
    " b",
    "\n",
    "<think>",
    "</think>",
    "</",
    "think>",
    "<tool_call>",
    '{"name": "f", "arguments": {}}',
]
ATOMS += ["</tool_call>", "STOP", "ST", "OP", "<tool", "_call>"]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.sampled_from(ATOMS), max_size=10),
    st.data(),
    st.sampled_from([[], ["STOP"], ["OP", "b"]]),
    st.booleans(),
    st.booleans(),
)
def test_the_streamed_reply_is_the_whole_reply_with_stops_and_tool_calls(
    thinking, atoms, data, stop, tools, opens
):
    text = "".join(atoms)
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=6)))
    streamed, whole, _ = replay(thinking, text, cuts, stop, tools, opens)
    assert streamed == whole


def test_a_tool_call_tag_in_the_reasoning_does_not_hold_the_stream_back(thinking):
    """An ``auto`` tool call is looked for in the content only: reasoning that mentions ``<tool_call>`` streams on."""
    text = "I could answer with <tool_call> but first I look at the colour. It is red.</think>It is red."
    _, _, deltas = replay(thinking, text, list(range(4, len(text), 4)), [], True, True)
    reasoning = [d["reasoning_content"] for d in deltas if d.get("reasoning_content")]
    assert "".join(reasoning) == text.split("</think>")[0]
    assert len(reasoning) > 15, reasoning  # a piece each, not all at the end (held back, it came in 7)


def test_a_reply_with_no_answer_after_its_reasoning_has_null_content_as_vllm_s(thinking):
    for text in ("still thinking", "done</think>"):
        message = SpecServer._choice(
            SimpleNamespace(pipe=thinking, eos_ids=(0,)),
            0,
            SimpleNamespace(text=text, token_ids=[5], reasoning=split_reply(QWEN3, text)[0], stats=None),
            ChatRequest(kwargs={}, max_tokens=100),
        )["message"]
        assert message["content"] is None and message["reasoning_content"] == text.removesuffix("</think>")


def test_include_reasoning_false_leaves_the_reasoning_out(server, thinking):
    bias = {str(end_id(thinking)): BIAS}
    expected = thinking(messages=messages(), max_new_tokens=24, logit_bias={end_id(thinking): BIAS})
    status, reply = post(server, body(logit_bias=bias, include_reasoning=False))
    message = reply["choices"][0]["message"]
    assert status == 200 and "reasoning_content" not in message and message["content"] == expected.content
    deltas = [
        e["choices"][0]["delta"]
        for e in post_stream(server, body(logit_bias=bias, include_reasoning=False))[:-1]
    ]
    assert not any("reasoning_content" in d for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == expected.content


def test_enable_thinking_false_means_no_reasoning_even_where_the_template_writes_no_tag(thinking):
    prompt = thinking.tokenizer.encode("<|im_start|>assistant\n")  # a template that ignores enable_thinking
    assert reply_reasoning(QWEN3, thinking.tokenizer, prompt) is QWEN3
    assert reply_reasoning(QWEN3, thinking.tokenizer, prompt, {"enable_thinking": False}) is None


def test_template_variables_it_does_not_read_are_dropped_and_its_failures_are_the_caller_s(thinking):
    plain = thinking.prepare_messages(messages())["input_ids"]
    assert torch.equal(
        thinking.prepare_messages(messages(), chat_template_kwargs={"unread": 1})["input_ids"], plain
    )
    template = thinking.processor.chat_template
    thinking.processor.chat_template = (
        "{% if strict %}{{ raise_exception('strict mode is off') }}{% endif %}" + template
    )
    try:
        with pytest.raises(
            InvalidInputError, match=r"chat_template_kwargs=\{'strict': True\} made the chat template fail"
        ):
            thinking(messages=messages(), chat_template_kwargs={"strict": True})
    finally:
        thinking.processor.chat_template = template


def test_a_parser_whose_end_tag_the_reply_text_drops_is_refused(thinking):
    with pytest.raises(
        InvalidInputError, match=r"end tag '<\|vision_end\|>' is a special token of this tokenizer"
    ):
        thinking.reasoning_parser = ReasoningParser("vision", "<|vision_start|>", "<|vision_end|>")
    assert thinking.reasoning_parser is QWEN3


def test_the_caption_job_records_the_answer_as_the_caption_and_the_reasoning_apart(
    thinking, tmp_path, capsys
):
    """``vlmspec caption --reasoning-parser qwen3``: each line's caption is the answer after ``</think>``, its
    reasoning under ``reasoning``; the setting is recorded; a bad name is refused before any work."""
    import vlmspec_caption
    from test_video_captioning import _write_clips

    saved = saved_with_bias(thinking, tmp_path / "thinking")
    _write_clips(tmp_path / "videos", 2)
    argv = [str(tmp_path / "videos"), "--target", str(saved), "--max-new-tokens", "24", "--num-frames", "4"]
    argv += ["--no-progress", "--threads", "1"]
    runs = {}
    for flag in ([], ["--reasoning-parser", "qwen3"]):
        out = tmp_path / f"captions{len(flag)}.jsonl"
        assert vlmspec_caption.main([*argv, "--out", str(out), *flag]) == 0
        runs[bool(flag)] = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    for key, whole in runs[False].items():
        split = runs[True][key]
        assert "</think>" in whole["caption"] and "reasoning" not in whole
        assert f"{split['reasoning']}</think>{split['caption']}" == whole["caption"]
        assert split["settings"]["reasoning_parser"] == "qwen3"
    cut = [*argv[:4], "3", *argv[5:], "--out", str(tmp_path / "cut.jsonl"), "--reasoning-parser", "qwen3"]
    assert vlmspec_caption.main(cut) == 2  # 3 tokens: the replies end while reasoning, no caption to record
    for record in map(json.loads, (tmp_path / "cut.jsonl").read_text().splitlines()):
        assert "caption" not in record and record["error"].startswith(
            "no caption: the reply ended while reasoning"
        )
    (tmp_path / "job.yaml").write_text("reasoning_parser: qwen\n")
    bad = [*argv, "--out", str(tmp_path / "bad.jsonl"), "--config", str(tmp_path / "job.yaml")]
    assert vlmspec_caption.main(bad) == 1
    assert "reasoning_parser must be one of qwen3, deepseek_r1, none, got 'qwen'" in capsys.readouterr().err
    assert not (tmp_path / "bad.jsonl").exists()


def test_the_server_s_default_template_variables_apply_under_the_request_s_own(thinking, tmp_path):
    """``--default-chat-template-kwargs '{"enable_thinking": false}'``: replies have no reasoning part, unless a
    request's own ``chat_template_kwargs`` turn thinking back on."""
    from vlmspec.cli import main

    saved = saved_with_bias(thinking, tmp_path / "thinking")
    lines = [
        {"custom_id": "off", "method": "POST", "url": "/v1/chat/completions", "body": body()},
        {"custom_id": "on", "method": "POST", "url": "/v1/chat/completions",
         "body": body(chat_template_kwargs={"enable_thinking": True})},
    ]  # fmt: skip
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    flags = ["--reasoning-parser", "qwen3", "--default-chat-template-kwargs", '{"enable_thinking": false}']
    assert main(batch_command(tmp_path, saved, out, *flags)) == 0
    replies = {
        r["custom_id"]: r["response"]["body"]["choices"][0]["message"] for r in map(json.loads, out.open())
    }
    assert "reasoning_content" not in replies["off"] and replies["off"]["content"]
    assert replies["on"]["reasoning_content"] and "</think>" not in replies["on"]["reasoning_content"]


def test_pipe_stream_pieces_carry_the_reasoning_and_the_answer_apart(thinking, tiny_pairs):
    """``pipe.stream``: each piece's ``reasoning`` and ``content`` join to the reply's, the texts to the whole; with
    thinking off (and on a pipeline with no parser) the reasoning stays empty and the content is the text."""
    options = {"messages": messages(), "max_new_tokens": 24, "logit_bias": {end_id(thinking): BIAS}}
    for variables, split in ((None, True), ({"enable_thinking": False}, False)):
        out = thinking(**options, chat_template_kwargs=variables)
        pieces = list(thinking.stream(**options, chat_template_kwargs=variables))
        assert len(pieces) > 2 and "".join(p.text for p in pieces) == out.text
        assert "".join(p.reasoning for p in pieces) == (out.reasoning or "")
        assert "".join(p.content for p in pieces) == out.content
        assert bool(out.reasoning) is split
    pair = tiny_pairs["qwen2_vl"]
    plain = VLMSpecPipeline.from_pretrained(
        pair.target, pair.draft, policy="chain", torch_dtype=torch.float32
    )
    pieces = list(plain.stream(messages=messages(), max_new_tokens=12))
    assert all(p.reasoning == "" and p.content == p.text for p in pieces)
