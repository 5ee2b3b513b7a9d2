"""dsbd_core: exact beam sampling, speculative sampling and DSBD on any causal LM.

Pure torch (+ transformers for real models); knows nothing of Ray.
"""

from dsbd_core.algorithm.config import SamplingConfig, config_error_message
from dsbd_core.algorithm.drivers.decoders import generate, generate_batch
from dsbd_core.algorithm.methods import METHODS
from dsbd_core.algorithm.scorer import ForestLayer, ForestLogprobs, ForestScorer, Origin
from dsbd_core.algorithm.scorers.ngram_draft import NgramDraft
from dsbd_core.algorithm.scorers.table_scorer import TableScorer
from dsbd_core.algorithm.sequences.result import Beam, DecodeResult, DecodeStats

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
