"""lm-evaluation-harness run unchanged against `dsbd serve` (its `local-completions` model) on a
task defined here in local files: its loglikelihood results through the server equal those of
its own `hf` model on the same weights, and its generate_until requests decode what that model
decodes greedily.

The served pair is the tiny float64 one (tests/conftest.py `served`); lm-eval's `hf` model
loads the same target directory in float64. Tolerance 1e-9 per log-likelihood: the server
scores a prompt in one forward of another shape (a chain forest through the static KV pool),
so the float64 sums agree to their last bits, not bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.serving_harness import MODEL

CHOICES = [
    {"question": "one two three", "choices": [" four", " five", " ten"], "answer": 0},
    {
        "question": "The quick brown fox jumps over the lazy",
        "choices": [" dog", " fox"],
        "answer": 0,
    },
    {
        "question": "What is the capital of France? Paris is the capital of",
        "choices": [" France", " Paris", " dog"],
        "answer": 0,
    },
]
GENERATE = [
    {"prompt": "one two three", "target": " four"},
    {"prompt": "def add(a, b):", "target": "\n    return a + b"},
]


def _tasks(root: Path) -> Path:
    """Two tasks in `root`: multiple choice (loglikelihood) and generate_until, local data."""
    (root / "choice.jsonl").write_text("".join(json.dumps(row) + "\n" for row in CHOICES))
    (root / "generate.jsonl").write_text("".join(json.dumps(row) + "\n" for row in GENERATE))
    (root / "dsbd_choice.yaml").write_text(f"""task: dsbd_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / "choice.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
""")
    (root / "dsbd_generate.yaml").write_text(f"""task: dsbd_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / "generate.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["<|im_end|>"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
""")
    return root


@pytest.fixture(scope="module")
def server(served):
    return served


def test_lm_eval_through_the_server_equals_its_hf_model(
    server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):  # local files only, no hub
        monkeypatch.setenv(name, "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(_tasks(tmp_path)))
    target = str(server["target"])
    served = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=(
            f"model={MODEL},base_url={server['url']}/v1/completions,"
            f"tokenizer_backend=huggingface,tokenizer={target},max_retries=1,"
            "num_concurrent=1,batch_size=2"
        ),
        tasks=["dsbd_choice", "dsbd_generate"],
        task_manager=manager,
        log_samples=True,
    )
    local = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={target},dtype=float64",
        device="cpu",
        tasks=["dsbd_choice", "dsbd_generate"],
        task_manager=manager,
        log_samples=True,
    )
    through, own = served["samples"]["dsbd_choice"], local["samples"]["dsbd_choice"]
    assert len(through) == len(own) == len(CHOICES)
    compared = 0
    for a, b in zip(through, own, strict=True):
        for (ll_a, greedy_a), (ll_b, greedy_b) in zip(
            a["filtered_resps"], b["filtered_resps"], strict=True
        ):
            assert abs(ll_a - ll_b) < 1e-9 and greedy_a == greedy_b, (a["doc"], ll_a, ll_b)
            compared += 1
    assert compared == sum(len(row["choices"]) for row in CHOICES)
    assert (
        served["results"]["dsbd_choice"]["acc,none"] == local["results"]["dsbd_choice"]["acc,none"]
    )
    generated = [s["filtered_resps"][0] for s in served["samples"]["dsbd_generate"]]
    greedy = [s["filtered_resps"][0] for s in local["samples"]["dsbd_generate"]]
    assert len(generated) == len(GENERATE) and generated == greedy  # greedy, both ways
