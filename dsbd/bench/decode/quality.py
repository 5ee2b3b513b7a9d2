"""Quality figures that are comparable across methods, and how noise is judged.

* Log-likelihood: the target's log-probability of the returned answer (raw distribution: no
  temperature or filtering), recomputed here by one plain forward of the target over prompt +
  answer for *every* method, transformers' included, so all numbers come from the same code.
  Our engine tracks the same quantity while decoding; the two are recorded side by side and the
  tests check that they agree.
* Noise: each method answers each prompt once, so a difference between two methods mixes the
  methods' effect with sampling luck. The judge is a paired bootstrap over prompts: resample the
  prompts with replacement, recompute the mean per-prompt difference (method minus beam
  sampling at the same W), and take the 2.5 / 97.5 % quantiles. "Not worse beyond noise" means
  the interval's upper end is >= 0 for a lower-is-worse figure (its lower end may be anywhere).
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import PreTrainedModel

BOOTSTRAP_RESAMPLES = 10_000


def answer_log_likelihood(
    model: PreTrainedModel, prompt_ids: list[int], answer_ids: list[int]
) -> float:
    """Sum over the answer's tokens of log p_target(token | prompt, earlier answer tokens)."""
    if not answer_ids:
        return 0.0
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(answer_ids)], dtype=torch.long, device=device)
    with torch.inference_mode():
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=len(answer_ids) + 1).logits
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logp = logits[0, :-1].to(dtype).log_softmax(-1)
    target = torch.tensor(answer_ids, dtype=torch.long, device=logp.device)
    return float(logp.gather(1, target[:, None]).sum())


def paired_bootstrap(
    differences: list[float], *, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0
) -> dict[str, float | int]:
    """Mean of per-prompt differences and its 95 % paired-bootstrap interval."""
    values = np.asarray(differences, dtype=np.float64)
    n = values.size
    if n == 0:
        return {"n": 0, "mean": float("nan"), "low": float("nan"), "high": float("nan")}
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, n, size=(resamples, n))].mean(axis=1)
    low, high = np.quantile(means, [0.025, 0.975])
    return {"n": int(n), "mean": float(values.mean()), "low": float(low), "high": float(high)}


def ratio_bootstrap(
    numerator: list[tuple[float, float]],
    denominator: list[tuple[float, float]],
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> dict[str, float | int]:
    """Ratio of two per-token rates, (sum a / sum b) / (sum c / sum d), paired over prompts.

    numerator[i] = (seconds, tokens) of the method on prompt i; denominator[i] the reference's.
    """
    a = np.asarray(numerator, dtype=np.float64).reshape(-1, 2)
    b = np.asarray(denominator, dtype=np.float64).reshape(-1, 2)
    n = a.shape[0]
    if n == 0 or b.shape[0] != n:
        return {"n": int(n), "ratio": float("nan"), "low": float("nan"), "high": float("nan")}

    def rate_ratio(rows: np.ndarray) -> np.ndarray:
        num = a[rows, 0].sum(-1) / np.maximum(a[rows, 1].sum(-1), 1)
        den = b[rows, 0].sum(-1) / np.maximum(b[rows, 1].sum(-1), 1)
        return num / den

    rng = np.random.default_rng(seed)
    samples = rate_ratio(rng.integers(0, n, size=(resamples, n)))
    low, high = np.quantile(samples, [0.025, 0.975])
    return {
        "n": int(n),
        "ratio": float(rate_ratio(np.arange(n))),
        "low": float(low),
        "high": float(high),
    }
