"""A target/draft pair of exact n-gram tables (`TableScorer`) the engine tests decode on."""

from __future__ import annotations

import numpy as np
import torch

from dsbd_core import TableScorer
from tests.support.exact_reference import random_table

VOCAB = 6


def scorers(seed: int = 0) -> tuple[TableScorer, TableScorer]:
    """A target and a draft: random trigram tables over VOCAB tokens (`seed` draws both)."""
    rng = np.random.default_rng(seed)
    target = random_table(rng, VOCAB, 3, concentration=0.8)
    draft = random_table(rng, VOCAB, 3, concentration=0.8)
    return TableScorer(torch.from_numpy(target)), TableScorer(torch.from_numpy(draft))
