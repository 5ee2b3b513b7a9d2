"""The `dsbd batch` actor: loads target and draft once, decodes Ray Data batches of rows.

Ray Data's actor pool (`map_batches(BatchDecoder, compute=ActorPoolStrategy(...))`) builds one
`BatchDecoder` per actor; each call gets a batch of input rows (Arrow) and returns one output
record per row. The rows of a batch are decoded together by `dsbd_core.algorithm.drivers.lockstep`:
every row keeps its own method, knobs and seed, and all rows share each iteration's draft and
target forwards, so a row's result is exactly what `dsbd generate` decodes for it alone with
its seed.

A row that cannot be decoded (unknown field, invalid knob, empty or too long prompt, token id
out of range, a failure while decoding) becomes a record with `error` naming the field, the
value and what is allowed; the batch and the job go on.
"""

from __future__ import annotations

from typing import Any, Literal

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deployments.api.responses import BeamText
from deployments.batch_job.output import OUTPUT_SCHEMA, error_record
from deployments.batch_job.rows import BatchRow, parse_row
from dsbd_core.algorithm.config import SamplingConfig, error_words
from dsbd_core.algorithm.methods import BEAM_METHODS, MethodConfig, method_config
from dsbd_core.algorithm.sequences.penalties import bias_problem
from dsbd_core.algorithm.sequences.stops import StopStrings
from dsbd_core.models.options import DraftOptions
from dsbd_core.models.token_bytes import LoadedTexts, token_bytes


class RowDefaults(BaseModel):
    """What a row gets for every knob it does not set (the command line's flags)."""

    model_config = ConfigDict(extra="forbid")

    method: Literal["dsbd", "beam", "sps", "sample"] = "dsbd"
    n: int | None = Field(None, ge=1, le=64, description="Beams per record (None: all).")
    chat: bool | None = None  # None: chat-template prompts when the tokenizer has a template
    config: dict[str, Any] = Field(default_factory=dict)  # SamplingConfig fields (no eos ids)
    max_prompt_tokens: int = Field(4096, ge=1)


class DecoderSettings(BaseModel):
    """How an actor loads its models and what rows default to."""

    model_config = ConfigDict(extra="forbid")

    target: str
    draft: str
    dtype: Literal["auto", "float32", "bfloat16", "float64"] = "auto"
    device: Literal["cpu", "cuda"] = "cpu"
    decode_path: Literal["auto", "dynamic", "static"] = "auto"
    threads: int = Field(1, ge=1)
    draft_variant: DraftOptions = DraftOptions()
    fixed_knobs: bool = Field(
        False, description="Draft gamma layers every iteration instead of the cost model's choice."
    )
    recalibrate: bool = Field(
        False, description="Measure the cost model's forward costs again instead of the cache."
    )
    defaults: RowDefaults = RowDefaults()


def check_n(n: int | None, method: str, config: SamplingConfig) -> None:
    """The rule of the HTTP API (deployments/api/models.py): n beams exist to be returned."""
    if n is None:
        return
    if method in BEAM_METHODS and n > config.width:
        raise ValueError(f"n={n} is larger than width={config.width}; allowed: 1 <= n <= width")
    if method in ("sample", "sps") and n > 1:
        raise ValueError(
            f"n={n} needs a beam method ({', '.join(BEAM_METHODS)}); {method} returns 1 beam"
        )


def row_error_message(error: Exception) -> str:
    """`field=value: what is allowed`, one clause per problem, for an error record."""
    if not isinstance(error, ValidationError):
        return str(error)
    clauses = []
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"]) or "row"
        value = item.get("input")
        if item["type"] == "extra_forbidden":
            allowed = ", ".join(BatchRow.model_fields)
            clauses.append(f"{field}={value!r}: unknown field; allowed: {allowed}")
            continue
        shown = "" if isinstance(value, dict) else f"={value!r}"
        message = error_words(item)  # as the HTTP API words it
        clauses.append(f"{field}{shown}: {message}")
    return "; ".join(clauses)


class BatchDecoder:
    """One Ray Data actor: the engine over target + draft, loaded once."""

    def __init__(self, settings: dict[str, Any]) -> None:
        import torch
        from transformers.utils import logging as hf_logging

        from dsbd_core.algorithm.drivers.session_batch import SessionBatcher
        from dsbd_core.models.pair import load_pair

        self.settings = DecoderSettings.model_validate(settings)
        s = self.settings
        torch.set_num_threads(s.threads)
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        pair = load_pair(
            s.target,
            s.draft,
            dtype=s.dtype,
            device=s.device,
            draft_options=s.draft_variant,
            decode_path=s.decode_path,
        )
        assert pair.has_draft  # a model, or the prompt lookup (`draft: ngram`)
        self.target = pair.target
        # the cost model's calibration: measured once per machine and cached (same tokens for
        # the same seed on every actor of the machine)
        self.calibration = (
            None if s.fixed_knobs else pair.calibration(force=s.recalibrate, say=lambda _: None)
        )
        self.tokenizer = self.target.tokenizer
        self.texts = BeamText(self.tokenizer)
        self._token_texts: LoadedTexts | None = None  # built for the first row with `stop`
        self.stop_ids = pair.stop_ids
        self.vocab_size = self.target.vocab_size
        config = self.target.model.config
        self.max_positions = int(getattr(config, "max_position_embeddings", 0) or 1 << 20)
        target, draft = pair.scorers()
        self.target_batcher = SessionBatcher(target)
        assert draft is not None  # pair.has_draft, above
        self.draft_batcher = SessionBatcher(draft)

    def __call__(self, batch: pa.Table) -> pa.Table:
        """Decode a batch of `ROWS_SCHEMA` rows; one `OUTPUT_SCHEMA` record each."""
        from dsbd_core.algorithm.drivers.lockstep import decode_lockstep

        rows = batch.to_pylist()
        records: list[dict[str, Any] | None] = [None] * len(rows)
        requests, where, shapes, views = [], [], [], []
        for k, row in enumerate(rows):
            if row["problem"] is not None:
                records[k] = error_record(row, "invalid_row", row["problem"])
                continue
            try:
                request, n, view = self._request(row["row"])
            except (ValueError, ValidationError) as error:
                records[k] = error_record(row, "invalid_row", row_error_message(error))
                continue
            requests.append(request)
            where.append(k)
            shapes.append(n)
            views.append(view)
        if requests:
            try:
                results, _ = decode_lockstep(
                    requests, self.target_batcher, self.draft_batcher, controller=self._controller
                )
            except Exception as error:  # the shared decode broke: every row of it fails
                message = f"the batch failed while decoding: {type(error).__name__}: {error}"
                for k in where:
                    records[k] = error_record(rows[k], "decode_failed", message)
            else:
                for k, request, n, view, outcome in zip(
                    where, requests, shapes, views, results, strict=True
                ):
                    records[k] = self._record(rows[k], request, n, view, outcome, len(requests))
        return pa.Table.from_pylist(records, schema=OUTPUT_SCHEMA)

    def _controller(self, request: Any, config: MethodConfig) -> Any:
        """A row's knob controller: the cost model (None: the row's own gamma every time)."""
        from dsbd_core.algorithm.policy.cost_model import CostController

        if self.calibration is None or not config.uses_draft:
            return None
        return CostController(config, self.calibration)

    # ----------------------------------------------------------------- rows
    def _request(self, text: str) -> tuple[Any, int | None, BeamText]:
        """The validated decode request of a row's JSON, how many beams it wants, and its view
        of the beams' texts (cut at its stop strings, as the HTTP API cuts them)."""
        from dsbd_core.algorithm.drivers.lockstep import Request

        row = parse_row(text)
        defaults = self.settings.defaults
        method = row.method or defaults.method
        config = SamplingConfig(
            **{**defaults.config, **row.knobs(), "eos_token_ids": self.stop_ids}
        )
        n = row.n if row.n is not None else defaults.n
        check_n(n, method, method_config(method, config))
        prompt_ids = self._prompt_ids(row, defaults.chat)
        self._check_length(prompt_ids, method_config(method, config), method)
        problem = bias_problem(config.logit_bias, self.vocab_size)
        if problem is not None:  # an invalid row, as the HTTP API's 400
            raise ValueError(f"logit_bias: {problem}")
        stop = None
        if row.stop_strings:
            stop = StopStrings(tuple(row.stop_strings), self._stop_texts())
        view = self.texts.with_stops(
            row.stop_strings, row.include_stop_str_in_output, min_tokens=config.min_tokens
        )
        return Request(prompt_ids, config, method, stop=stop), n, view

    def _stop_texts(self) -> LoadedTexts:
        """The tokenizer's byte table, built once per actor (the decodes run in this process,
        so the table never travels)."""
        if self._token_texts is None:
            self._token_texts = LoadedTexts(token_bytes(self.tokenizer))
        return self._token_texts

    def _prompt_ids(self, row: BatchRow, default_chat: bool | None) -> list[int]:
        template = bool(getattr(self.tokenizer, "chat_template", None))
        if row.prompt_ids is not None:
            bad = [t for t in row.prompt_ids if t >= self.vocab_size]
            if bad:
                raise ValueError(
                    f"prompt_ids: token id {bad[0]} out of range; allowed 0..{self.vocab_size - 1}"
                )
            return list(row.prompt_ids)
        if row.messages is not None:
            if not template:
                raise ValueError("messages: this model has no chat template; give `prompt`")
            return self._chat([m.model_dump() for m in row.messages])
        assert row.prompt is not None
        chat = row.chat if row.chat is not None else default_chat
        if chat is None:
            chat = template
        if chat and not template:
            raise ValueError("chat=true: this model has no chat template; allowed: chat=false")
        if chat:
            return self._chat([{"role": "user", "content": row.prompt}])
        return self.tokenizer.encode(row.prompt)

    def _chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """Chat template text encoded without extra special tokens (as the router does)."""
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _check_length(self, prompt_ids: list[int], config: SamplingConfig, method: str) -> None:
        limit = self.settings.defaults.max_prompt_tokens
        if len(prompt_ids) > limit:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens is too long; allowed: at most "
                f"max_prompt_tokens={limit} (--max-prompt-tokens)"
            )
        gamma = config.gamma if method in ("dsbd", "sps") else 0
        needed = len(prompt_ids) + config.max_new_tokens + gamma + 1
        if needed > self.max_positions:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({config.max_new_tokens}) + "
                f"gamma ({gamma}) + 1 = {needed} exceeds the model's {self.max_positions} "
                "positions; allowed: a shorter prompt or a smaller max_new_tokens"
            )

    def _record(
        self,
        row: dict[str, Any],
        request: Any,
        n: int | None,
        view: BeamText,
        outcome: Any,
        batch_rows: int,
    ) -> dict[str, Any]:
        if outcome.error is not None:
            message = f"decoding failed: {type(outcome.error).__name__}: {outcome.error}"
            return error_record(row, "decode_failed", message)
        result = outcome.result
        beams = result.beams if n is None else result.beams[:n]
        best = beams[0]
        stats = result.stats.as_dict()
        stats.update(seconds=outcome.seconds, batch_rows=batch_rows)
        return {
            "id": row["id"],
            "index": row["index"],
            "row_hash": row["row_hash"],
            "text": view.text(best),
            "token_ids": best.token_ids,
            "finish_reason": "stop" if best.finished else "length",
            "stop_reason": view.stop_reason(best),
            "beams": [
                {
                    "text": view.text(b),
                    "token_ids": b.token_ids,
                    "log_likelihood": b.log_likelihood,
                    "score": b.score,
                    "finished": b.finished,
                    "stop_reason": view.stop_reason(b),
                    "token_logprobs": b.token_logprobs,
                    "top_logprobs": _top_logprobs(b.top_logprobs),
                }
                for b in beams
            ],
            "prompt_tokens": len(request.prompt_ids),
            "method": request.method,
            "seed": outcome.seed,
            "stats": stats,
            "error": None,
            "error_kind": None,
        }


def _top_logprobs(tops: list[list[tuple[int, float]]] | None) -> list[list[dict]] | None:
    """A beam's alternatives per token as records (None when the row asked for no logprobs)."""
    if tops is None:
        return None
    return [[{"token_id": t, "logprob": p} for t, p in top] for top in tops]
