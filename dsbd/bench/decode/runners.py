"""One decode of one method on one prompt: our engine, or transformers' own `generate`.

Both return the answer the quality figures are computed on (the best beam for beam methods,
the sample for sampling methods) and the number of decoding steps the time is divided by:

* ours: `DecodeStats.tokens_emitted`, the length of the longest generated sequence (for
  beam methods the steps taken, since every beam grows by one token per step);
* transformers' sampling, assisted generation and prompt lookup: the generated length of the
  one sequence;
* transformers' beam sampling and beam search: its steps, i.e. its target forward calls (one
  per step, the first being the prefill), since the returned best beam can be shorter than the
  search ran.

transformers is given every sampling knob explicitly (temperature, top_k = 0, top_p, no
repetition penalty, our stop ids) so neither a model's generation_config nor transformers'
global defaults (top_k = 50) change the distribution behind our back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig

from dsbd.bench.decode.measure import ForwardCounter
from dsbd.bench.decode.methods import MethodSpec
from dsbd_core.algorithm.config import SamplingConfig
from dsbd_core.algorithm.drivers.decoders import generate, method_config
from dsbd_core.algorithm.policy.cost_model import Calibration, CostController
from dsbd_core.algorithm.scorers.ngram_bounds import NGRAM_DEFAULT
from dsbd_core.algorithm.scorers.ngram_draft import NgramDraft
from dsbd_core.models import LoadedModel
from dsbd_core.models.decode_path import make_scorer
from dsbd_core.models.transformer_scorer import TransformerScorer


@dataclass
class Pair:
    """A loaded target (and draft), where they run, and the hooks that count their forwards."""

    target: LoadedModel
    draft: LoadedModel | None
    device: torch.device
    stop_ids: tuple[int, ...]
    calibration: Calibration | None = None  # the cost model's (None: fixed knobs only)
    decode_path: str = "dynamic"  # our methods' scorers (`decode_path.make_scorer`)
    ngram_max: int = NGRAM_DEFAULT  # the prompt-lookup draft's bound (-ng, hf-lookup)
    lookup_calibration: Calibration | None = None  # the cost model's with the prompt lookup
    scorers: dict = field(default_factory=dict)  # one per model for the run (see `scorer`)
    target_counter: ForwardCounter = field(init=False)
    draft_counter: ForwardCounter | None = field(init=False)

    def __post_init__(self) -> None:
        self.target_counter = ForwardCounter(self.target.model)
        self.draft_counter = ForwardCounter(self.draft.model) if self.draft else None

    def scorer(self, which: str) -> TransformerScorer:
        """The target's or the draft's scorer, made once for the whole run: a static one keeps
        its KV pool and captured buckets from decode to decode (a scorer holds no session
        after a decode: `generate` releases it)."""
        if which not in self.scorers:
            loaded = self.target if which == "target" else self.draft
            assert loaded is not None
            self.scorers[which] = make_scorer(loaded.model, self.decode_path)
        return self.scorers[which]

    def reset_counters(self) -> None:
        self.target_counter.reset()
        if self.draft_counter is not None:
            self.draft_counter.reset()

    @property
    def pad_id(self) -> int:
        pad = self.target.tokenizer.pad_token_id
        return int(pad) if pad is not None else self.stop_ids[0]


@dataclass
class Decoded:
    """What one decode returned."""

    answer_ids: list[int]  # generated tokens of the answer, up to and including a stop token
    tokens: int  # decoding steps (see the module docstring)
    engine_stats: dict | None = None  # DecodeStats.as_dict() for our methods
    engine_loglik: float | None = None  # the engine's own log-likelihood of the answer
    lookup_calls: int | None = None  # -ng: the prompt lookup's calls (it has no forward hook)


def run_engine(
    spec: MethodSpec, pair: Pair, prompt_ids: list[int], base: SamplingConfig
) -> Decoded:
    """Decode with our engine (sample, sps, beam, dsbd)."""
    config = spec.sampling_config(base)
    draft: TransformerScorer | NgramDraft | None = None
    if spec.lookup:  # the prompt lookup: a fresh one per decode (it holds only the iteration)
        draft = NgramDraft(pair.target.vocab_size, pair.ngram_max)
    elif spec.uses_draft and pair.draft:
        draft = pair.scorer("draft")
    if spec.uses_draft and draft is None:
        raise ValueError(f"{spec.name} needs a draft model; the run has none")
    controller = None
    calibration = pair.lookup_calibration if spec.lookup else pair.calibration
    if spec.uses_draft and not spec.fixed_knobs and calibration is not None:
        run_config = method_config(spec.engine_method(), config)
        controller = CostController(run_config, calibration)
    result = generate(
        spec.engine_method(), pair.scorer("target"), prompt_ids, config, draft, controller
    )
    best = result.best
    stats = result.stats.as_dict()
    if controller is not None:
        stats["knob_gamma"] = controller.chosen  # the depth the cost model chose per iteration
    return Decoded(
        answer_ids=list(best.token_ids),
        tokens=result.stats.tokens_emitted,
        engine_stats=stats,
        engine_loglik=best.log_likelihood,
        lookup_calls=draft.forward_calls if isinstance(draft, NgramDraft) else None,
    )


def hf_generation_config(spec: MethodSpec, base: SamplingConfig, pair: Pair) -> GenerationConfig:
    """transformers' config for a method, every knob that shapes the distribution explicit
    (`hf-search`: deterministic beam search, `do_sample=False`, where the sampling knobs do
    not apply)."""
    return GenerationConfig(
        do_sample=spec.family != "hf-search",
        num_beams=spec.width if spec.family in ("hf-beam", "hf-search") else 1,
        temperature=base.temperature,
        top_k=base.top_k,  # 0 = off (None would mean transformers' default, 50)
        top_p=base.top_p,
        repetition_penalty=1.0,
        length_penalty=base.length_penalty,
        max_new_tokens=base.max_new_tokens,
        min_new_tokens=0,
        eos_token_id=list(pair.stop_ids),
        pad_token_id=pair.pad_id,
        num_return_sequences=1,
        return_dict_in_generate=True,
    )


def run_hf(
    spec: MethodSpec, pair: Pair, prompt_ids: list[int], base: SamplingConfig, seed: int
) -> Decoded:
    """Decode with transformers' `generate` (hf-sample, hf-beam, hf-assisted, hf-lookup,
    hf-search)."""
    if spec.family == "hf-assisted" and pair.draft is None:
        raise ValueError(f"{spec.name} needs a draft model; the run has none")
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=pair.device)
    kwargs: dict[str, object] = {}
    if spec.family == "hf-assisted":
        kwargs = {"assistant_model": pair.draft.model}  # type: ignore[union-attr]  # hf-assisted has a draft (checked above)
    elif spec.family == "hf-lookup":
        kwargs = {"prompt_lookup_num_tokens": spec.gamma, "max_matching_ngram_size": pair.ngram_max}
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = pair.target.model.generate(  # type: ignore[operator]  # a causal LM's GenerationMixin.generate
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            generation_config=hf_generation_config(spec, base, pair),
            **kwargs,
        )
    generated = out.sequences[0, len(prompt_ids) :].tolist()
    answer = cut_at_stop(generated, pair.stop_ids)
    steps = pair.target_counter.calls if spec.family in ("hf-beam", "hf-search") else len(generated)
    return Decoded(answer_ids=answer, tokens=steps)


def cut_at_stop(token_ids: list[int], stop_ids: tuple[int, ...]) -> list[int]:
    """Tokens up to and including the first stop token (what our engine returns)."""
    for index, token in enumerate(token_ids):
        if token in stop_ids:
            return token_ids[: index + 1]
    return token_ids


def probe_assisted_beams(pair: Pair, prompt_ids: list[int], base: SamplingConfig) -> dict:
    """What transformers does with `assistant_model` and `num_beams > 1` (recorded per run).

    transformers 5.23 logs a warning and runs plain beam sampling, ignoring the assistant; this
    runs it for 4 tokens and records the warning and the assistant's forward calls (0 when it is
    ignored), so the result file says what this installed version does rather than what we
    believe it does.
    """
    if pair.draft is None or pair.draft_counter is None:
        return {"skipped": "no draft model"}
    records: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = _Keep(level=logging.WARNING)
    logger = logging.getLogger("transformers")  # the library root: its modules' loggers propagate
    logger.addHandler(handler)
    pair.reset_counters()
    config = hf_generation_config(
        MethodSpec("hf-beam", width=2), base.model_copy(update={"max_new_tokens": 4}), pair
    )
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=pair.device)
    try:
        with torch.inference_mode():
            pair.target.model.generate(  # type: ignore[operator]  # a causal LM's GenerationMixin.generate
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                generation_config=config,
                assistant_model=pair.draft.model,
            )
        error = None
    except Exception as exc:  # a future version may refuse instead of ignoring
        error = f"{type(exc).__name__}: {exc}"
    finally:
        logger.removeHandler(handler)
    return {
        "call": "generate(num_beams=2, do_sample=True, assistant_model=draft, max_new_tokens=4)",
        "assistant_forward_calls": pair.draft_counter.calls,
        "target_forward_calls": pair.target_counter.calls,
        "assistant_used": pair.draft_counter.calls > 0,
        "warnings": records,
        "error": error,
    }
