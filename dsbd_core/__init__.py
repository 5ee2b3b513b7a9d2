"""dsbd_core: exact beam sampling, speculative sampling and DSBD on any causal LM.

Pure torch (+ transformers for real models); knows nothing of Ray.

The names below resolve on first use (PEP 562), as in `dsbd_core.models`: a process that needs
only the request schema or the method catalogue (the CLI's parser, Serve's ingress and session
registry) does not import torch for them; a Serve replica's imports are most of the CPU it
spends starting, and a server starts a dozen at once on two cores.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dsbd_core.algorithm.config import SamplingConfig, config_error_message
    from dsbd_core.algorithm.drivers.decoders import generate, generate_batch
    from dsbd_core.algorithm.methods import METHODS
    from dsbd_core.algorithm.scorer import ForestLayer, ForestLogprobs, ForestScorer, Origin
    from dsbd_core.algorithm.scorers.ngram_draft import NgramDraft
    from dsbd_core.algorithm.scorers.table_scorer import TableScorer
    from dsbd_core.algorithm.sequences.result import Beam, DecodeResult, DecodeStats

_EXPORTS = {
    "SamplingConfig": "config",
    "config_error_message": "config",
    "generate": "drivers.decoders",
    "generate_batch": "drivers.decoders",
    "METHODS": "methods",
    "ForestLayer": "scorer",
    "ForestLogprobs": "scorer",
    "ForestScorer": "scorer",
    "Origin": "scorer",
    "NgramDraft": "scorers.ngram_draft",
    "TableScorer": "scorers.table_scorer",
    "Beam": "sequences.result",
    "DecodeResult": "sequences.result",
    "DecodeStats": "sequences.result",
}

__all__ = [
    "METHODS",
    "Beam",
    "DecodeResult",
    "DecodeStats",
    "ForestLayer",
    "ForestLogprobs",
    "ForestScorer",
    "NgramDraft",
    "Origin",
    "SamplingConfig",
    "TableScorer",
    "config_error_message",
    "generate",
    "generate_batch",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.algorithm.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
