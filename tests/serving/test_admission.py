"""Admission by KV bytes (deployments/api/admission.py): the arithmetic, the 400 and the 429, fast.

The end-to-end check (long prompts against a small budget on `dsbd serve`, the replicas' peak
memory under the budget) is tests/serving/test_faults.py::
test_sessions_are_admitted_by_kv_bytes_and_peak_memory_stays_in_budget.
"""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from transformers import LlamaConfig

from deployments.api.admission import MemoryLedger, check_fits, router_view, session_charge
from deployments.api.errors import APIError
from deployments.replicas.memory import WORKING_COPIES, kv_bytes_per_token, replica_memory
from deployments.replicas.model_options import ModelOptions
from dsbd_core import SamplingConfig
from dsbd_core.algorithm.methods import method_config

MIB = 2**20
# 4 layers x 2 (K, V) x 2 KV heads x head dim 16 x 4 bytes (float32) = 1 KiB per token
SMALL = LlamaConfig(
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    hidden_size=64,
    intermediate_size=64,
    vocab_size=320,
)


def _view(budget: int, routers: int = 1, kv: int = 1024) -> dict:
    memory = replica_memory(kv, budget, 0.5, 0)
    return router_view({"memory": memory}, {"memory": memory}, routers)


def test_kv_bytes_per_token_counts_layers_kv_heads_head_dim_and_dtype() -> None:
    assert kv_bytes_per_token(SMALL, torch.float32) == 4 * 2 * 2 * 16 * 4
    assert kv_bytes_per_token(SMALL, torch.bfloat16) == 4 * 2 * 2 * 16 * 2
    assert kv_bytes_per_token(SMALL, torch.float32, tp_size=2) == 4 * 2 * 1 * 16 * 4  # per rank
    mha = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=64)  # no GQA
    assert kv_bytes_per_token(mha, torch.float64) == 2 * 2 * 4 * 16 * 8


def test_the_budget_is_configured_or_a_fraction_of_the_free_memory() -> None:
    configured = replica_memory(1024, 300 * MIB, 0.5, 10 * 2**30)
    assert configured["session_memory_bytes"] == 300 * MIB
    assert configured["source"] == "session_memory_bytes"
    default = replica_memory(1024, None, 0.25, 8 * 2**30)
    assert default["session_memory_bytes"] == 2 * 2**30
    assert "session_memory_fraction=0.25 of 8.00 GiB free" in default["source"]
    assert default["working_copies"] == WORKING_COPIES and default["kv_bytes_per_token"] == 1024
    with pytest.raises(ValidationError):
        ModelOptions(source="smollm2", session_memory_bytes=0)
    with pytest.raises(ValidationError):
        ModelOptions(source="smollm2", session_memory_fraction=1.5)
    # default: from the free memory
    assert ModelOptions(source="smollm2").session_memory_bytes is None


def test_a_decode_is_charged_width_x_columns_x_working_copies_per_side() -> None:
    config = SamplingConfig(width=3, gamma=2, draft_width=4, max_new_tokens=10)
    dsbd, beam = method_config("dsbd", config), method_config("beam", config)
    view = _view(100 * MIB, routers=4)
    assert view["target"]["share_bytes"] == 25 * MIB and view["routers"] == 4
    per_side = 3 * (50 + 10 + 2 * 4) * 1024 * WORKING_COPIES
    assert session_charge(dsbd, 50, view) == {"target": per_side, "draft": per_side}
    plain = 3 * (50 + 10) * 1024 * WORKING_COPIES  # no draft: no forest columns, no draft side
    assert session_charge(beam, 50, view) == {"target": plain}
    assert session_charge(dsbd, 50, None) == {}  # replicas without figures: no charge
    assert router_view({}, {}, 1) == {"routers": 1}


def test_a_decode_that_can_never_fit_is_400_naming_the_field_and_the_limit() -> None:
    view = _view(1 * MIB, routers=2)  # a share of 512 KiB per router
    config = method_config("dsbd", SamplingConfig(width=2, gamma=2, max_new_tokens=20))
    check_fits(config, 10, view, "max_tokens")  # 2 x 34 x 3 KiB = 204 KiB: fits
    check_fits(config, 10, None, "max_tokens")  # no figures: nothing to check
    with pytest.raises(APIError) as caught:
        check_fits(config, 100, view, "max_tokens")  # 2 x 124 x 3 KiB = 744 KiB
    error = caught.value
    assert error.status == 400 and error.param == "max_tokens"
    assert "prompt of 100 tokens + max_tokens=20" in error.message
    assert "target.session_memory_bytes=1048576 / 2 ingress replica(s)" in error.message
    assert "at most 0.5 MiB per decode" in error.message


def test_decodes_beyond_the_budget_get_429_and_leaving_gives_the_bytes_back() -> None:
    view = _view(10 * MIB)
    ledger = MemoryLedger()
    charge = {"target": 4 * MIB, "draft": 4 * MIB}
    ledger.take(charge, view)
    ledger.take(charge, view)
    with pytest.raises(APIError) as caught:
        ledger.take(charge, view)
    assert caught.value.status == 429
    assert "target.session_memory_bytes" in caught.value.message
    assert ledger.admitted == {"target": 8 * MIB, "draft": 8 * MIB}  # a refusal takes nothing
    ledger.give_back(charge)
    ledger.take({"target": 6 * MIB}, view)  # a decode without the draft: the target only
    assert ledger.admitted == {"target": 10 * MIB, "draft": 4 * MIB}
    ledger.give_back(charge)
    ledger.give_back({"target": 6 * MIB})
    assert ledger.admitted == {"target": 0, "draft": 0}
