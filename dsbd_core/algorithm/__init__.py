"""The algorithm layer: exact beam sampling, speculative sampling and DSBD on any `ForestScorer`.

Config, distributions, layer verification, the width rules, the iteration's steps and state,
the one decode loop, the scorer protocol and the exact n-gram table scorer. Pure torch: it
imports neither transformers, Ray, `deployments` nor the CLI (tests/tools/test_layers.py checks).
"""
