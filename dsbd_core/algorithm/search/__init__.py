"""Beam search, deterministic and speculative: one search step (`step`), the draft's and the
verifier's walks over a forest (`walk`, `sampled` for the sampled draft), and the engine that
runs them (`engine`)."""
