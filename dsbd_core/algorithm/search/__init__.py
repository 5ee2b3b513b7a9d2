"""Beam search, deterministic and speculative, and beam sampling under transformers' law: one
search step (`step`), the draft's and the verifier's walks over a forest (`walk`, `sampled` for
the sampled draft), transformers' selection law (`transformers_law`), and the engine that runs
them (`engine`)."""
