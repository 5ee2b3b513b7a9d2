"""`dsbd batch --draft ngram` without Ray: the batch actor with the prompt-lookup draft decodes
each row as `generate` decodes it alone (issue 48), and bad draft flags exit 2 naming them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import torch

from deployments.batch_job.decoder import BatchDecoder
from deployments.batch_job.rows import ROWS_SCHEMA
from dsbd.cli import main
from dsbd_core import SamplingConfig
from dsbd_core.algorithm.drivers.decoders import generate
from dsbd_core.algorithm.methods import METHODS_WITH_DRAFT
from dsbd_core.algorithm.scorers.ngram_draft import NgramDraft
from dsbd_core.models import encode_prompt, load_causal_lm, stop_token_ids
from dsbd_core.models.transformer_scorer import TransformerScorer
from tests.support.tiny_models import build_pair

ROWS = [
    {"prompt": "one two three one two three one two", "chat": False, "seed": 1},
    {"prompt": "one two one two one", "chat": False, "method": "sps", "gamma": 3, "seed": 2},
    {"prompt": "one two", "chat": False, "method": "spec_beam_search", "width": 2},
    {"prompt": "The quick brown fox", "chat": False, "method": "beam", "seed": 3},
    {"prompt": "x", "width": 0},  # a bad row fails alone
]


def test_the_batch_actor_decodes_rows_with_the_ngram_draft_as_alone(tmp_path: Path) -> None:
    target_dir, _ = build_pair(tmp_path / "models")
    settings = {
        "target": str(target_dir),
        "draft": "ngram",
        "dtype": "float64",
        "draft_variant": {"ngram_max": 2},
        "fixed_knobs": True,  # generate() alone drafts gamma layers every iteration too
        "defaults": {"config": {"max_new_tokens": 6, "width": 3, "gamma": 2}},
    }
    decoder = BatchDecoder(settings)
    table = pa.Table.from_pylist(
        [
            {"index": i, "id": str(i), "row_hash": "", "row": json.dumps(r), "problem": None}
            for i, r in enumerate(ROWS)
        ],
        schema=ROWS_SCHEMA,
    )
    records = decoder(table).to_pylist()
    assert "width=0" in records[-1]["error"]
    target = load_causal_lm(str(target_dir), dtype=torch.float64)
    eos = stop_token_ids(target)
    for row, record in zip(ROWS[:-1], records, strict=False):
        assert record["error"] is None, record["error"]
        knobs: dict[str, Any] = {"max_new_tokens": 6, "width": 3, "gamma": 2}
        knobs |= {k: v for k, v in row.items() if k not in ("prompt", "chat", "method")}
        method = row.get("method", "dsbd")
        draft = NgramDraft(target.vocab_size, 2) if method in METHODS_WITH_DRAFT else None
        want = generate(
            method,
            TransformerScorer(target.model),
            encode_prompt(target, row["prompt"], chat=False),
            SamplingConfig(eos_token_ids=eos, **knobs),
            draft,
        )
        got = sorted(tuple(beam["token_ids"]) for beam in record["beams"])
        assert got == sorted(tuple(beam.token_ids) for beam in want.beams), row
        if method in METHODS_WITH_DRAFT:
            assert record["stats"]["draft_forward_passes"] > 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ngram-max", "0"], "--ngram-max=0: allowed 1..16"),
        (["--draft", "ngrams"], "--draft 'ngrams': unknown model source 'ngrams'"),
    ],
)
def test_bad_draft_flags_exit_2(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target_dir, _ = build_pair(tmp_path / "models")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "x"}\n')
    argv = ["batch", "--input", str(tmp_path / "prompts.jsonl"), "--target", str(target_dir)]
    argv += ["--output", str(tmp_path / "out.jsonl"), "--draft", "ngram", *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err, err
    if "ngrams" in flags:
        assert "'ngram' (the prompt-lookup draft)" in err
