"""D. Schemathesis fuzzes every operation of the app's OpenAPI schema in-process: no 5xx, responses as documented."""
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from app.main import create_app

TOKEN = "schema-token"
CASES = []


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    return create_app(tmp_path_factory.mktemp("home"), TOKEN)


# /wait holds the request open until a run ends: the fuzzer would spend its time waiting (tested in test_app_api)
schema = schemathesis.pytest.from_fixture("openapi").exclude(
    path=["/api/v1/runs/{run_id}/wait", "/api/v1/evals/{eval_id}/wait"])


@pytest.fixture(scope="module")
def openapi(app):
    loaded = schemathesis.openapi.from_asgi("/openapi.json", app)
    # the test sends the token itself (below); without this the fuzzer counts a request it sent without the
    # Authorization header as "accepted although invalid"
    loaded.config.generation.update(with_security_parameters=False)
    return loaded


@pytest.mark.slow  # two minutes of fuzzing: in the slow pass, beside the other long checks
@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_api_fuzz(case):
    CASES.append(case.operation.label)
    excluded = [schemathesis.checks.allow_header_conformance]  # FastAPI's 405 has no Allow header
    if case.operation.label in ("POST /api/v1/runs", "POST /api/v1/evals", "POST /api/v1/external-runs",
                                "POST /api/v1/sweeps"):
        # a config that fits the JSON schema may still be refused: the env must be registered, and cross-field
        # rules (group_size >= 2 for group estimators, env_args the env accepts; a sweep's config and params) are
        # beyond JSON Schema
        excluded.append(schemathesis.checks.positive_data_acceptance)
    if case.operation.label == "GET /api/v1/health":
        excluded.append(schemathesis.checks.not_a_server_error)  # no daemon here: a documented 503 `degraded`
    case.call_and_validate(headers={"Authorization": f"Bearer {TOKEN}"}, excluded_checks=excluded)


@pytest.mark.slow  # with the fuzzing above
def test_zz_fuzzing_ran(capsys):
    """The count for the report (pytest -s shows it); and proof that the fuzzing above did run."""
    assert CASES, "the fuzz test above did not run"
    with capsys.disabled():
        print(f"\nschemathesis: {len(CASES)} cases over {len(set(CASES))} operations, 0 server errors")
    assert len(set(CASES)) >= 15
