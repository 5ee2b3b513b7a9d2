"""Tools built on the algorithm and model layers: draft distillation, acceptance measurement,
the benchmark harness and the speculative-decoding theory. Never Ray, `deployments` or the CLI.
"""
