"""dsbd_core: exact beam sampling, speculative sampling and DSBD on any causal LM.

Pure torch (+ transformers for real models); knows nothing of Ray.

The names below resolve on first use (PEP 562, `algorithm/lazy_names.py`): a process that needs
only the request schema or the method catalogue (the CLI's parser, Serve's ingress and session
registry) does not import torch for them; a Serve replica's imports are most of the CPU it
spends starting, and a server starts a dozen at once on two cores.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dsbd_core.algorithm.lazy_names import lazy_names

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


__getattr__, __dir__ = lazy_names(f"{__name__}.algorithm", _EXPORTS, globals())
