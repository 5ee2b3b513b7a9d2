"""Real drafts: the shipped SmolLM2 draft and the installable Qwen2.5-Coder pair (slow).

`dsbd eval-acceptance` with its defaults is the one command that reproduces the shipped draft's
figure (held-out prompts, 64 target-sampled tokens each, T = 1, seed 0).
"""

from __future__ import annotations

import json

import pytest

from dsbd.cli import main
from dsbd_core import models

pytestmark = pytest.mark.real_model

SHIPPED = models.SHIPPED_DRAFTS / models.DISTILLED_PRESET


def eval_json(capsys: pytest.CaptureFixture[str], *flags: str) -> dict:
    assert main(["eval-acceptance", "--json", "--threads", "1", *flags]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_shipped_draft_is_small_loads_as_default_and_accepts_040(capsys) -> None:
    # The draft is committed in the repository: a missing one is a failure, never a skip.
    assert (SHIPPED / "delta.json").is_file(), f"the shipped draft is missing from {SHIPPED}"
    assert (SHIPPED / "delta.safetensors").is_file(), f"{SHIPPED} has no delta.safetensors"
    size = sum(path.stat().st_size for path in SHIPPED.iterdir())
    assert size <= 40e6, f"the shipped draft takes {size / 1e6:.1f} MB"
    target = models.load_causal_lm("smollm2")
    draft = models.load_causal_lm("smollm2-draft")  # the default draft is the shipped one
    models.check_same_vocabulary(target, draft)
    assert draft.path == models.prepare_preset(models.DISTILLED_PRESET)
    report = eval_json(capsys)  # defaults: --target smollm2 --draft smollm2-draft
    assert report["draft"] == "smollm2-draft" and report["overall"]["positions"] >= 1500
    assert report["overall"]["acceptance"] >= 0.40, report


@pytest.mark.slow
@pytest.mark.skipif(
    not (models.cache_root() / "qwen-coder-draft" / "config.json").is_file(),
    reason="run `dsbd models install qwen-coder` first",
)
def test_installed_qwen_pair_accepts_most_code_tokens(capsys) -> None:
    flags = ["--target", "qwen-coder", "--draft", "qwen-coder-draft", "--kinds", "python-source"]
    report = eval_json(capsys, *flags, "--new-tokens", "16")
    assert report["overall"]["acceptance"] > 0.7, report  # measured: 0.91 (64 tokens)
