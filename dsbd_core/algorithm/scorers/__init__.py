"""Scorers that are no neural model: the exact n-gram table of the tests and theory
(`table_scorer`) and the prompt-lookup draft (`ngram_draft`). The protocol they implement is
`dsbd_core.algorithm.scorer`; the transformers scorers live in `dsbd_core.models`."""
