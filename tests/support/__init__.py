"""What the tests share (no tests here: pytest collects only `test_*.py`). A test module imports
from this package, never from another test module (tests/tools/test_layers.py checks it); a
fixture several modules use lives in a conftest.py.

- `exact_reference`: the independent exact enumeration of the paper's law and of sampling on
  n-gram tables (`TableLM`, `random_table`, ...), re-exporting `exact_statistics`.
- `exact_statistics`: do samples look like i.i.d. draws from a known law (`assert_matches`,
  `empirical`, `tv`, `null_tv_quantile`).
- `exact_transformers`: the exact output law of transformers' beam sampling, by enumeration.
- `exact_penalties`: `PenalisedLM`, a model with the per-beam processors applied, for the
  exactness references.
- `forest_cases`: the TransformerScorer tests' tiny models, random forests and exact references.
- `tiny_models`: tiny real models and tokenizers: `build_pair` saves a served target/draft
  pair, `tiny_model` any TINY_SHAPE model, `tiny` the engine tests' float64 model (VOCAB tokens),
  `random_llama` and `noisy_copy` a float64 target and its draft, `save_tiny_model` a word-level
  one (`tiny_tokens`) as a directory.
- `beam_search`: our methods against transformers' searches (`ours`, `assert_same_hypotheses`),
  transformers' sampled beams against its enumerated law (`ModelLM`, `as_sets`, `until_eos`),
  and each session's returned sequences as a set (`outcomes_of`).
- `table_scorers`: `scorers`, a target/draft pair of exact n-gram tables (`TableScorer`).
- `meta_device`: `same_decodes`, a decode under torch's `meta` default device equals the plain
  one (the engine makes no tensor off its state's device).
- `host_work`: `counting` graph calls, host reads and the tensor operations outside the graphs.
- `cpu`: `AMX`, `needs_amx` (the figures measured on AMX kernels).
- `iteration_calls`: `first_call`, the router's first iteration of a DSBD request.
- `bench_configs`: `bench_config`, the `dsbd bench` tests' quick run on the tiny pair (METHODS).
- `golden_tokens` (`python -m tests.support.golden_tokens` records tests/data/golden_tokens.json)
  and `golden_paths`: the seeded decodes a refactor must not move.
- `serving_harness`: the shared six-application `dsbd serve` of tests/conftest.py's `served`,
  its config and the server helpers (`stop`, `leftovers`, `free_port`, `tiny_app`).
- `observability_harness`: the prompt and the loopback OTLP/HTTP receiver of the observability
  tests.
- `api_choices`: a served stream's log-probs per choice, a choice's text, a midway stop string.
- `loopback`: whom a traced process tree reached (`strace`, `peers`) and `is_loopback`.
- `terminal`: a pseudo-terminal for what a command shows on a terminal.
- `tp_harness`: a recorded scorer script replayed on N local gloo ranks.
- `tp_ray_checks`: the tensor-parallel group's checks on a real local Ray, run as a subprocess
  (`python -m tests.support.tp_ray_checks WORK_DIR`) by tests/serving/test_tp_group.py.
"""
