"""What the tests share (no tests here: pytest collects only `test_*.py`).

- `exact_reference`: the independent exact enumeration of the paper's law and of sampling on
  n-gram tables (`TableLM`, `random_table`, ...), re-exporting `exact_statistics`.
- `exact_statistics`: do samples look like i.i.d. draws from a known law (`assert_matches`,
  `empirical`, `tv`, `null_tv_quantile`).
- `exact_transformers`: the exact output law of transformers' beam sampling, by enumeration.
- `exact_penalties`: `PenalisedLM`, a model with the per-beam processors applied, for the
  exactness references.
- `forest_cases`: the TransformerScorer tests' tiny models, random forests and exact references.
- `tiny_models`: tiny real models and tokenizers (`build_pair` saves a target/draft pair).
- `golden_tokens` (`python -m tests.support.golden_tokens` records tests/data/golden_tokens.json)
  and `golden_paths`: the seeded decodes a refactor must not move.
- `serving_harness`: the shared four-application `dsbd serve` of tests/conftest.py's `served`,
  its config and the server helpers (`stop`, `leftovers`, `free_port`, `tiny_app`).
- `observability_harness`: the prompt and the loopback OTLP/HTTP receiver of the observability
  tests.
- `api_choices`: a served stream's log-probs per choice, a choice's text, a midway stop string.
- `terminal`: a pseudo-terminal for what a command shows on a terminal.
- `tp_harness`: a recorded scorer script replayed on N local gloo ranks.
- `tp_ray_checks`: the tensor-parallel group's checks on a real local Ray, run as a subprocess
  (`python -m tests.support.tp_ray_checks WORK_DIR`) by tests/serving/test_tp_group.py.
"""
