"""Same seeds, same tokens: every method and decoder path decodes the recorded tokens (recorded
by `python -m tests.support.golden_tokens`, see there): a refactor must not move a single draw."""

from __future__ import annotations

import json

import pytest

from tests.support.golden_tokens import PATH, record


@pytest.mark.slow
def test_every_method_decodes_the_recorded_tokens() -> None:
    expected = json.loads(PATH.read_text())
    actual = json.loads(json.dumps(record(), sort_keys=True))
    assert sorted(actual) == sorted(expected)
    moved = [key for key in expected if actual[key] != expected[key]]
    assert not moved, f"{len(moved)} of {len(expected)} recorded decodes changed: {moved[:5]}"
