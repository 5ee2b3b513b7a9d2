"""The shape of the router's 400 answers for FastAPI's own request validation (no Ray): a field's
error names the field, a body that is not JSON names the body and where it broke. An error no
route answered: 503 and retryable when a replica was lost for good, else 500."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.testclient import TestClient
from pydantic import BaseModel
from ray.exceptions import ActorDiedError

from deployments.api.errors import unhandled_error_handler, validation_error_handler


class _Body(BaseModel):
    prompt: str


def _client() -> TestClient:
    app = FastAPI()
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(Exception, unhandled_error_handler)

    @app.post("/v1/completions")
    def completions(body: _Body) -> dict:
        if body.prompt == "lost":  # as the router's call raises it once its retries are spent
            try:
                raise ActorDiedError()
            except ActorDiedError as died:
                raise RuntimeError("the verifier's call failed") from died
        if body.prompt == "bug":
            raise KeyError("x")
        return {}

    return TestClient(app, raise_server_exceptions=False)


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


def test_a_replica_lost_for_good_is_a_retryable_503_and_a_bug_a_500() -> None:
    lost = _client().post("/v1/completions", json={"prompt": "lost"})
    assert lost.status_code == 503
    assert lost.headers["Retry-After"] == "5"
    error = lost.json()["error"]
    assert error["type"] == "replica_unavailable"
    assert "(ActorDiedError)" in error["message"] and "retry the request" in error["message"]
    bug = _client().post("/v1/completions", json={"prompt": "bug"})
    assert bug.status_code == 500
    assert bug.json()["error"] == {
        "message": "internal error: KeyError",
        "type": "server_error",
        "param": None,
        "code": None,
    }
