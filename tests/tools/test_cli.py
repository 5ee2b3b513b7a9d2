"""The `dsbd` command line: flags -> SamplingConfig, errors -> exit 2, one run on tiny models."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dsbd.cli import build_parser, config_from_args, main
from dsbd_core.algorithm.config import SamplingConfig
from tests.support.tiny_models import save_tiny_model, tiny_tokens


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--width", "0"], "width=0"),
        (["--top-p", "1.5"], "top_p=1.5"),
        (["--gamma", "0"], "gamma=0"),
        (["--width", "2", "--w-min", "3"], "w_min=3 is larger than width=2"),
        (["--temperature", "0"], "temperature=0.0"),
    ],
)
def test_invalid_config_exits_2_naming_the_field(
    flags: list[str], field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The target does not exist: a config error must be reported before any model is loaded.
    code, out, err = run(["generate", "--prompt", "hi", "--target", "/nonexistent", *flags], capsys)
    assert code == 2
    assert field in err
    assert out == ""


def test_unparsable_flag_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--prompt", "hi", "--threshold", "high"])
    assert exit_info.value.code == 2
    assert "expected a number or 'none'" in capsys.readouterr().err


def test_unknown_model_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["generate", "--prompt", "hi", "--target", "no-such-model"], capsys)
    assert code == 2
    assert "unknown model source 'no-such-model'" in err


def test_every_config_field_has_a_flag_and_defaults_match() -> None:
    args = build_parser().parse_args(["generate", "--prompt", "hi"])
    assert config_from_args(args) == SamplingConfig()
    help_text = build_parser()._subparsers._group_actions[0].choices["generate"].format_help()
    for name in SamplingConfig.model_fields:
        if name != "eos_token_ids":  # taken from the tokenizer
            assert "--" + name.replace("_", "-") in help_text


def test_flags_reach_the_config() -> None:
    argv = ["generate", "--prompt", "hi", "--threshold", "none", "--width", "4", "--w-min", "2"]
    argv += ["--top-k", "5", "--mode", "with_replacement", "--lean-memory", "--seed", "7"]
    config = config_from_args(build_parser().parse_args(argv))
    assert config.threshold is None and config.fixed_width
    assert (config.width, config.w_min, config.top_k, config.seed) == (4, 2, 5, 7)
    assert config.mode == "with_replacement" and config.lean_memory


def test_help_works(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--help"])
    assert exit_info.value.code == 0
    assert "--draft-width" in capsys.readouterr().out


def _bench_parser() -> argparse.ArgumentParser:
    return build_parser()._subparsers._group_actions[0].choices["bench"]


def test_bench_without_a_subcommand_is_bench_decode() -> None:
    """`dsbd bench [flags]` (the commands in the docs) parses as `dsbd bench decode [flags]`."""
    flags = ["--pair", "qwen-coder", "--methods", "beam-w3", "--prompts", "2", "--full"]
    plain = vars(build_parser().parse_args(["bench", *flags]))
    decode = vars(build_parser().parse_args(["bench", "decode", *flags]))
    assert plain.pop("benchmark") is None and decode.pop("benchmark") == "decode"
    assert plain == decode and plain["pair"] == "qwen-coder" and plain["mode"] == "full"


def test_bench_subcommand_flags_are_not_taken_for_decode_flags() -> None:
    """`dsbd bench` reads its own (decode) flags before it hands the rest to a subcommand, and
    argparse stops at an option that abbreviates two of them (`--top` would: --top-k, --top-p).
    So no subcommand flag may be such an abbreviation, or `dsbd bench SUB FLAG` fails."""
    bench = _bench_parser()
    own = set(bench._option_string_actions)
    subcommands = bench._subparsers._group_actions[0].choices
    assert set(subcommands) == {"decode", "serve", "batch", "load", "chaos", "soak"}
    for name, sub in subcommands.items():
        for option in sub._option_string_actions:
            longer = [o for o in own if o.startswith(option) and o != option]
            assert option in own or len(longer) <= 1, (name, option, longer)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--concurrency", "9"], "--concurrency=9: allowed 1..8"),
        (["serve", "--pair", "qwen-coder", "--rounds", "0"], "--rounds=0"),
        (["batch", "--rounds", "0"], "--rounds=0: allowed >= 1"),
        (["load", "--url", "http://127.0.0.1:1", "--clients", "0", "--out", "x"], "--clients=0"),
        (["chaos", "--targets", "router,proxy"], "--targets=router,proxy"),
        (["soak", "--url", "http://127.0.0.1:1"], "--url and --pid go together"),
    ],
)
def test_bench_subcommands_reject_bad_values_before_they_start(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(["bench", *argv], capsys)
    assert code == 2 and message in err


@pytest.mark.parametrize("subcommand", ["decode", "serve", "batch", "load", "chaos", "soak"])
def test_bench_subcommand_help(subcommand: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", subcommand, "--help"])
    assert exit_info.value.code == 0
    assert f"usage: dsbd bench {subcommand}" in capsys.readouterr().out


@pytest.mark.slow
def test_console_script_is_installed() -> None:
    script = Path(sys.executable).with_name("dsbd")
    if not script.exists():
        pytest.skip("dsbd is not installed in this environment (scripts/setup.sh installs it)")
    completed = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0
    assert "generate" in completed.stdout


def test_vocabulary_mismatch_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = save_tiny_model(tmp_path / "t", tiny_tokens(40))
    draft = save_tiny_model(tmp_path / "d", tiny_tokens(32))
    argv = ["generate", "--prompt", "w1", "--target", str(target), "--draft", str(draft)]
    code, _, err = run(argv, capsys)
    assert code == 2
    assert "must share the target's vocabulary" in err


@pytest.mark.parametrize("method", ["dsbd", "sps", "beam", "sample"])
def test_generate_on_tiny_models(
    method: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """End to end through the real decoders on random tiny models: the report adds up."""
    target = save_tiny_model(tmp_path / "t", tiny_tokens(32), seed=1)
    draft = save_tiny_model(tmp_path / "d", tiny_tokens(32), layers=1, seed=2)
    argv = ["generate", "--method", method, "--prompt", "w1 w2 w3", "--target", str(target)]
    argv += ["--draft", str(draft), "--max-new-tokens", "6", "--seed", "0", "--width", "2"]
    # fixed knobs: on random tiny models the draft costs what the target does, so the cost model
    # rightly never drafts in 6 tokens; the draft path is what this test is about
    argv += ["--fixed-knobs"]
    code, out, _ = run([*argv, "--json"], capsys)
    assert code == 0
    report = json.loads(out)
    stats = report["stats"]
    assert report["method"] == method and report["prompt_tokens"] == 3
    assert report["config"]["eos_token_ids"] == [1]
    assert 1 <= stats["tokens_emitted"] <= 6
    assert report["beams"] and all(beam["text"] is not None for beam in report["beams"])
    assert (report["draft"] is not None) == (method in ("dsbd", "sps"))
    assert (stats["draft_forward_passes"] > 0) == (method in ("dsbd", "sps"))

    code, out, _ = run(argv, capsys)  # the human-readable view of the same run
    assert code == 0
    assert f"tokens {stats['tokens_emitted']}," in out and "target passes/token" in out


@pytest.mark.parametrize("method", ["dsbd", "sps", "spec_beam_search"])
@pytest.mark.slow  # over a second: outside the quick loop
def test_generate_with_the_ngram_draft(
    method: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--draft ngram`: the prompt-lookup draft, no weights; fixed knobs draft every iteration,
    the cost model prices it from its own calibration (cached per machine and pair)."""
    monkeypatch.setenv("DSBD_CALIBRATION_DIR", str(tmp_path / "calibration"))
    target = save_tiny_model(tmp_path / "t", tiny_tokens(32), seed=1)
    argv = ["generate", "--method", method, "--prompt", "w1 w2 w3 w1 w2 w3 w1 w2"]
    argv += ["--target", str(target), "--draft", "ngram", "--ngram-max", "2"]
    argv += ["--max-new-tokens", "8", "--seed", "0", "--width", "2", "--json"]
    code, out, _ = run([*argv, "--fixed-knobs"], capsys)
    assert code == 0
    report = json.loads(out)
    assert report["draft"] == "ngram" and "prompt lookup, n-grams up to 2" in report["models"]
    assert report["stats"]["draft_forward_passes"] > 0 and report["stats"]["drafted_tokens"] > 0
    code, out, _ = run(argv, capsys)
    assert code == 0 and json.loads(out)["knobs"]["gamma"]
    assert list((tmp_path / "calibration").glob("*pass-rates*.json"))


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--draft", "ngram", "--ngram-max", "0"], ["ngram_max=0", "allowed 1..16"]),
        (["--draft", "ngram", "--ngram-max", "17"], ["ngram_max=17", "allowed 1..16"]),
        (["--draft", "ngrams"], ["draft", "'ngrams'", "'ngram' (the prompt-lookup draft)"]),
    ],
)
def test_a_bad_draft_exits_2_naming_it(
    flags: list[str], named: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = save_tiny_model(tmp_path / "t", tiny_tokens(32), seed=1)
    code, out, err = run(["generate", "--prompt", "w1", "--target", str(target), *flags], capsys)
    assert code == 2 and out == ""
    assert all(part in err for part in named), err


def test_a_bad_stop_exits_2_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--prompt", "hi", "--target", "/nonexistent", "--stop", ""]
    code, out, err = run(argv, capsys)
    assert code == 2 and out == ""
    assert "--stop: stop[0]='' is empty" in err


def test_generate_stops_at_a_stop_string(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--stop` (repeatable): a beam whose text meets one finishes there, its text cut before."""
    target = save_tiny_model(tmp_path / "t", tiny_tokens(32), seed=1)
    argv = ["generate", "--method", "beam", "--prompt", "w1 w2 w3", "--target", str(target)]
    argv += ["--max-new-tokens", "12", "--seed", "0", "--width", "2", "--json"]
    code, out, _ = run(argv, capsys)
    assert code == 0
    free = json.loads(out)["beams"][0]["text"]
    stop = free.strip()[1:3]  # two characters from inside the free decode
    assert len(stop) == 2
    code, out, _ = run([*argv, "--stop", stop, "--stop", "never-there"], capsys)
    assert code == 0
    beams = json.loads(out)["beams"]
    assert all(stop not in beam["text"] for beam in beams)
    assert any(beam["finished"] for beam in beams)


def test_the_processor_flags_reach_the_config_and_bad_ones_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["generate", "--prompt", "hi", "--min-tokens", "2", "--frequency-penalty", "0.5"]
    argv += ["--presence-penalty", "-1", "--repetition-penalty", "1.3"]
    argv += ["--logit-bias", "5=-100", "--logit-bias", "7=2.5"]
    config = config_from_args(build_parser().parse_args(argv))
    assert (config.min_tokens, config.frequency_penalty, config.presence_penalty) == (2, 0.5, -1)
    assert config.repetition_penalty == 1.3 and config.logit_bias == ((5, -100.0), (7, 2.5))
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--prompt", "hi", "--logit-bias", "5"])
    assert exit_info.value.code == 2 and "expected TOKEN_ID=BIAS" in capsys.readouterr().err
    code, _, err = run(["generate", "--prompt", "hi", "--frequency-penalty", "3"], capsys)
    assert code == 2 and "frequency_penalty=3.0" in err and "less than or equal to 2" in err


def test_generate_applies_the_processors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--logit-bias` banning the free decode's first token moves it; a key outside the
    vocabulary exits 2 naming the flag and the allowed ids."""
    target = save_tiny_model(tmp_path / "t", tiny_tokens(32), seed=1)
    argv = ["generate", "--method", "beam", "--prompt", "w1 w2 w3", "--target", str(target)]
    argv += ["--max-new-tokens", "6", "--seed", "0", "--width", "2", "--json"]
    code, out, _ = run(argv, capsys)
    assert code == 0
    first = json.loads(out)["beams"][0]["token_ids"][0]
    code, out, _ = run(
        [*argv, "--logit-bias", f"{first}=-100", "--repetition-penalty", "2"], capsys
    )
    assert code == 0
    assert all(beam["token_ids"][0] != first for beam in json.loads(out)["beams"])
    code, _, err = run([*argv, "--logit-bias", "99999=1"], capsys)
    assert code == 2 and "--logit-bias: token id 99999 is outside the vocabulary" in err
