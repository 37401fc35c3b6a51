"""Structured output through the router, driven by the official `openai`
client and LangChain, unmodified, against a real two-stage cluster serving
the instruction-tuned Qwen2.5-Coder 0.5B. Started by
tests/tests/openai_python.rs, which passes the base URL and the API key.

What a user would notice: every answer parses and fits the schema asked
for (types, required fields, enums), streamed or not; a bad schema or a
grammar in the wrong syntax is a 400 that names the field."""

import json

import jsonschema
import openai
import pytest

from common import BASE, KEY, MODEL, ask, client  # noqa: F401 (client: a fixture)

PET = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "species": {"type": "string", "enum": ["cat", "dog", "parrot"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 40},
    },
    "required": ["name", "species", "age"],
    "additionalProperties": False,
}


def test_json_schema_strict_answer_parses_and_validates(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=ask("Invent a pet. Reply in JSON."),
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "pet", "strict": True, "schema": PET},
        },
        max_tokens=80,
        temperature=0,
    )
    c = r.choices[0]
    assert c.finish_reason == "stop", c
    pet = json.loads(c.message.content)
    jsonschema.validate(pet, PET)


def test_json_schema_sampled_answers_validate(client):
    # Sampling at temperature 1 from a small model: without the grammar it
    # wanders off; with it every answer fits.
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL,
            messages=ask("Describe a pet as JSON."),
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "pet", "schema": PET},
            },
            max_tokens=80,
            temperature=1.0,
            seed=seed,
        )
        assert r.choices[0].finish_reason == "stop", r
        jsonschema.validate(json.loads(r.choices[0].message.content), PET)


def test_json_object_answer_is_an_object(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=ask("Give the capital of France as JSON."),
        response_format={"type": "json_object"},
        max_tokens=60,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "stop", r
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_streamed_json_schema_assembles_into_the_same_document(client):
    kwargs = dict(
        model=MODEL,
        messages=ask("Invent a dog. Reply in JSON."),
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "pet", "strict": True, "schema": PET},
        },
        max_tokens=80,
        temperature=0,
        # Both compute their whole prompt: the second would otherwise start
        # from the first's cached cells and decode the rest in other steps,
        # whose kernels can flip a near tie (docs/llama-cpp.md); that is the
        # prefix cache's business, not streaming's.
        extra_body={"cache_prompt": False},
    )
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    jsonschema.validate(json.loads(text), PET)


def test_completions_take_llama_cpp_json_schema_and_lark_grammar(client):
    r = client.completions.create(
        model=MODEL,
        prompt="Is the sky blue? Answer:",
        max_tokens=8,
        temperature=0,
        extra_body={"grammar": 'start: " yes" | " no"'},
    )
    assert r.choices[0].text in (" yes", " no"), r
    r = client.completions.create(
        model=MODEL,
        prompt="A pet as JSON:",
        max_tokens=80,
        temperature=0,
        extra_body={"json_schema": PET},
    )
    jsonschema.validate(json.loads(r.choices[0].text), PET)


def test_bad_schemas_and_grammars_are_400_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL,
            messages=ask("hi"),
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": 5}},
            },
            max_tokens=8,
        )
    assert e.value.body["param"] == "response_format", e.value.body
    assert "invalid JSON schema" in e.value.body["message"], e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=MODEL,
            prompt="x",
            max_tokens=4,
            extra_body={"grammar": 'root ::= "yes" | "no"'},
        )
    assert e.value.body["param"] == "grammar", e.value.body
    assert "Lark" in e.value.body["message"], e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=MODEL, prompt="x", max_tokens=4, extra_body={"grammar": "start: ("}
        )
    assert e.value.body["param"] == "grammar", e.value.body
    assert "invalid Lark grammar" in e.value.body["message"], e.value.body


def test_langchain_with_structured_output_json_schema():
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field
    from typing import Literal

    class Pet(BaseModel):
        name: str
        species: Literal["cat", "dog", "parrot"]
        age: int = Field(ge=0, le=40)

    llm = ChatOpenAI(
        base_url=BASE, api_key=KEY, model=MODEL, temperature=0, max_tokens=80, max_retries=0
    )
    pet = llm.with_structured_output(Pet, method="json_schema").invoke(
        "Invent a parrot."
    )
    assert isinstance(pet, Pet)
    assert pet.species in ("cat", "dog", "parrot")
