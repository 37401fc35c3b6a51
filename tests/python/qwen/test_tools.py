"""Tool calling through the router with the official `openai` client and
LangChain, unmodified, against the instruction-tuned Qwen2.5-Coder 0.5B on
two stages (started by tests/tests/openai_python.rs). The tools go into the
prompt through the model's own chat template; its `<tool_call>` blocks come
back as OpenAI's `tool_calls`."""

import json

import jsonschema
import openai
import pytest

from common import BASE, KEY, MODEL, ask, client  # noqa: F401 (client: a fixture)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string"}},
            "required": ["timezone"],
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def check_calls(message):
    assert message.tool_calls, message
    for c in message.tool_calls:
        assert c.type == "function"
        assert c.id.startswith("call_")
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
    assert len({c.id for c in message.tool_calls}) == len(message.tool_calls)


def test_required_gives_a_valid_call(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=ask("What is the weather like in Paris?"),
        tools=TOOLS,
        tool_choice="required",
        max_tokens=100,
        temperature=0,
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    check_calls(c.message)


def test_named_function_is_the_one_called_with_enum_respected(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=ask("I am going to Tokyo tomorrow."),
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
        max_tokens=100,
        temperature=0,
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    check_calls(c.message)
    assert [t.function.name for t in c.message.tool_calls] == ["get_weather"]
    args = json.loads(c.message.tool_calls[0].function.arguments)
    assert args["unit"] in ("celsius", "fahrenheit")


def test_none_answers_in_text(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=ask("Say hello."),
        tools=TOOLS,
        tool_choice="none",
        max_tokens=30,
        temperature=0,
    )
    c = r.choices[0]
    assert not c.message.tool_calls
    assert c.message.content
    assert c.finish_reason in ("stop", "length")


def test_auto_calls_parse_or_answer_in_text(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=ask("What time is it in Europe/Berlin? Use the tools."),
        tools=TOOLS,
        max_tokens=100,
        temperature=0,
    )
    c = r.choices[0]
    if c.finish_reason == "tool_calls":
        check_calls(c.message)
    else:
        assert c.message.content, c
        assert "<tool_call>" not in c.message.content or c.finish_reason == "length"


def test_round_trip_with_a_tool_result(client):
    msgs = ask("What is the weather like in Paris, in celsius?")
    first = client.chat.completions.create(
        model=MODEL, messages=msgs, tools=TOOLS, tool_choice="required", max_tokens=100, temperature=0
    )
    call = first.choices[0].message.tool_calls[0]
    msgs.append(first.choices[0].message.model_dump(exclude_none=True))
    msgs.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})})
    second = client.chat.completions.create(
        model=MODEL, messages=msgs, tools=TOOLS, max_tokens=60, temperature=0
    )
    c = second.choices[0]
    assert c.message.content, c
    assert "21" in c.message.content, c.message.content


def test_streamed_tool_call_deltas_assemble_into_the_same_call(client):
    kwargs = dict(
        model=MODEL,
        messages=ask("What is the weather like in Oslo?"),
        tools=TOOLS,
        tool_choice="required",
        max_tokens=100,
        temperature=0,
    )
    full = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls = {}
    finish = None
    fragments = 0
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                if d.index not in calls:
                    # The first delta of a call has its id and name.
                    assert d.id and d.function.name, d
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                calls[d.index]["arguments"] += d.function.arguments or ""
                fragments += 1 if d.function.arguments else 0
    assert finish == "tool_calls"
    # A forced call streams its arguments as they are written.
    assert fragments > len(calls), fragments
    got = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    want = [(c.function.name, json.loads(c.function.arguments)) for c in full]
    assert got == want


def test_unknown_named_tool_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL,
            messages=ask("hi"),
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "launch_rocket"}},
            max_tokens=8,
        )
    assert e.value.body["param"] == "tool_choice", e.value.body
    assert "launch_rocket" in e.value.body["message"]


def test_langchain_bind_tools_with_a_forced_tool():
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return "sunny"

    llm = ChatOpenAI(
        base_url=BASE, api_key=KEY, model=MODEL, temperature=0, max_tokens=100, max_retries=0
    )
    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(
        "What is the weather in Rome?"
    )
    assert msg.tool_calls, msg
    assert msg.tool_calls[0]["name"] == "get_weather"
    assert isinstance(msg.tool_calls[0]["args"]["city"], str)
