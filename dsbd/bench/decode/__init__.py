"""`dsbd bench`: every decoder side by side in one process run, with comparable figures.

Why one process and interleaved methods: this repository is measured on a shared 2-core CPU
whose speed drifts by 2-5x when other jobs run; timing method A for an hour and method B the
next hour measures the neighbours. Running every method on prompt 1, then every method on
prompt 2, ... (in a rotated order) makes the *ratios* between methods robust even when the
absolute times are not.

Modules (one purpose each):
  methods    the method catalogue and the `--methods` name grammar (dsbd-w3-g3-t0.9-wmin2 ...)
  prompts    the prompt sets of each pair (the documented place other harnesses reuse)
  schema     the result records (pydantic): per method per prompt, per method aggregates
  measure    forward-pass hooks, target KV-cache bytes, RSS sampling, CUDA peak, NVML energy
  runners    one decode of one method on one prompt, ours or transformers' own `generate`
  quality    target log-likelihood of an answer, paired bootstrap against beam sampling
  humaneval  HumanEval completions run in a sandboxed subprocess (no network, timeout)
  report     aggregates, table.md and the plots
  harness    the run loop: load the pair, warm up, interleave, checkpoint, resume

The `dsbd bench` flags and entry are the CLI's (dsbd/bench_command.py): it builds the
BenchConfig and calls `harness.run_bench`; nothing here reads a command line.
"""
