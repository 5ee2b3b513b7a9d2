"""Speculative-decoding theory (Yin et al., NeurIPS 2024; docs/THEORY.md) for this product.

Pure numpy, float64, named `target` / `draft` throughout (the paper's p is the DRAFT and q the
TARGET — never use p/q here). One purpose per module:

* `distributions`: TV, residual, residual chain, single-step SD and batch-root laws, BI_M;
* `chains`: the Markov-chain instances (random, golden);
* `sd`: Theorem 1 — expected rejections of SD (exact recursion) and a vectorised sampler;
* `batch`: Algorithm 4, Theorem 3 and Proposition 1 — batch SD with M drafts;
* `pareto`: Theorems 4-5 — least bias for an acceptance rule and the rejection/bias front;
* `overaccept`: the ε rule (the product's `epsilon` knob), Decoding-OPT and Decoding-UNO;
* `predictor`: online acceptance estimate per model pair and the (gamma, draft width) rule;
* `simulate`: the paper's simulations as plots + JSON (`dsbd theory simulate`).
"""

from dsbd.theory.batch import (
    expected_rejections_batch,
    expected_rejections_batch_limit,
    rejections_per_position_batch,
    sample_batch_sd,
)
from dsbd.theory.chains import MarkovChain, golden_chain, homogeneous_chain, random_chain
from dsbd.theory.distributions import (
    batch_improvement,
    batch_root_law,
    residual,
    residual_chain,
    sd_step_law,
    tv,
)
from dsbd.theory.overaccept import (
    overaccept_acceptance,
    overaccept_bias,
    overaccept_chain,
    overaccept_layer,
    overaccept_rejection,
    overaccept_step_law,
)
from dsbd.theory.pareto import least_bias, pareto_front, rejection_probability
from dsbd.theory.sd import expected_rejections_sd, rejections_per_position_sd, sample_sd

__all__ = [
    "MarkovChain",
    "batch_improvement",
    "batch_root_law",
    "expected_rejections_batch",
    "expected_rejections_batch_limit",
    "expected_rejections_sd",
    "golden_chain",
    "homogeneous_chain",
    "least_bias",
    "overaccept_acceptance",
    "overaccept_bias",
    "overaccept_chain",
    "overaccept_layer",
    "overaccept_rejection",
    "overaccept_step_law",
    "pareto_front",
    "random_chain",
    "rejection_probability",
    "rejections_per_position_batch",
    "rejections_per_position_sd",
    "residual",
    "residual_chain",
    "sample_batch_sd",
    "sample_sd",
    "sd_step_law",
    "tv",
]
