"""The offer's latency budgets as the device checks them (agent/update/offer.py parse_offer):
``latency_budget_ms`` (the p95's) and ``p99_budget_ms`` optional, positive finite numbers, the p99
one never under the p95 one; a malformed value is refused with a reason naming the field."""

from __future__ import annotations

import hashlib
import json

import pytest

from tandoor_agent.update.offer import JobError, parse_offer


def _offer(**extra) -> bytes:
    data = b"x" * 100
    return json.dumps({"job_id": "j1", "sha256": hashlib.sha256(data).hexdigest(), "size": 100, "chunk_size": 100,
                       "n_chunks": 1, "chunk_sha256": [hashlib.sha256(data).hexdigest()], **extra}).encode()


def test_budgets_are_optional_and_kept():
    assert parse_offer(_offer()).get("p99_budget_ms") is None
    o = parse_offer(_offer(latency_budget_ms=40, p99_budget_ms=60.5))
    assert o["latency_budget_ms"] == 40 and o["p99_budget_ms"] == 60.5
    assert parse_offer(_offer(p99_budget_ms=25))["p99_budget_ms"] == 25     # a p99 budget alone


@pytest.mark.parametrize("extra,why", [
    ({"p99_budget_ms": 0}, "p99_budget_ms must be a number in (0, 1000000000.0], got 0"),
    ({"p99_budget_ms": -3}, "p99_budget_ms must be a number in (0, 1000000000.0], got -3"),
    ({"p99_budget_ms": "60"}, "p99_budget_ms must be a number in (0, 1000000000.0], got '60'"),
    ({"p99_budget_ms": True}, "p99_budget_ms must be a number in (0, 1000000000.0], got True"),
    ({"p99_budget_ms": 1e12}, "p99_budget_ms must be a number in (0, 1000000000.0], got 1000000000000.0"),
    ({"latency_budget_ms": 40, "p99_budget_ms": 30},
     "p99_budget_ms 30 is below latency_budget_ms 40 (the p95 budget): a p99 is never under its p95"),
])
def test_malformed_p99_budget_is_refused_with_the_reason(extra, why):
    with pytest.raises(JobError) as e:
        parse_offer(_offer(**extra))
    assert e.value.kind == "malformed" and str(e.value) == f"malformed job: {why}"
