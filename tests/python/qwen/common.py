"""What both Qwen test files share: where the router is (the base URL and
API key tests/tests/openai_python.rs passes), the model, a client, a
one-message conversation."""

import os

import openai
import pytest

BASE = os.environ["OMNI_BASE_URL"]
KEY = os.environ["OMNI_API_KEY"]
MODEL = "qwen2.5-coder-0.5b"


@pytest.fixture(scope="module")
def client():
    return openai.OpenAI(base_url=BASE, api_key=KEY, max_retries=0, timeout=300)


def ask(content):
    return [{"role": "user", "content": content}]
