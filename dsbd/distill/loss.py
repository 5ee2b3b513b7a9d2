"""The distillation objective: KL(p || q) (and TV) between the cached target and the draft.

Only the target's top-k and its remaining mass are cached, so both are computed on the
coarsening {top-k tokens, everything else}, where they bound the full divergences from below.
"""

from __future__ import annotations

import torch


def kd_loss(
    logits: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logp: torch.Tensor,
    rest: torch.Tensor,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row KL(p || q) and TV(p, q) on the coarsening {top-k tokens, everything else}.

    p: the target's top-k probabilities and its remaining mass `rest` (renormalised to sum to
    one against fp16 round-off); q: softmax(logits / temperature) over the full vocabulary,
    its mass outside the target's top-k lumped into one bucket. On that coarsening KL and TV are
    lower bounds of the full ones, and equal them when the target's tail is empty.
    """
    logq = torch.log_softmax(logits.float() / temperature, dim=-1)
    logq_top = logq.gather(-1, topk_ids)
    masked = logq.scatter(-1, topk_ids, float("-inf"))
    logq_rest = torch.logsumexp(masked, dim=-1)
    p_top = topk_logp.exp()
    total = p_top.sum(-1) + rest
    p_top = p_top / total[:, None]
    p_rest = rest / total
    logp_top = torch.log(p_top.clamp(min=1e-30))
    kl = (p_top * (logp_top - logq_top)).sum(-1) + torch.where(
        p_rest > 0, p_rest * (torch.log(p_rest.clamp(min=1e-30)) - logq_rest), 0.0
    )
    tv = 0.5 * ((p_top - logq_top.exp()).abs().sum(-1) + (p_rest - logq_rest.exp()).abs())
    return kl, tv
