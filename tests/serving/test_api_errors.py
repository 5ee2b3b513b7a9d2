"""The shape of the router's 400 answers for FastAPI's own request validation (no Ray): a field's
error names the field, a body that is not JSON names the body and where it broke."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.testclient import TestClient
from pydantic import BaseModel

from deployments.api.errors import validation_error_handler


class _Body(BaseModel):
    prompt: str


def _client() -> TestClient:
    app = FastAPI()
    app.add_exception_handler(RequestValidationError, validation_error_handler)

    @app.post("/v1/completions")
    def completions(body: _Body) -> dict:
        return {}

    return TestClient(app)


def test_a_body_that_is_not_json_is_named_as_the_body() -> None:
    response = _client().post(
        "/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "body"
    assert error["message"] == "body: not valid JSON at character 11: Expecting value"


def test_a_bad_field_is_named_with_its_value() -> None:
    response = _client().post("/v1/completions", json={"prompt": 3})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "prompt"
    assert error["message"] == "prompt=3: Input should be a valid string"
