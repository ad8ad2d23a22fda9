"""OpenAI's tool calling through ``vlmspec serve`` (:mod:`vlmspec.openai_tools`): a forced call is decoded under the
tool's schema, ``auto`` replies are read for Hermes-format calls, tool turns go to the chat template, and every
reply is what the pipeline gives for the same messages, tools and structure."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_image
from test_serving import png_uri, post, post_stream, user_turn

from vlmspec import InputTypeError, InvalidInputError, VLMSpecPipeline
from vlmspec.openai_api import APIError, MediaAccess, chat_request
from vlmspec.openai_tools import ToolCalling
from vlmspec.serving import SpecServer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"enum": [1, 2, 3]}},
            "required": ["city", "days"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
TOOLS = [WEATHER, TIME]
HERMES = r'Sure\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [123]\}\}</tool_call>'


@pytest.fixture(scope="module")
def pipe(tiny_pairs):
    pair = tiny_pairs["qwen2_vl"]
    return VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="sage", torch_dtype=torch.float32)


@pytest.fixture(scope="module")
def server(pipe):
    with SpecServer(pipe, "tiny", port=0, batch_size=2, max_tokens=48, media=MediaAccess()) as running:
        yield running


def reference(pipe, max_new_tokens=48, **options):
    content = [{"type": "image", "image": make_image(3)}, {"type": "text", "text": "What is the weather?"}]
    return pipe(
        messages=[{"role": "user", "content": content}], max_new_tokens=max_new_tokens, tools=TOOLS, **options
    )


def no_whitespace(pipe) -> dict[str, float]:
    """``logit_bias`` against every whitespace-only token: the tiny model's forced JSON then ends well within the
    reply's tokens (left free, it favours whitespace, which a JSON grammar allows anywhere)."""
    tokenizer = pipe.tokenizer
    return {i: -100.0 for i in range(len(tokenizer)) if not tokenizer.decode([i]).strip()}


def body(max_tokens=48, **fields):
    return {
        "messages": user_turn(png_uri(3), "What is the weather?"),
        "max_tokens": max_tokens,
        "tools": TOOLS,
        **fields,
    }


def test_a_named_tool_choice_is_one_call_under_the_tool_s_schema(server, pipe):
    named = {"type": "function", "function": {"name": "get_weather"}}
    bias = no_whitespace(pipe)
    expected = reference(
        pipe, structured_outputs={"json": WEATHER["function"]["parameters"]}, logit_bias=bias
    )
    assert json.loads(expected.text)["city"] in ("Paris", "Rome")  # a whole call
    wire_bias = {str(token): value for token, value in bias.items()}
    status, reply = post(server, body(tool_choice=named, logit_bias=wire_bias))
    message, reason = reply["choices"][0]["message"], reply["choices"][0]["finish_reason"]
    assert status == 200 and message["content"] is None and len(message["tool_calls"]) == 1
    call = message["tool_calls"][0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": json.dumps(json.loads(expected.text))}
    assert reason == "stop"  # OpenAI's reason for a forced call
    events = post_stream(server, body(tool_choice=named, logit_bias=wire_bias))
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    assert not any(d.get("content") for d in deltas)  # a forced call sends no text
    (streamed,) = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert streamed[0]["index"] == 0 and streamed[0]["function"] == call["function"]
    assert events[-2]["choices"][0]["finish_reason"] == reason
    status, free = post(server, body(tool_choice=named))  # whitespace left free: cut at max_tokens, no call
    unbiased = reference(pipe, structured_outputs={"json": WEATHER["function"]["parameters"]})
    assert free["choices"][0]["message"] == {"role": "assistant", "content": unbiased.text}
    assert free["choices"][0]["finish_reason"] == "length"


def test_required_is_an_array_of_calls_each_under_its_tool_s_schema(server, pipe):
    tools, bias = (
        ToolCalling(tuple(TOOLS), "required", parallel=False),
        no_whitespace(pipe),
    )  # one call: it ends
    calls = json.loads(reference(pipe, structured_outputs=tools.structure(), logit_bias=bias).text)
    wire_bias = {str(token): value for token, value in bias.items()}
    status, reply = post(
        server, body(tool_choice="required", parallel_tool_calls=False, logit_bias=wire_bias)
    )
    message = reply["choices"][0]["message"]
    assert (
        status == 200 and message["content"] is None and reply["choices"][0]["finish_reason"] == "tool_calls"
    )
    assert [c["function"]["name"] for c in message["tool_calls"]] == [c["name"] for c in calls]
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [
        c["parameters"] for c in calls
    ]


def test_auto_reads_hermes_calls_from_the_reply_whole_and_streamed(server, pipe):
    """The reply is made to call a tool (a regex structure spelling the Hermes format): its text before the call is
    the content, the call a tool call; the free reply without the structure is plain content."""
    expected = reference(pipe, 160, structured_outputs={"regex": HERMES})
    city = json.loads(expected.text.split("<tool_call>")[1].split("</tool_call>")[0])["arguments"]
    status, reply = post(server, body(160, structured_outputs={"regex": HERMES}))
    message = reply["choices"][0]["message"]
    assert (
        status == 200
        and message["content"] == "Sure. "
        and reply["choices"][0]["finish_reason"] == "tool_calls"
    )
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == city
    events = post_stream(server, body(160, structured_outputs={"regex": HERMES}))
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == "Sure. "  # as the whole reply's
    assert [d["tool_calls"][0]["function"]["name"] for d in deltas if "tool_calls" in d] == ["get_weather"]
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"
    status, plain = post(server, body())
    assert plain["choices"][0]["message"]["content"] == reference(pipe).text
    assert "tool_calls" not in plain["choices"][0]["message"]


def test_a_conversation_with_tool_turns_is_the_pipeline_s_reply_to_it(server, pipe):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    turns = [
        *user_turn(png_uri(3), "What time is it?"),
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    status, reply = post(server, {"messages": turns, "max_tokens": 12, "tools": TOOLS, "tool_choice": "none"})
    content = [{"type": "image", "image": make_image(3)}, {"type": "text", "text": "What time is it?"}]
    messages = [{"role": "user", "content": content}, {**turns[1], "content": ""}, turns[2]]
    expected = pipe(messages=messages, tools=TOOLS, max_new_tokens=12)
    assert status == 200 and reply["choices"][0]["message"]["content"] == expected.text
    template = pipe.processor.apply_chat_template(messages, tokenize=False)
    assert "12:00" in template and "<|im_start|>tool" in template


def test_the_openai_client_reads_the_calls(server, pipe):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    named = {"type": "function", "function": {"name": "get_weather"}}
    bias = no_whitespace(pipe)
    wire_bias = {str(token): value for token, value in bias.items()}
    reply = client.chat.completions.create(model="tiny", **body(tool_choice=named, logit_bias=wire_bias))
    (call,) = reply.choices[0].message.tool_calls
    expected = reference(
        pipe, structured_outputs={"json": WEATHER["function"]["parameters"]}, logit_bias=bias
    )
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == json.loads(
        expected.text
    )
    stream = client.chat.completions.create(
        model="tiny", stream=True, **body(tool_choice=named, logit_bias=wire_bias)
    )
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    (streamed,) = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert streamed.function.name == "get_weather" and streamed.function.arguments == call.function.arguments


def test_hermes_blocks_become_calls_only_when_they_name_a_tool():
    auto = ToolCalling(tuple(TOOLS), "auto")
    two = 'Hi <tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>{"name": "get_weather", ' \
          '"arguments": {"city": "Rome"}}</tool_call>'  # fmt: skip
    content, calls = auto.calls(two)
    assert content == "Hi " and [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    cut = '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool'  # cut inside the tag
    assert auto.calls(cut)[1][0]["function"]["arguments"] == '{"city": "Zürich"}'  # not escaped
    named = ToolCalling(tuple(TOOLS), "get_weather")
    assert named.calls('{"city": "') == (
        '{"city": "',
        [],
    )  # cut short: no whole call, the text is the content
    assert named.calls('{"city": "Rome"}')[1][0]["function"]["arguments"] == '{"city": "Rome"}'
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Rome"}
    assert len(ToolCalling(tuple(TOOLS), "auto", parallel=False).calls(two)[1]) == 1
    for text in ('<tool_call>{"name": "other"}</tool_call>', "<tool_call>{not json", "plain"):
        assert auto.calls(text) == (text, [])
    assert ToolCalling(tuple(TOOLS), "none").calls(two) == (two, [])
    one = ToolCalling(tuple(TOOLS), "required", parallel=False).structure()
    assert one.json and json.loads(one.json)["maxItems"] == 1


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"tool_choice": "required", "tools": None}, "tool_choice", "needs tools"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not one of the tools",
        ),
        ({"tool_choice": "sometimes"}, "tool_choice", "use none, auto, required"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools", "non-empty string 'name'"),
        ({"tools": [{"type": "code"}]}, "tools", 'use {"type": "function"'),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "leave out",
        ),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages", "tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages", "assistant turns"),
        ({"functions": [{"name": "f"}]}, "functions", "does not implement"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
            "tools",
            "JSON schema",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
                "tool_choice": "required",
            },
            "tools",
            "JSON schema",
        ),
    ],
)
def test_bad_tool_requests_are_refused_naming_the_field(fields, param, words):
    request = {"messages": user_turn("data:,x"), "tools": TOOLS, **fields}
    with pytest.raises(APIError, match=words) as refused:
        chat_request({k: v for k, v in request.items() if v is not None}, "tiny", MediaAccess(), 8)
    assert refused.value.param == param


def test_the_pipeline_takes_tools_with_messages_only(pipe):
    with pytest.raises(InvalidInputError, match="tools go with messages"):
        pipe(make_image(0), "Hi.", tools=TOOLS)
    with pytest.raises(InputTypeError, match="use a list of function specs"):
        pipe(messages=[{"role": "user", "content": "Hi."}], tools={"type": "function"})
