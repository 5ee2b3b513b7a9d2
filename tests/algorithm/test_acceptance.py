"""The acceptance evaluator: hand-computed toy distributions, sampling, the CLI on tiny models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dsbd.acceptance import (
    ScoredSequence,
    agreement,
    measure_acceptance,
    next_token_probs,
    sample_continuations,
)
from dsbd.cli import main
from tests.support.tiny_models import save_tiny_model, tiny_tokens

torch.set_num_threads(1)


def test_agreement_equals_a_hand_computation() -> None:
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.1, 0.7], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.2, 0.3, 0.5, 0.0], [0.0, 0.0, 0.2, 0.8], [0.25, 0.25, 0.25, 0.25]])
    overlap, agree = agreement(p, q)
    # min row 0: .2 + .3 + .2 + 0 = .7; row 1: 0 + 0 + .1 + .7 = .8; row 2: identical -> 1.
    torch.testing.assert_close(overlap, torch.tensor([0.7, 0.8, 1.0]))
    assert agree.tolist() == [False, True, True]  # argmax 0 vs 2; 3 vs 3; ties -> first index
    with pytest.raises(ValueError, match="shape"):
        agreement(p, q[:, :3])


class ToyLM(torch.nn.Module):
    """A 'model' whose next-token distribution depends only on the last token: a table."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.logits = table.log()

    def forward(self, ids: torch.Tensor):  # noqa: D401 - mimics a HF causal LM's output
        return type("Out", (), {"logits": self.logits[ids]})()


def test_measure_acceptance_per_kind_and_overall_by_hand() -> None:
    # 3 tokens; rows = previous token.
    p = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [1 / 3, 1 / 3, 1 / 3]])
    q = torch.tensor([[0.3, 0.6, 0.1], [0.2, 0.3, 0.5], [0.5, 0.25, 0.25]])
    target, draft = ToyLM(p), ToyLM(q)
    # Per previous token: overlap 0.7 (row 0), 0.9 (row 1), 0.25 + 1/3 + 0.25 (row 2);
    # greedy: 0 vs 1 no, 2 vs 2 yes, 0 vs 0 yes (first index wins a tie).
    row = [0.7, 0.9, 0.25 + 1 / 3 + 0.25]
    greedy = [0, 1, 1]
    # Scored positions read the distribution after tokens[start-1:-1].
    english = ScoredSequence((0, 1, 2, 0), start=1, kind="english")  # prev 0, 1, 2
    code = ScoredSequence((2, 2, 1), start=2, kind="code")  # prev 2
    report = measure_acceptance(target, draft, [english, code])
    assert report.kinds["english"].positions == 3 and report.kinds["code"].positions == 1
    assert report.kinds["english"].acceptance == pytest.approx(sum(row) / 3)
    assert report.kinds["english"].greedy_agreement == pytest.approx(2 / 3)
    assert report.kinds["code"].acceptance == pytest.approx(row[2])
    assert report.overall.acceptance == pytest.approx((sum(row) + row[2]) / 4)
    assert report.overall.greedy_agreement == pytest.approx((sum(greedy) + greedy[2]) / 4)
    # Temperature applies to both: at a very high one both become uniform.
    hot = measure_acceptance(target, draft, [english, code], temperature=1e6)
    assert hot.overall.acceptance == pytest.approx(1.0, abs=1e-4)
    # Cached target probabilities give the same report.
    cached = [next_token_probs(target, s) for s in (english, code)]
    again = measure_acceptance(target, draft, [english, code], target_probs=cached)
    assert again.as_dict() == report.as_dict()


def test_a_model_accepts_itself_fully_and_sampling_is_seeded(tmp_path: Path) -> None:
    from dsbd_core.models import load_causal_lm

    model = load_causal_lm(str(save_tiny_model(tmp_path / "m", tiny_tokens(32)))).model
    prompts = [[2, 3, 4], [5, 6]]
    first, logits = sample_continuations(
        model, prompts, new_tokens=5, seed=3, stop_ids=[1], batch_size=2, return_logits=True
    )
    again, _ = sample_continuations(model, prompts, new_tokens=5, seed=3, stop_ids=[1])
    assert first == again  # the default batch (8) holds both prompts: the same single batch
    assert [s.token_ids[: s.start] for s in first] == [tuple(p) for p in prompts]
    for sequence, step_logits in zip(first, logits, strict=True):
        assert 1 <= sequence.positions <= 5
        assert step_logits.shape == (sequence.positions, 32)
        # The sampling logits are the teacher-forced ones (left padding does not change them).
        torch.testing.assert_close(
            torch.softmax(step_logits, -1), next_token_probs(model, sequence), atol=1e-5, rtol=0
        )
    report = measure_acceptance(model, model, first)
    assert report.overall.acceptance == pytest.approx(1.0)
    assert report.overall.greedy_agreement == 1.0


def test_the_sampling_batch_size_changes_the_sampled_tokens(tmp_path: Path) -> None:
    """Why a teacher cache records its sampling batch size: one generator feeds the batches in
    turn, one draw per row and step, so regrouping the prompts gives other tokens."""
    from dsbd_core.models import load_causal_lm

    model = load_causal_lm(str(save_tiny_model(tmp_path / "m", tiny_tokens(32)))).model
    prompts = [[2, 3, 4], [5, 6], [7, 8, 9], [10, 11]]

    def sample(batch_size: int) -> list[tuple[int, ...]]:
        sequences, _ = sample_continuations(
            model, prompts, new_tokens=6, seed=3, batch_size=batch_size
        )
        return [s.token_ids for s in sequences]

    by_size = {size: sample(size) for size in (1, 2, 4)}
    assert sample(2) == by_size[2]  # deterministic for a given batch size
    assert by_size[1] != by_size[2] and by_size[2] != by_size[4] and by_size[1] != by_size[4]


def test_eval_acceptance_cli_on_tiny_models(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    target = save_tiny_model(tmp_path / "t", tiny_tokens(32), seed=1)
    draft = save_tiny_model(tmp_path / "d", tiny_tokens(32), layers=1, seed=2)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"kind": "english", "text": "w1 w2", "chat": false}\n'
        '{"kind": "code", "text": "w3 w4 w5", "chat": false}\n'
    )
    argv = ["eval-acceptance", "--target", str(target), "--draft", str(draft)]
    argv += ["--prompts", str(prompts), "--new-tokens", "6", "--json"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same on a GPU machine
    assert main(argv) == 0  # --device auto: the CPU, CUDA being unavailable
    report = json.loads(capsys.readouterr().out)
    assert report["device"] == "cpu"
    assert set(report["kinds"]) == {"english", "code"}
    assert main([*argv, "--device", "cpu"]) == 0
    explicit = json.loads(capsys.readouterr().out)
    assert explicit["device"] == "cpu" and explicit["overall"] == report["overall"]
    assert 0 < report["overall"]["positions"] <= 12
    assert 0.0 <= report["overall"]["acceptance"] <= 1.0
    assert main(argv[:-1]) == 0  # the table view
    out = capsys.readouterr().out
    assert "overall" in out and "english" in out and "greedy" in out
    assert main([*argv, "--kinds", "nothing"]) == 2
    assert main([*argv, "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert (
        "--device 'cuda': CUDA is not available here" in err and "allowed here: auto or cpu" in err
    )
    assert main([*argv, "--device", "gpu0"]) == 2
    assert "--device 'gpu0': allowed auto, cpu, cuda or cuda:N" in capsys.readouterr().err
    # With CUDA present, a device index beyond the machine's devices is refused by name.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main([*argv, "--device", "cuda:1"]) == 2
    assert "this machine has 1 CUDA device(s): cuda:0..cuda:0" in capsys.readouterr().err
    assert main(["eval-acceptance", "--target", str(target), "--draft", "no-such"]) == 2
