"""Model adapter: loading directories, the vocabulary check, drafts cut from a target, errors.

Tiny Llama models with a word-level tokenizer are built and saved in each test, so everything
but the `real_model` tests runs in seconds without weights.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from dsbd_core import models
from dsbd_core.models import (
    LoadedModel,
    ModelSourceError,
    VocabularyMismatchError,
    check_same_vocabulary,
    encode_prompt,
    keep_first_layers,
    load_causal_lm,
    loading,
    stop_token_ids,
)
from dsbd_core.models.conversion import gguf_entry
from tests.support.tiny_models import save_tiny_model, tiny_tokens

torch.set_num_threads(1)


def test_loads_a_saved_directory(tmp_path: Path) -> None:
    path = save_tiny_model(tmp_path / "tiny", tiny_tokens(32))
    loaded = load_causal_lm(str(path))
    assert isinstance(loaded, LoadedModel)
    assert loaded.vocab_size == 32
    assert loaded.path == path and loaded.name == str(path)
    assert not loaded.model.training
    assert loaded.model.config._attn_implementation == "sdpa"
    assert loaded.model.dtype == torch.float32
    assert stop_token_ids(loaded) == (1,)
    # No chat template: the plain encoding is used unless a chat is asked for.
    assert encode_prompt(loaded, "w1 w2") == [3, 4]
    with pytest.raises(ModelSourceError, match="no chat template"):
        encode_prompt(loaded, "w1", chat=True)


def test_vocabulary_size_mismatch_names_both_sizes(tmp_path: Path) -> None:
    target = load_causal_lm(str(save_tiny_model(tmp_path / "t", tiny_tokens(40))))
    draft = load_causal_lm(str(save_tiny_model(tmp_path / "d", tiny_tokens(32))))
    with pytest.raises(VocabularyMismatchError, match=r"32 logits .* target .* has 40"):
        check_same_vocabulary(target, draft)


def test_tokenizer_mismatch_names_the_first_differing_token(tmp_path: Path) -> None:
    tokens = tiny_tokens(32)
    renamed = tokens[:5] + ["other"] + tokens[6:]
    target = load_causal_lm(str(save_tiny_model(tmp_path / "t", tokens)))
    draft = load_causal_lm(str(save_tiny_model(tmp_path / "d", renamed)))
    with pytest.raises(VocabularyMismatchError, match=r"id 5: draft 'other', target 'w3'"):
        check_same_vocabulary(target, draft)
    check_same_vocabulary(target, target)  # same vocabulary: no error


def test_first_layers_draft_is_the_targets_early_exit(tmp_path: Path) -> None:
    """Draft logits = final norm + head applied to the target's hidden state after layer k."""
    target = load_causal_lm(str(save_tiny_model(tmp_path / "t", tiny_tokens(32), layers=3)))
    ids = torch.tensor([[2, 5, 7, 9]])
    with torch.no_grad():
        hidden = target.model(ids, output_hidden_states=True).hidden_states[1]
        expected = target.model.lm_head(target.model.model.norm(hidden))
        draft = keep_first_layers(target.model, 1)
        assert draft.config.num_hidden_layers == 1
        torch.testing.assert_close(draft(ids).logits, expected)
    with pytest.raises(ValueError, match="allowed 1..1"):
        keep_first_layers(draft, 2)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("no-such-model", "unknown model source 'no-such-model'.*smollm2"),
        ("missing/model.gguf", "GGUF file not found"),
        ("smollm2-draft-0", "allowed 1 <= k < 30"),
        ("smollm2-draft-99", "allowed 1 <= k < 30"),
    ],
)
def test_bad_sources_say_what_to_do(source: str, message: str) -> None:
    with pytest.raises(ModelSourceError, match=message):
        load_causal_lm(source)


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelSourceError, match="not a .gguf file"):
        load_causal_lm(str(tmp_path / "weights.bin"))


def test_offline_hub_id_says_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelSourceError, match="hub could not be reached.*HF_HUB_OFFLINE"):
        load_causal_lm("some-owner/some-model")


def test_cache_build_is_atomic(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A failed conversion leaves nothing behind; a finished one is reused, not rebuilt."""
    monkeypatch.setenv("DSBD_CACHE_DIR", str(tmp_path))

    def failing(out: Path) -> None:
        (out / "half-written").write_text("x")
        raise RuntimeError("conversion failed")

    with pytest.raises(RuntimeError):
        loading.cached_conversion("thing", failing)
    assert list(tmp_path.iterdir()) == []

    calls = []

    def build(out: Path) -> None:
        calls.append(out)
        (out / "done").write_text("ok")

    first = loading.cached_conversion("thing", build)
    assert loading.cached_conversion("thing", build) == first == tmp_path / "thing"
    assert len(calls) == 1 and (first / "done").read_text() == "ok"
    assert [p.name for p in tmp_path.iterdir()] == ["thing"]


@pytest.mark.slow
@pytest.mark.real_model
def test_presets_load_from_the_cache_and_share_a_vocabulary(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the first load converts the GGUF once (~26 CPU-s with the draft), later ones read the cache
    target = load_causal_lm("smollm2")
    # Loading again builds no cache entry and costs this process ~0.8 CPU-s. Its wall time is not
    # the check: the suite runs servers beside the in-process tests, and beside the shared
    # server's start these loads once took 18.5 s.
    builds: list[str] = []
    cached_conversion = loading.cached_conversion

    def counted(name: str, build: Callable[[Path], None]) -> Path:
        def recorded(out: Path) -> None:
            builds.append(name)
            build(out)

        return cached_conversion(name, recorded)

    monkeypatch.setattr(loading, "cached_conversion", counted)
    start = time.process_time()
    target = load_causal_lm("smollm2")
    draft = load_causal_lm("smollm2-draft")
    reload_cpu_s = time.process_time() - start
    assert builds == [], f"loading the presets again rebuilt {builds}"
    assert reload_cpu_s < 10, f"cached loads took {reload_cpu_s:.1f} s of CPU"
    assert target.vocab_size == draft.vocab_size == 49152
    assert target.model.config.num_hidden_layers == 30
    # the default draft is the shipped distilled one (4 trained layers), not a cut of the target
    assert draft.path == models.prepare_preset(models.DISTILLED_PRESET)
    assert draft.model.config.num_hidden_layers == 4
    cut = load_causal_lm(models.DRAFT_PRESET + f"-{models.DEFAULT_DRAFT_LAYERS}")
    assert cut.model.config.num_hidden_layers == models.DEFAULT_DRAFT_LAYERS
    check_same_vocabulary(target, draft)
    assert {0, 2} <= set(stop_token_ids(target))  # <|endoftext|> and the chat's <|im_end|>
    prompt = target.tokenizer.decode(encode_prompt(target, "Hello"))
    assert prompt.endswith("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
@pytest.mark.real_model
def test_gguf_file_loads_directly() -> None:
    loaded = load_causal_lm(str(models.smollm2_gguf_path()))
    assert loaded.vocab_size == 49152
    assert loaded.path is not None and loaded.path.parent == models.cache_root()


def test_a_gguf_files_cache_entry_follows_its_content_not_its_place(tmp_path: Path) -> None:
    """The embedded file copied elsewhere (as a new virtual environment installs it) names the
    same converted entry; a changed byte names another."""
    embedded = models.smollm2_gguf_path()
    copy = tmp_path / "elsewhere" / embedded.name
    copy.parent.mkdir()
    copy.write_bytes(embedded.read_bytes())
    assert gguf_entry(copy) == gguf_entry(embedded)
    with copy.open("r+b") as file:
        file.seek(-1, 2)
        last = file.read(1)
        file.seek(-1, 2)
        file.write(bytes([last[0] ^ 1]))
    assert gguf_entry(copy) != gguf_entry(embedded)
