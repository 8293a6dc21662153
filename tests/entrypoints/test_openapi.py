"""/openapi.json tells the truth: schemathesis generates requests for every documented operation of a
real server (valid ones and broken ones) and checks that no answer is a 5xx and that every answer's
status, content type and body are the ones the schema documents.

The example count is bounded (a property test, not a fuzzing campaign) so the module takes about a
minute; a short context and the server's request timeout keep one generated request from running long.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.core.result import Ok
from servers import API_KEY, Server, auth

EXAMPLES_PER_OPERATION = 15
MAX_MODEL_LEN = 96
"""Bounds what one generated request can ask for (n up to 64 samples of up to this many tokens)."""
REQUEST_TIMEOUT_S = 10
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def server(tiny_gqa_dir, tmp_path_factory):
    srv = Server(
        tiny_gqa_dir,
        tmp_path_factory.mktemp("openapi") / "server.log",
        "--api-key",
        API_KEY,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--request-timeout",
        str(REQUEST_TIMEOUT_S),
        "--no-access-log",
    )
    yield srv
    srv.stop()


@pytest.mark.timeout(300)
def test_no_5xx_and_every_answer_is_documented(server):
    # the pytest plugin's lazy schema needs pytest internals that pytest 9 dropped: drive hypothesis directly
    api = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    results = list(api.get_all_operations())
    operations = [result.ok() for result in results if isinstance(result, Ok)]
    assert len(operations) == len(results) >= 10, results
    for operation in operations:
        cases = st.one_of(
            *(operation.as_strategy(mode) for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE))
        )

        @given(case=cases)
        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
            database=None,
            phases=[Phase.generate],  # shrinking a failure takes minutes; its curl line reproduces it
        )
        def answers_as_documented(case) -> None:
            case.call_and_validate(headers=auth(), checks=CHECKS, timeout=3 * REQUEST_TIMEOUT_S)

        answers_as_documented()


@pytest.mark.timeout(60)
def test_schema_documents_400_not_422_and_the_real_media_types(server):
    doc = httpx.get(f"{server.url}/openapi.json").json()
    for path, item in doc["paths"].items():
        for method, operation in item.items():
            assert "422" not in operation["responses"], (method, path)
    completions = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert completions["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert set(completions["200"]["content"]) == {"application/json", "text/event-stream"}
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    health = doc["paths"]["/health"]["get"]["responses"]
    assert health["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/HealthResponse")
    assert "503" in health
    assert "HTTPValidationError" not in doc["components"]["schemas"]
