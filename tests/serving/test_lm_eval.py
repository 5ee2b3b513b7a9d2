"""lm-evaluation-harness run unchanged against `dsbd serve` (its `local-completions` model) on a
task defined here in local files: its loglikelihood results through the server equal those of
its own `hf` model on the same weights, and its generate_until requests decode what that model
decodes greedily.

The served pair is the tiny float64 one (tests/conftest.py `served`); lm-eval's `hf` model
loads the same target directory in float64. Tolerance 1e-9 per log-likelihood: the server
scores a prompt in one forward of another shape (a chain forest through the static KV pool),
so the float64 sums agree to their last bits, not bit for bit.

Issue 52 item 3: on generate_until tasks whose `until` strings are several tokens (GSM8K's
format, "Question:" and a blank line; HumanEval's "\\ndef", "\\nclass", "\\nif"),
`local-completions` and `local-chat-completions` against a `dsbd serve` of the embedded SmolLM2
pair in float32 give exactly the generations of lm-eval's `hf` model on the same weights. It
starts a server of its own (one application, about a minute on two cores); lm-eval's `hf` side
runs meanwhile in a process of its own (`HF_SIDE`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import requests
import yaml

from tests.support.serving_harness import MODEL, serving

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


# Generations through the server on SmolLM2 (issue 52 item 3): lm-eval's `until` strings are of
# several tokens, matched by the server on the generated text, as its `hf` model cuts its own.
QUESTIONS = [
    {"question": "What is 2 + 3?", "answer": "5"},
    {"question": "Tom has 4 apples and eats one. How many apples are left?", "answer": "3"},
    {"question": "What is the capital of France?", "answer": "Paris"},
]
CODE = [  # SmolLM2 goes on with "pass\n\nclass C:" and "\ndef three():" (greedy)
    {"prompt": "class A:\n    pass\n\n\nclass B:\n", "target": "    pass"},
    {"prompt": "def one():\n    return 1\n\n\ndef two():\n    return 2\n\n", "target": ""},
]
GSM_UNTIL = ["Question:", "\n\n"]
CODE_UNTIL = ["\ndef", "\nclass", "\nif"]


def _generate_tasks(root: Path) -> Path:
    """GSM8K's format (`Question: ...\\nAnswer:` until "Question:" or a blank line) and a
    HumanEval-like one (a function head until "\\ndef", "\\nclass", "\\nif"), local data."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "gsm.jsonl").write_text("".join(json.dumps(row) + "\n" for row in QUESTIONS))
    (root / "code.jsonl").write_text("".join(json.dumps(row) + "\n" for row in CODE))
    for name, data, text, target, until, tokens in (
        ("dsbd_gsm", "gsm", "Question: {{question}}\\nAnswer:", "answer", GSM_UNTIL, 32),
        ("dsbd_code", "code", "{{prompt}}", "target", CODE_UNTIL, 40),
    ):
        (root / f"{name}.yaml").write_text(f"""task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / f"{data}.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "{text}"
doc_to_target: "{{{{{target}}}}}"
generation_kwargs:
  until: {json.dumps(until)}
  max_gen_toks: {tokens}
  do_sample: false
metric_list:
  - metric: exact_match
""")
    return root


def _smollm2_config(root: Path) -> Path:
    """One application serving the embedded SmolLM2 pair in float32 (lm-eval's `hf` dtype).

    Its requests run fixed knobs (`adaptive: false`): what this module checks is the text lm-eval
    gets back, which the adaptive path's depths do not change (every method keeps its law), and
    an adaptive first request waits for the served calibration of the pair (83 s of this test's
    186 s on a 2-core AMD EPYC); tests/serving/test_serve_run.py serves the adaptive path with
    its calibration, on the tiny pair (checked to draft) and on the embedded models (the README's
    command)."""
    small = {"num_cpus": 0.1}
    app = {
        "model_name": "smollm2",
        "target": {"source": "smollm2", "dtype": "float32"},
        "draft": {"source": "smollm2-draft", "dtype": "float32"},
        "router_resources": small,
        "draft_resources": small,
        "verifier_resources": small,
        "request_defaults": {"adaptive": False},
    }
    config = {
        "applications": [
            {
                "name": "dsbd",
                "route_prefix": "/",
                "import_path": "deployments.app:build_app",
                "args": app,
            }
        ]
    }
    (root / "serve.yaml").write_text(yaml.safe_dump(config))
    return root / "serve.yaml"


def _generations(results: dict, task: str) -> list[str]:
    return [s["filtered_resps"][0] for s in results["samples"][task]]


# lm-eval's `hf` model on the same tasks, plain and with the chat template, in a process of its
# own: it runs while the server starts and answers (one core each on two), not after it.
HF_SIDE = """
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager
weights, include, tasks, out = sys.argv[1], sys.argv[2], sys.argv[3].split(","), sys.argv[4]
manager = TaskManager(include_path=include)
found = {}
for name, chat in (("plain", False), ("chat", True)):
    results = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={weights},dtype=float32", device="cpu", tasks=tasks,
        task_manager=manager, apply_chat_template=chat, log_samples=True,
    )
    found[name] = {t: [s["filtered_resps"][0] for s in results["samples"][t]] for t in tasks}
open(out, "w").write(json.dumps(found))
"""


@pytest.mark.real_model
def test_lm_eval_generate_until_on_smollm2_equals_its_hf_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`local-completions` and `local-chat-completions` against `dsbd serve` on SmolLM2 give
    exactly the generations of lm-eval's `hf` model (float32, greedy) on tasks whose `until`
    strings are several tokens long. Stops are met: the same requests with
    `include_stop_str_in_output` end in the stop string `stop_reason` names, right after the
    generation, so the server's matching on the text is what ends them."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):  # local files only, no hub
        monkeypatch.setenv(name, "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    from dsbd_core.models.loading import prepare_preset

    weights = str(prepare_preset("smollm2"))  # the directory the target replica loads
    manager = TaskManager(include_path=str(_generate_tasks(tmp_path / "tasks")))
    tasks = ["dsbd_gsm", "dsbd_code"]
    hf_out = tmp_path / "hf.json"
    with (tmp_path / "hf.log").open("w") as log:  # the child keeps its own copy of the file
        hf_side = subprocess.Popen(
            [sys.executable, "-c", HF_SIDE, weights, str(tmp_path / "tasks"), ",".join(tasks)]
            + [str(hf_out)],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    try:
        (tmp_path / "server").mkdir()
        with serving(tmp_path / "server", _smollm2_config(tmp_path / "server")) as server:
            url = server["url"]
            common = (
                f"model=smollm2,tokenizer_backend=huggingface,tokenizer={weights},max_retries=1"
            )
            completions = lm_eval.simple_evaluate(
                model="local-completions",
                model_args=f"{common},base_url={url}/v1/completions,num_concurrent=1,batch_size=2",
                tasks=tasks,
                task_manager=manager,
                log_samples=True,
            )
            chat = lm_eval.simple_evaluate(
                model="local-chat-completions",
                model_args=f"model=smollm2,base_url={url}/v1/chat/completions,max_retries=1",
                tasks=tasks,
                task_manager=manager,
                apply_chat_template=True,
                log_samples=True,
            )
            # the same requests with `include_stop_str_in_output`: which stop ended each one
            kept = {
                task: [
                    requests.post(
                        f"{url}/v1/completions",
                        json={
                            "model": "smollm2",
                            "prompt": s["arguments"][0][0],
                            "max_tokens": tokens,
                            "temperature": 0,
                            "stop": until,
                            "include_stop_str_in_output": True,
                        },
                        timeout=120,
                    ).json()["choices"][0]
                    for s in completions["samples"][task]
                ]
                for task, tokens, until in (
                    ("dsbd_gsm", 32, GSM_UNTIL),
                    ("dsbd_code", 40, CODE_UNTIL),
                )
            }
    except BaseException:  # no generation to compare with: stop it
        hf_side.kill()
        raise
    assert hf_side.wait(timeout=600) == 0, (tmp_path / "hf.log").read_text()[-3000:]
    local = json.loads(hf_out.read_text())
    for task, until in (("dsbd_gsm", GSM_UNTIL), ("dsbd_code", CODE_UNTIL)):
        served, own = _generations(completions, task), local["plain"][task]
        assert served == own, (task, served, own)
        assert _generations(chat, task) == local["chat"][task], task
        # stops of several tokens ended generations: the text with the stop kept is the
        # generation and then the stop string that `stop_reason` names
        ended = [c for c in kept[task] if c["finish_reason"] == "stop"]
        assert [c for c in ended if c["stop_reason"] in until], kept[task]
        for generation, choice in zip(served, kept[task], strict=True):
            assert choice["text"] == generation + (choice["stop_reason"] or ""), choice
        print(task, "completions:", served, "chat:", _generations(chat, task))
