"""The cost model's calibration of a target with the prompt-lookup draft (`--draft ngram`).

Priced like any draft (`calibrate.calibrate`), with what differs said here: the draft's forward
costs nothing (`LOOKUP_COSTS`: its per-node work is a look-up, which the whole iterations timed
at each depth include), and its tables are as wide as the distinct tokens of the context, so
the engine's own work is timed at `LOOKUP_SUPPORT` columns. Its pass rates (DSBD's and SpS's)
and whole-iteration seconds are measured on the same prompts as a model draft's and cached
per machine and pair: the pair's identity names the draft `ngram-<n>`. The cost model then
chooses each iteration's depth from them and from the request's own passes, so a request whose
text does not repeat soon decodes as beam sampling.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from typing import Any, Protocol

from dsbd_core.algorithm.policy.cost_model import Calibration, ForwardCosts
from dsbd_core.algorithm.scorers.ngram_draft import NgramDraft
from dsbd_core.models.calibrate import (
    ITERATION_TOKENS,
    PASS_RATE_TOKENS,
    assemble,
    iteration_fields,
    measure_iteration_seconds,
    measure_pass_rates,
    model_costs,
    pass_rate_inputs,
    read_cached,
    store_cached,
)
from dsbd_core.models.decode_path import make_scorer
from dsbd_core.models.loading import LoadedModel


class LookupPair(Protocol):
    """What the calibration reads of a `pair.LoadedPair` with the look-up draft (a protocol:
    `pair` calls this module, so importing it back would be a cycle)."""

    target: LoadedModel
    lookup: int | None
    decode_path: str

    @property
    def stop_ids(self) -> tuple[int, ...]: ...

    def identity(self) -> dict[str, object]: ...

    def describe(self) -> str: ...


# A look-up is no model forward: zero seconds whatever it is fed.
LOOKUP_COSTS = ForwardCosts(tokens=[1], seconds=[0.0])
# The width of the draft's tables the engine's work is timed at: a few hundred lines of code
# or chat hold about this many distinct tokens.
LOOKUP_SUPPORT = 1024


def calibrate_lookup(
    pair: LookupPair, *, force: bool = False, say: Callable[[str], None] = print
) -> Calibration:
    """The calibration of `pair` (a target with `lookup` set): from the cache, or measured now."""
    assert pair.lookup is not None, "a pair with the prompt-lookup draft"
    lookup = pair.lookup
    start = time.perf_counter()
    identity = pair.identity()
    say(f"cost model calibration (measured once per machine, then cached): {pair.describe()}")
    skip = ("target", "draft", "description", "decode_path")
    common = {k: v for k, v in identity.items() if k not in skip}
    target = pair.target.model
    costs = model_costs(
        target, {"model": identity["target"], **common}, force=force, path=pair.decode_path
    )
    vocab = pair.target.vocab_size
    calibration = assemble(
        costs,
        LOOKUP_COSTS,
        vocab,
        min(LOOKUP_SUPPORT, vocab),
        str(identity["description"]),
        force=force,
    )
    inputs = pass_rate_inputs(pair.target)
    prompts, stop_ids = inputs["prompts"], pair.stop_ids

    def measured(name: str, measure: Callable[..., Any], tokens: int) -> Any:
        parts = {**identity, "prompts": prompts, "tokens": tokens, "stop": stop_ids}
        text = None if force else read_cached(name, parts)
        if text is None:
            scorers = make_scorer(target, pair.decode_path), NgramDraft(vocab, lookup)
            text = json.dumps(measure(*scorers, prompts, stop_ids))
            store_cached(name, parts, text)
        return json.loads(text)

    rates, single = (
        [float(x) for x in measured(f"{m}-pass-rates", rate, PASS_RATE_TOKENS)]
        for m, rate in (
            ("dsbd", functools.partial(measure_pass_rates, method="dsbd")),
            ("sps", functools.partial(measure_pass_rates, method="sps")),
        )
    )
    calibration = calibration.model_copy(update={"pass_rates": rates, "single_pass_rates": single})
    say(f"the pair's pass rates per drafted layer: {', '.join(f'{r:.2f}' for r in rates)}")
    say(f"... and with one drafted beam (SpS): {', '.join(f'{r:.2f}' for r in single)}")
    timed = measured("iteration-seconds", measure_iteration_seconds, ITERATION_TOKENS)
    calibration = calibration.model_copy(update=iteration_fields(timed, stop_ids))
    say(f"seconds per iteration by depth and the draft's catch-up per step behind: {timed}")
    say(f"calibration ready in {time.perf_counter() - start:.1f} s")
    return calibration
