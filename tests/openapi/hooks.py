"""schemathesis hooks for tests/tests/schemathesis.rs (loaded through SCHEMATHESIS_HOOKS,
with this directory on PYTHONPATH and the served model's name in OMNI_SCHEMATHESIS_MODEL).

- `before_call` edits request bodies (see its docs).
- `openai_error_shape` is a check: the spec documents only the 200 of each operation, so
  schemathesis validates no error body. This one does: every 4xx or 5xx must carry OpenAI's
  error body `{"error": {"message", "type", "param", "code"}}`, validated against the spec's
  own `ErrorResponse` schema, which scripts/openai-spec keeps in openai.yaml for it.
"""

import itertools
import os
import pathlib

import jsonschema_rs
import schemathesis
import yaml

_SPEC = pathlib.Path(__file__).with_name("openai.yaml")
_MODEL = os.environ["OMNI_SCHEMATHESIS_MODEL"]
_calls = itertools.count()


@schemathesis.hook
def before_call(context, case, kwargs):
    """Two edits to a request body before it is sent. Neither makes a valid request invalid
    or an invalid one valid (and schemathesis revalidates the case after this hook).

    - The served model, wherever the request names a model. The spec allows any string, so
      almost every request would name an unknown model, get its 404 before anything else is
      looked at, and never reach validation or the cluster. Only a string is replaced: a
      request without `model`, or with one that is not a string, stays as generated.
      (schemathesis's `[parameters] "body.model"` setting would do it, but only for some
      phases.)
    - `"stream": true` in every other request that leaves it out, null or false: generated
      requests almost never stream, and the streams' events are checked too.
    """
    body = case.body
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str):
        body["model"] = _MODEL
    stream = body.get("stream")
    if (stream is None or stream is False) and next(_calls) % 2 == 1:
        body["stream"] = True


def _error_validator():
    schemas = yaml.safe_load(_SPEC.read_text(encoding="utf-8"))["components"]["schemas"]
    # ErrorResponse refers to Error as '#/components/schemas/Error'; keep that layout.
    root = {
        "$ref": "#/components/schemas/ErrorResponse",
        "components": {"schemas": {n: schemas[n] for n in ("ErrorResponse", "Error")}},
    }
    return jsonschema_rs.Draft202012Validator(root)


_ERROR = _error_validator()


@schemathesis.check
def openai_error_shape(ctx, response, case):
    """A 4xx or 5xx answers with OpenAI's error body, as JSON."""
    if response.status_code < 400:
        return None
    content_type = response.headers.get("content-type", [""])[0]
    if not content_type.startswith("application/json"):
        raise AssertionError(
            f"{response.status_code} has Content-Type `{content_type}`, not application/json"
        )
    try:
        body = response.json()
    except ValueError as e:
        raise AssertionError(f"{response.status_code} body is not JSON: {e}") from None
    errors = [e.message for e in _ERROR.iter_errors(body)]
    if errors:
        raise AssertionError(
            f"{response.status_code} body is not OpenAI's error shape: {'; '.join(errors)}"
        )
    return None
