"""The router driven by the official `openai` Python package, unmodified,
against a real cluster serving Gemma 3 270M. Started by
tests/tests/openai_python.rs, which passes the base URL and the API key."""

import json
import os

import openai
import pytest

BASE = os.environ["OMNI_BASE_URL"]
KEY = os.environ["OMNI_API_KEY"]
MODEL = "gemma3-270m"


@pytest.fixture(scope="module")
def client():
    return openai.OpenAI(base_url=BASE, api_key=KEY, max_retries=0, timeout=120)


def test_models(client):
    ids = [m.id for m in client.models.list()]
    assert MODEL in ids


def test_chat(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=8,
        temperature=0,
    )
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streaming_chat_matches_non_streaming(client):
    msgs = [{"role": "user", "content": "Write one sentence about the sea."}]
    # Both compute their whole prompt: a second one that started from the
    # first's cached cells would compute its last token in a one-row step,
    # whose kernels can flip a near tie (as llama-server's cache_prompt
    # can); that is the prefix cache's business, not streaming's.
    no_cache = {"cache_prompt": False}
    full = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=16, temperature=0, extra_body=no_cache
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=msgs,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=no_cache,
        )
    )
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completions(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].text
    assert r.usage.completion_tokens == 6 or r.choices[0].finish_reason == "stop"


def test_n_choices(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=6,
        n=3,
        temperature=1.0,
        seed=7,
    )
    assert [c.index for c in r.choices] == [0, 1, 2]


def test_stop_strings_never_leak(client):
    for stream in (False, True):
        args = dict(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=24, temperature=0, stop=[","])
        if stream:
            text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **args) if c.choices)
        else:
            text = client.completions.create(**args).choices[0].text
        assert "," not in text


def test_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        assert t.logprob <= 0
        assert len(t.top_logprobs) == 3
        # The chosen token is the most likely one under greedy decoding.
        assert t.top_logprobs[0].logprob >= t.logprob - 1e-4
    c = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0, logprobs=2)
    assert len(c.choices[0].logprobs.tokens) == 3
    assert all(len(m) == 2 for m in c.choices[0].logprobs.top_logprobs)


def test_seed_reproducibility(client):
    args = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a word."}], max_tokens=12, temperature=0.9, seed=1234)
    a = client.chat.completions.create(**args).choices[0].message.content
    b = client.chat.completions.create(**args).choices[0].message.content
    assert a == b


def test_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=5)
    assert "temperature" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="word " * 3000, max_tokens=4)
    assert "context" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
            max_tokens=4,
        )
    assert e.value.body["param"] == "tool_choice", e.value.body
    bad = openai.OpenAI(base_url=BASE, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_tools_on_a_template_without_tool_support(client):
    # Gemma's template knows no tools: they are described in a system
    # message and the answer is constrained to the generic JSON envelope.
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 20}},
                    "required": ["city"],
                    "additionalProperties": False,
                },
            },
        }
    ]
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=tools,
        tool_choice="required",
        max_tokens=120,
        temperature=0,
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    assert c.message.tool_calls[0].function.name == "get_weather"
    assert isinstance(json.loads(c.message.tool_calls[0].function.arguments)["city"], str)
