"""The errors of the model layer, apart so every module of it can raise them without cycles.

Their messages say what the user can do about the problem, so callers can show them as they
are.
"""

from __future__ import annotations


class ModelSourceError(ValueError):
    """A model source that cannot be loaded, with what the user can do about it."""


class VocabularyMismatchError(ValueError):
    """Draft and target do not share a vocabulary, so draft tokens mean nothing to the target."""
