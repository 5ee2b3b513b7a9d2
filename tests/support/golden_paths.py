"""How the golden-token recorder reaches the lockstep decoder (the one import that moves when
the package layout changes: keep it here so `golden_tokens.py` itself never changes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def lockstep_decode(
    make_models: Callable[[], tuple[torch.nn.Module, torch.nn.Module]],
    requests: list[tuple[str, str, Any, list[int]]],
) -> list[Any]:
    from dsbd_core.algorithm.drivers.lockstep import Request, decode_lockstep
    from dsbd_core.algorithm.drivers.session_batch import SessionBatcher
    from dsbd_core.models.transformer_scorer import TransformerScorer

    target, draft = make_models()
    results, _ = decode_lockstep(
        [Request(prompt, config, method) for _, method, config, prompt in requests],
        SessionBatcher(TransformerScorer(target)),
        SessionBatcher(TransformerScorer(draft)),
    )
    for result in results:
        if result.error is not None:
            raise result.error
    return [result.result for result in results]
