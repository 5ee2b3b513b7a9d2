"""Short chat prompts the serving and batching benchmarks share (`dsbd bench serve`, `dsbd bench
batch --in-process`): eight everyday questions, so both decode the same requests."""

from __future__ import annotations

PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "Write a haiku about autumn leaves.",
    "What is the capital of France?",
    "Give three tips for learning to cook.",
    "Describe a bicycle to a child.",
    "Why do we have seasons?",
    "Name three primary colours.",
    "What does a compiler do?",
]
