"""`dsbd distill` on a tiny synthetic target: the teacher cache, the loss, learning, exact resume.

The target is a random tiny Llama whose head is scaled up so that its next-token distributions
are peaked (like a real LM's); a one-layer draft cut from it starts far from it.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dsbd.cli import main
from dsbd.distill import (
    CacheConfig,
    CachePlan,
    DraftSpec,
    TeacherData,
    TrainConfig,
    build_cache,
    default_work_dir,
    kd_loss,
    load_heldout,
    train,
)
from dsbd.prompts import Prompt
from dsbd_core.models import LoadedModel, load_causal_lm
from tests.support.tiny_models import save_tiny_model, tiny_tokens

torch.set_num_threads(1)

VOCAB = 48
CACHE = CacheConfig(
    top_k=8, new_tokens=16, heldout_tokens=16, shard_size=32, batch_size=16, text_len=24
)


def sharp_target(root: Path) -> tuple[Path, LoadedModel]:
    """A saved tiny target with peaked distributions, and the loaded model."""
    path = save_tiny_model(root / "target", tiny_tokens(VOCAB), layers=3, seed=0)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(8.0)
    model.save_pretrained(path)
    return path, load_causal_lm(str(path))


def word_prompts(count: int, seed: int, kinds: tuple[str, ...] = ("english",)) -> list[Prompt]:
    rng = random.Random(seed)
    words = tiny_tokens(VOCAB)[2:]
    return [
        Prompt(
            kinds[i % len(kinds)],
            " ".join(rng.choice(words) for _ in range(rng.randint(1, 5))),
            False,
        )
        for i in range(count)
    ]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("distill")
    path, target = sharp_target(root)
    rng = random.Random(1)
    text = root / "text.txt"
    text.write_text(" ".join(rng.choice(tiny_tokens(VOCAB)[2:]) for _ in range(400)))
    messages: list[str] = []
    build_cache(
        target,
        root / "cache",
        CACHE,
        CachePlan(samples=128, text_chunks=2),
        prompts=word_prompts(64, 0),
        text_sources=[text],
        heldout_prompts=word_prompts(8, 99, ("english", "code")),
        progress=messages.append,
    )
    return root, path, target, messages


def test_kd_loss_equals_a_hand_computation() -> None:
    # Vocabulary of 4; target top-2 = tokens 0 (0.5) and 2 (0.3), rest 0.2.
    logits = torch.log(torch.tensor([[0.4, 0.1, 0.4, 0.1]]))
    kl, tv = kd_loss(
        logits,
        torch.tensor([[0, 2]]),
        torch.log(torch.tensor([[0.5, 0.3]])),
        torch.tensor([0.2]),
    )
    # q on {0, 2, rest} = (0.4, 0.4, 0.2)
    expected_kl = 0.5 * torch.log(torch.tensor(0.5 / 0.4)) + 0.3 * torch.log(torch.tensor(0.75))
    torch.testing.assert_close(kl, expected_kl[None], atol=1e-4, rtol=0)
    torch.testing.assert_close(tv, torch.tensor([0.5 * (0.1 + 0.1 + 0.0)]), atol=1e-4, rtol=0)
    # Identical distributions: zero loss.
    same = torch.log(torch.tensor([[0.5, 0.1, 0.3, 0.1]]))
    kl, tv = kd_loss(same, torch.tensor([[0, 2]]), same[:, [0, 2]], torch.tensor([0.2]))
    assert kl.abs().item() < 1e-5 and tv.abs().item() < 1e-5


@pytest.mark.slow
def test_cache_holds_topk_rows_per_scored_position_and_resumes(teacher) -> None:
    root, _, target, messages = teacher
    names = sorted(p.stem for p in (root / "cache").glob("*.pt"))
    assert names == ["sample-00000", "sample-00001", "sample-00002", "sample-00003", "text-00000"]
    data = TeacherData(root / "cache")
    assert len(data) == 128 + 2
    ids, start, topk_ids, topk_logp, rest = data.sequence(0)
    assert topk_ids.shape == (len(ids) - start, 8) and topk_logp.dtype == torch.float16
    # The cached rows are the target's teacher-forced distribution at those positions.
    with torch.no_grad():
        logp = torch.log_softmax(target.model(ids[None]).logits[0, start - 1 : -1], -1)
    torch.testing.assert_close(
        topk_logp.float(), logp.gather(-1, topk_ids.long()), atol=2e-3, rtol=2e-3
    )
    total = topk_logp.float().exp().sum(-1) + rest
    torch.testing.assert_close(total, torch.ones_like(total), atol=5e-3, rtol=0)
    heldout = load_heldout(root / "cache")
    assert len(heldout) == 8 and {s.kind for s in heldout} == {"english", "code"}
    # Rebuilding is a no-op (every shard exists); other settings are refused.
    before = {p: p.stat().st_mtime_ns for p in (root / "cache").glob("*.pt")}
    build_cache(target, root / "cache", CACHE, CachePlan(samples=128, text_chunks=2))
    assert before == {p: p.stat().st_mtime_ns for p in (root / "cache").glob("*.pt")}
    with pytest.raises(ValueError, match="other settings"):
        build_cache(target, root / "cache", CacheConfig(top_k=4), CachePlan(8, 0))
    assert any("shard 5/5" in m for m in messages)


def test_a_cache_is_refused_for_another_sampling_batch_or_target(teacher, tmp_path) -> None:
    root, target_path, target, _ = teacher
    cache = tmp_path / "cache"
    shutil.copytree(root / "cache", cache)
    plan = CachePlan(samples=128, text_chunks=2)
    # The sampling batch size changes which tokens are sampled (tests/algorithm/test_acceptance.py).
    other_batch = CacheConfig(**{**asdict(CACHE), "batch_size": 8})
    with pytest.raises(ValueError, match=r"other settings \(batch_size: 16 -> 8\)"):
        build_cache(target, cache, other_batch, plan)
    # Another target with the same vocabulary size: refused by identity, naming what differs.
    other_path = save_tiny_model(tmp_path / "other", tiny_tokens(VOCAB), layers=3, seed=7)
    other = load_causal_lm(str(other_path))
    assert other.vocab_size == target.vocab_size
    with pytest.raises(ValueError, match="target weights: .*" + re.escape(repr(str(other_path)))):
        build_cache(other, cache, CACHE, plan)
    with pytest.raises(ValueError) as refused:
        build_cache(other, cache, CACHE, plan)
    assert "target config" not in str(refused.value)  # same architecture: only the weights
    deeper = load_causal_lm(str(save_tiny_model(tmp_path / "deep", tiny_tokens(VOCAB), layers=4)))
    with pytest.raises(ValueError, match="target config: .*target weights: "):
        build_cache(deeper, cache, CACHE, plan)
    # Training on it (`dsbd distill --train-only`) is refused as well.
    with pytest.raises(ValueError, match="does not fit this target .*target weights"):
        train(other, cache, tmp_path / "run", DraftSpec("cut", 1), TrainConfig(steps=1))
    # The same target loaded again (from another path) is the same target.
    moved = shutil.copytree(target_path, tmp_path / "elsewhere" / "target")
    build_cache(load_causal_lm(str(moved)), cache, CACHE, plan)
    # A cache written before the batch size and the target's identity were recorded: refused.
    meta = json.loads((cache / "meta.json").read_text())
    del meta["target_identity"], meta["config"]["batch_size"]
    (cache / "meta.json").write_text(json.dumps({**meta, "format": 1}))
    with pytest.raises(ValueError, match="format: 1 -> 2"):
        build_cache(target, cache, CACHE, plan)


def test_default_work_dir_is_keyed_by_the_targets_identity(teacher, tmp_path) -> None:
    _, target_path, target, _ = teacher
    same_name = save_tiny_model(tmp_path / "b" / "target", tiny_tokens(VOCAB), layers=3, seed=3)
    other = load_causal_lm(str(same_name))
    assert Path(other.name).name == Path(target.name).name == "target"
    mine = default_work_dir(target)
    assert mine.parent == Path.home() / ".cache" / "dsbd" / "distill"
    assert mine.name.startswith("target-") and default_work_dir(other) != mine
    copy = shutil.copytree(target_path, tmp_path / "c" / "target")
    assert default_work_dir(load_causal_lm(str(copy))) == mine


def heldout_curve(run_dir: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    return [(r["step"], r["heldout"]["overall"]["acceptance"]) for r in records if "heldout" in r]


@pytest.mark.slow
@pytest.mark.parametrize("spec", [DraftSpec("cut", 1), DraftSpec("small", 2, hidden=16)])
def test_distillation_lowers_kl_and_raises_acceptance(teacher, tmp_path: Path, spec) -> None:
    root, _, target, _ = teacher
    config = TrainConfig(steps=80, batch_size=8, lr=3e-3, warmup=5, eval_every=40, log_every=1)
    status = train(target, root / "cache", tmp_path / "run", spec, config, progress_bar=False)
    assert status["finished"]
    curve = heldout_curve(tmp_path / "run")
    assert [step for step, _ in curve] == [0, 40, 80]
    start, end = curve[0][1], curve[-1][1]
    assert end > start + 0.1, curve
    records = [
        json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()
    ]
    kls = [r["kl"] for r in records if "kl" in r]
    assert sum(kls[-10:]) / 10 < 0.6 * sum(kls[:10]) / 10
    # The written draft is a transformers directory that loads as a draft of the target.
    draft = load_causal_lm(str(tmp_path / "run" / "draft"))
    assert draft.vocab_size == VOCAB
    assert draft.model.config.num_hidden_layers == spec.layers


@pytest.mark.slow
def test_resume_is_exact(teacher, tmp_path: Path) -> None:
    root, _, target, _ = teacher
    config = TrainConfig(
        steps=36, batch_size=8, lr=3e-3, warmup=3, eval_every=6, checkpoint_every=4
    )
    spec = DraftSpec("cut", 1)
    assert len(TeacherData(root / "cache")) // config.batch_size == 16  # steps per epoch
    whole = train(target, root / "cache", tmp_path / "whole", spec, config, progress_bar=False)
    assert whole["epoch"] == 2  # epochs 0 and 1 complete, 4 steps into epoch 2
    # 36 steps in four calls: 5; 13 (crossing the first epoch boundary, at step 16, inside a
    # resumed call); 14 (ending exactly on the second boundary, step 32); the rest (resuming
    # into a new epoch).
    calls = []
    for stop_after in (5, 13, 14, None):
        calls.append(
            train(
                target,
                root / "cache",
                tmp_path / "parts",
                spec,
                config,
                stop_after=stop_after,
                progress_bar=False,
            )
        )
    assert [(c["step"], c["epoch"], c["finished"]) for c in calls] == [
        (5, 0, False),
        (18, 1, False),
        (32, 1, False),
        (36, 2, True),
    ]
    last = calls[-1]
    assert whole["finished"] and last["finished"] and last["step"] == 36
    a = torch.load(tmp_path / "whole" / "state.pt", weights_only=False)
    b = torch.load(tmp_path / "parts" / "state.pt", weights_only=False)
    for name, tensor in a["trainable"].items():
        assert torch.equal(tensor, b["trainable"][name]), name
    assert a["history"] == [
        {**h, "elapsed_s": a["history"][i]["elapsed_s"]} for i, h in enumerate(b["history"])
    ]
    assert whole["loss"] == last["loss"]
    # Rerunning a finished run trains nothing, says so, and still writes the draft.
    shutil.rmtree(tmp_path / "parts" / "draft")
    again = train(target, root / "cache", tmp_path / "parts", spec, config, progress_bar=False)
    assert again["already_finished"] and again["finished"] and again["step"] == 36
    assert again["heldout"] == b["history"][-1]["heldout"]  # the step-36 evaluation
    assert (tmp_path / "parts" / "draft" / "config.json").is_file()
    c = torch.load(tmp_path / "parts" / "state.pt", weights_only=False)
    assert all(torch.equal(c["trainable"][n], t) for n, t in b["trainable"].items())
    assert not last["already_finished"]
    # A new number of steps re-plans the schedule (and a new TV weight the objective) from here.
    longer = TrainConfig(**{**asdict(config), "steps": 40, "tv_weight": 0.5})
    extended = train(target, root / "cache", tmp_path / "parts", spec, longer, progress_bar=False)
    assert extended["finished"] and extended["step"] == 40
    assert extended["lr"] == pytest.approx(longer.lr_at(39))
    # A resume under other settings is refused.
    with pytest.raises(ValueError, match="other settings"):
        train(
            target,
            root / "cache",
            tmp_path / "parts",
            spec,
            TrainConfig(steps=36, lr=1.0),
            progress_bar=False,
        )


@pytest.mark.slow
def test_distill_cli_end_to_end(teacher, tmp_path: Path, capsys, monkeypatch) -> None:
    root, target_path, _, _ = teacher
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same on a GPU machine
    work = tmp_path / "work"
    shutil.copytree(root / "cache", work / "cache")  # reuse the module's teacher cache
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(p.to_json() for p in word_prompts(8, 5)))
    argv = [
        "distill",
        "--target",
        str(target_path),
        "--out",
        str(tmp_path / "draft"),
        "--work-dir",
        str(work),
        "--samples",
        "128",
        "--text-chunks",
        "2",
        "--top-k",
        "8",
        "--new-tokens",
        "16",
        "--sample-batch",
        "16",
        "--layers",
        "1",
        "--steps",
        "6",
        "--batch-size",
        "8",
        "--eval-every",
        "3",
        "--no-progress",
        "--text",
        str(root / "text.txt"),
    ]
    # --device: CUDA asked for but not available, or an unknown device: exit 2 before loading.
    assert main([*argv, "--device", "cuda"]) == 2
    assert "--device 'cuda': CUDA is not available here" in capsys.readouterr().err
    assert main([*argv, "--device", "tpu"]) == 2
    assert "--device 'tpu': allowed auto, cpu, cuda or cuda:N" in capsys.readouterr().err
    # The cache was built with other shard/text settings than the CLI's defaults: refused.
    assert main(argv) == 2
    assert "other settings" in capsys.readouterr().err
    shutil.rmtree(work)
    argv += ["--stop-after", "4"]
    assert main([*argv, "--prompts", str(prompts)]) == 0
    assert "stopped (rerun the same command to resume)" in capsys.readouterr().out
    assert main([*argv, "--prompts", str(prompts)]) == 0
    out = capsys.readouterr().out
    assert "step 6/6 finished" in out and "held-out acceptance" in out
    assert (tmp_path / "draft" / "config.json").is_file()
    # Rerunning the finished command trains nothing, says so, still writes the draft: exit 0.
    shutil.rmtree(tmp_path / "draft")
    assert main([*argv, "--prompts", str(prompts)]) == 0
    captured = capsys.readouterr()
    assert "already finished at step 6 (--steps 6)" in captured.out
    assert str(tmp_path / "draft") in captured.out and "held-out acceptance" in captured.out
    assert "device cpu" in captured.err  # --device auto without CUDA
    assert (tmp_path / "draft" / "config.json").is_file()
    # A snapshot of the latest checkpoint (as of a run still going) is the same draft.
    snapshot = ["--export-checkpoint", "--out", str(tmp_path / "snapshot"), "--device", "cpu"]
    assert main([*argv, *snapshot]) == 0
    assert "wrote the draft of step 6" in capsys.readouterr().out
    a = load_causal_lm(str(tmp_path / "draft")).model.state_dict()
    b = load_causal_lm(str(tmp_path / "snapshot")).model.state_dict()
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert (
        main(
            [
                "eval-acceptance",
                "--target",
                str(target_path),
                "--draft",
                str(tmp_path / "draft"),
                "--prompts",
                str(prompts),
                "--new-tokens",
                "4",
            ]
        )
        == 0
    )


def test_growing_data_is_picked_up_at_epoch_boundaries_and_resumes(teacher, tmp_path) -> None:
    root, _, target, _ = teacher
    cache = tmp_path / "cache"
    shutil.copytree(root / "cache", cache)
    moved = cache / "sample-00003.pt"
    held_back = moved.rename(tmp_path / moved.name)  # the cache is "still being built"
    config = TrainConfig(steps=30, batch_size=8, warmup=2, eval_every=100, grow_data=True)
    spec = DraftSpec("cut", 1)
    train(target, cache, tmp_path / "run", spec, config, stop_after=13, progress_bar=False)
    state = torch.load(tmp_path / "run" / "state.pt", weights_only=False)
    assert len(state["shards"]) == 4 and state["epoch"] == 1  # 12 steps per epoch at 98/8
    held_back.rename(moved)
    train(target, cache, tmp_path / "run", spec, config, progress_bar=False)
    state = torch.load(tmp_path / "run" / "state.pt", weights_only=False)
    assert len(state["shards"]) == 5 and state["epoch"] == 2


def test_a_cut_draft_ships_as_a_small_delta_and_rebuilds_exactly(teacher, tmp_path: Path) -> None:
    from dsbd_core.models import build_from_delta, write_delta

    root, target_path, target, _ = teacher
    config = TrainConfig(steps=3, batch_size=8, warmup=1, eval_every=100)
    train(target, root / "cache", tmp_path / "run", DraftSpec("cut", 1), config, progress_bar=False)
    draft_dir = tmp_path / "run" / "draft"
    description = write_delta(draft_dir, target_path, tmp_path / "delta", dtype=torch.float32)
    # The frozen embedding (and this tiny target's untied head) are the target's: recorded by
    # hash, not stored; the trained layers are stored.
    shared = set(description["shared_with_base"])
    assert "model.embed_tokens.weight" in shared and not any("layers" in n for n in shared)
    assert "model.layers.0.mlp.up_proj.weight" in description["stored"]
    build_from_delta(tmp_path / "delta", target_path, tmp_path / "rebuilt")
    original = load_causal_lm(str(draft_dir)).model
    rebuilt = load_causal_lm(str(tmp_path / "rebuilt")).model
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(ids).logits, original(ids).logits, rtol=0, atol=0)
    # Against another base the recorded hash does not match: refused.
    other = save_tiny_model(tmp_path / "other", tiny_tokens(VOCAB), layers=3, seed=5)
    with pytest.raises(Exception, match="not the one this draft was trained against"):
        build_from_delta(tmp_path / "delta", other, tmp_path / "bad")
