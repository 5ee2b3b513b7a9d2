"""The algorithm layer: exact beam sampling, speculative sampling and DSBD on any `ForestScorer`.

At the door, what a caller names and sets: `config` (SamplingConfig), `methods` (the method
catalogue), `scorer` (the ForestScorer protocol), `engine` (one iteration's two sides, draft and
target, as steps a process boundary can cut) and `reference` (the same iteration written plainly,
the engine's oracle in the tests). Behind it, by role and floor (each imports only lower floors;
tests/tools/test_layers.py checks):

    drivers/     the decode loop, generate, lockstep and shared-forward batches, cache replay
    search/      beam search and beam sampling under transformers' law
    reference    engine
    iteration/   draft forest, layer verification, width rule, next beams, compiled sides
    policy/      gamma and draft width per iteration: control, cost model, iteration timing
    sequences/   state, log-probs, result, stops, penalties        scorers/   table, n-gram look-up
    draws/       counter-hash streams, distributions, candidates, host reads
    config  methods  scorer  lazy_names (the PEP 562 names of dsbd_core and dsbd_core.models)

Pure torch: it imports neither transformers, Ray, `deployments` nor the CLI.
"""
