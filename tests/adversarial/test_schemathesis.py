"""Property-based conformance of the running daemon to its own OpenAPI document.

Schemathesis generates valid and invalid requests for every operation of
/openapi.json (operator credential attached) and runs every response check:
no 5xx, status codes, content types, headers and bodies as documented. The
daemon runs as a child process (schemathesis calls synchronously), with PATH
emptied and any generated `process` argv replaced by /bin/true, so generated
submissions cannot run anything of consequence.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import urllib.parse
from collections.abc import Iterator
from typing import Any

import httpx
import hypothesis
import hypothesis.errors
import psutil  # type: ignore[import-untyped,unused-ignore]
import pytest
import requests
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Ok
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    positive_data_acceptance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from api.openapi import openapi_document
from tests.adversarial.fixtures import descendants, subprocess_node
from tests.helpers import clean_env

# One worker runs the whole file, against one daemon.
pytestmark = [pytest.mark.hostile("api"), pytest.mark.xdist_group("schemathesis")]


@schemathesis.check
def negative_data_refused(ctx: Any, response: Any, case: Any) -> bool | None:
    """Invalid data is refused; a body too large to read (413) is refused before it is
    looked at, which schemathesis's own list of refusing statuses leaves out."""
    if response.status_code == 413:
        return True
    result: bool | None = negative_data_rejection(ctx, response, case)
    return result


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
    negative_data_refused,
]
# positive_data_acceptance is left out on purpose: a valid submission may be refused
# for capacity (409), load (429) or a reused id (409), all documented statuses.
assert positive_data_acceptance not in CHECKS
SENT = [0]  # cases sent by this process: each conformance test checks it sent some
MAX_EXAMPLES = int(os.environ.get("SCHEMATHESIS_EXAMPLES", "25"))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    state = tmp_path_factory.mktemp("schemathesis")
    empty = state / "empty-path"
    empty.mkdir()
    env = clean_env(PATH=str(empty))
    # With no PATH, the sandbox tool is named by its full path.
    bwrap = shutil.which("bwrap") or "bwrap"
    with subprocess_node(
        state / "state", "--max-queued", "8", "--sandbox-tool", bwrap, env=env
    ) as (proc, url, op):
        yield url, op
        leftovers = descendants(proc.pid)
        for child in leftovers:
            # A ready sandbox's processes go with its bubblewrap: one may be gone already.
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()


SCHEMA = schemathesis.openapi.from_dict(openapi_document())
# GET /v1/events is an endless stream (a body schemathesis would wait on forever); its
# refusals (401, 429) are covered in test_exhaustion.py.
STREAMS = {"/v1/events"}
OPERATIONS = [
    result.ok()
    for result in SCHEMA.get_all_operations()
    if isinstance(result, Ok) and result.ok().path not in STREAMS
]
assert len(OPERATIONS) == sum(1 for _ in SCHEMA.get_all_operations()) - len(STREAMS)


def _defang(body: Any) -> None:
    """Keep a *valid* process argv valid but harmless; leave invalid ones as generated."""
    if not isinstance(body, dict):
        return
    work = body.get("work")
    if not isinstance(work, dict) or work.get("kind") != "process":
        return
    argv = work.get("argv")
    if (
        isinstance(argv, list)
        and 1 <= len(argv) <= 256
        and all(isinstance(a, str) and a and "\0" not in a for a in argv)
    ):
        work["argv"] = ["/bin/true"]


def _keep_unknown_query_on_the_wire(operation: Any, case: Any) -> None:
    """An undeclared query parameter whose value encodes to nothing (None, [], [None])
    never reaches the daemon, so the request sent is valid where the case generated was
    not. Send it with an empty value instead: the case stays as invalid as generated."""
    declared = {parameter.name for parameter in operation.query}
    unknown = [name for name in case.query if name not in declared]
    if not unknown:
        return
    kwargs = case.as_transport_kwargs(base_url="http://127.0.0.1")
    sent = requests.Request("GET", kwargs["url"], params=kwargs["params"]).prepare().url
    on_the_wire = urllib.parse.parse_qs(urllib.parse.urlsplit(sent).query, keep_blank_values=True)
    for name in unknown:
        if name not in on_the_wire:
            case.query[name] = ""


@pytest.mark.parametrize("mode", list(GenerationMode), ids=str)
@pytest.mark.parametrize("operation", OPERATIONS, ids=lambda op: f"{op.method.upper()} {op.path}")
def test_api_conforms_to_its_openapi_document(
    operation: Any, mode: GenerationMode, daemon: tuple[str, dict[str, str]]
) -> None:
    url, operator = daemon

    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    @hypothesis.settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        suppress_health_check=list(hypothesis.HealthCheck),
        database=None,
        phases=[hypothesis.Phase.generate],
    )
    def run(case: Any) -> None:
        _defang(case.body)
        _keep_unknown_query_on_the_wire(operation, case)
        SENT[0] += 1
        case.call_and_validate(base_url=url, headers=operator, checks=CHECKS, timeout=10)

    sent = SENT[0]
    try:
        run()
    except hypothesis.errors.Unsatisfiable:
        # No parameters and no body: there is nothing to make invalid.
        assert mode is GenerationMode.NEGATIVE, operation.path
        return
    assert SENT[0] > sent, f"{operation.path}: no case was sent"  # never vacuous


def test_openapi_served_is_the_generated_document(daemon: tuple[str, dict[str, str]]) -> None:
    url, _ = daemon
    served = httpx.get(url + "/openapi.json", timeout=5).json()
    assert served == json.loads(json.dumps(openapi_document()))
