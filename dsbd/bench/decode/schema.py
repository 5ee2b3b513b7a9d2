"""The result format of `dsbd bench` (version `SCHEMA_VERSION`), as pydantic models.

A run directory holds:
  run.json        the BenchConfig of the run (a rerun with the same config resumes)
  prompts.jsonl   one BenchPrompt per line plus `prompt_ids`, the exact token ids decoded
  records.jsonl   one MethodRecord per line, appended as soon as a decode finishes (checkpoint)
  results.json    BenchResult: config, machine, versions, git, prompts, records and summaries
  table.md        the summaries as markdown tables; *.png the plots

Another harness (e.g. the reference implementation's runner) produces comparable figures by
writing MethodRecords for the same prompts (same `prompt_id`s) with its own `source`; `dsbd
bench --report-only --extra-records FILE` folds them into the tables and plots.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION = 1


class BenchConfig(BaseModel):
    """Everything that determines a run's results (resuming requires the same config)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pair: str = Field(description="pair preset name, or 'custom' with --target/--draft")
    target: str
    draft: str | None
    mode: str = Field(description="quick or full (sets defaults only)")
    prompt_set: str
    prompts: int = Field(ge=1, description="first N prompts of the set")
    methods: list[str] = Field(description="canonical method names, in interleaving order")
    max_new_tokens: int = Field(ge=1)
    gamma: int = Field(ge=1, description="draft depth for methods that leave g<G> out")
    seed: int = Field(ge=0, description="prompt i is decoded with seed + i by every method")
    temperature: float = Field(gt=0)
    top_k: int = Field(ge=0)
    top_p: float = Field(gt=0, le=1)
    device: str
    dtype: str = Field(description="auto, or the dtype every model runs in")
    draft_quantize: str = Field("none", description="the draft's linear layers: none/int8/auto")
    decode_path: str = Field("auto", description="our methods' decode path: auto/dynamic/static")
    draft_head_tokens: int | None = Field(0, description="restricted draft head (0: full)")
    ngram_max: int = Field(
        3, ge=1, le=16, description="the prompt-lookup draft's bound (-ng methods, hf-lookup)"
    )
    threads: int = Field(ge=1)
    warmup_tokens: int = Field(ge=0, description="tokens of the unrecorded warm-up decodes")
    timing_rounds: int = Field(
        1,
        ge=1,
        description="times every method decodes each prompt, the methods interleaved in each "
        "round; a record's seconds are the median of its rounds (per-request ratios on a "
        "shared machine need more than one)",
    )
    humaneval_timeout_s: float = Field(gt=0)
    sandbox: str | None = Field(description="HumanEval sandbox mode; None = best available")


class MethodRecord(BaseModel):
    """One method on one prompt: the raw figures (one line of records.jsonl)."""

    model_config = ConfigDict(extra="forbid")

    source: str = Field("dsbd", description="who produced it: dsbd (this harness), reference")
    method: str
    width: int = Field(description="beam width W; the reference method has the same W")
    reference: str = Field(description="method this one's ratios and differences are against")
    prompt_id: str
    prompt_index: int
    order: int = Field(description="position of this method in the prompt's interleaved order")
    seed: int
    seconds: float = Field(description="wall time of the decode")
    cpu_seconds: float = Field(description="this process's CPU time during the decode")
    round_seconds: list[float] | None = Field(
        None, description="wall time of each timing round (seconds is their median)"
    )
    tokens: int = Field(description="decoding steps (longest generated sequence)")
    answer_tokens: int = Field(description="tokens of the returned answer (best beam / sample)")
    target_forward_passes: int = Field(description="target model forward calls (hook count)")
    draft_forward_passes: int = Field(description="draft model forward calls (hook count)")
    target_kv_peak_bytes: int = Field(description="peak target KV-cache bytes after a forward")
    target_kv_peak_shape: tuple[int, int] = Field(description="(rows, columns) at that peak")
    draft_kv_peak_bytes: int
    rss_peak_delta_bytes: int = Field(description="peak process RSS minus RSS before")
    cuda_peak_bytes: int | None = Field(description="CUDA max allocated minus before (GPU)")
    energy_joules: float | None = Field(description="GPU energy (NVML); None on CPU")
    loglik: float = Field(description="target log-likelihood of the answer, recomputed")
    engine_loglik: float | None = Field(description="the engine's own value (our methods)")
    engine_stats: dict[str, Any] | None = Field(description="DecodeStats.as_dict() (ours)")
    answer: str = Field(description="the decoded answer text")
    completion: str | None = Field(None, description="HumanEval: the answer cut at stops")
    passed: bool | None = Field(None, description="HumanEval: the completion passed its tests")
    execution: str | None = Field(None, description="HumanEval: status and end of stderr")


class Interval(BaseModel):
    """A point estimate with its 95 % paired-bootstrap interval over prompts."""

    n: int
    value: float
    low: float
    high: float


class MethodSummary(BaseModel):
    """Aggregates of one method over the prompts of a run (per token = per decoding step)."""

    method: str
    source: str
    width: int
    reference: str
    prompts: int
    tokens: int
    seconds_per_token: float
    cpu_seconds_per_token: float
    time_vs_reference: Interval | None = Field(description="(s/token) / reference's, paired")
    cpu_vs_reference: Interval | None
    target_passes_per_token: float
    draft_passes_per_token: float
    acceptance_rate: float | None = Field(description="accepted / drafted tokens")
    mean_accepted_length: float | None = Field(description="accepted layers per iteration")
    accepted_length_histogram: list[int] | None = Field(description="iterations by length")
    position_acceptance: list[float] | None = Field(
        description="per draft position l: P(layer l accepted | layer l verified)"
    )
    mean_width: float | None = Field(description="mean verified width of a layer")
    width_histogram: dict[int, int] | None = Field(description="verified layers by width")
    forward_counts_match_engine: bool | None = Field(description="hook counts == DecodeStats")
    target_kv_peak_bytes_mean: float
    target_kv_peak_bytes_max: int
    target_kv_vs_sps: float | None = Field(description="mean per-prompt peak / SpS's peak")
    rss_peak_delta_bytes_max: int
    cuda_peak_bytes_max: int | None
    energy_joules_per_token: float | None
    loglik_per_token: float = Field(description="mean over prompts of loglik / answer tokens")
    loglik_vs_reference: Interval | None = Field(description="paired difference, per token")
    engine_loglik_max_abs_diff: float | None = Field(description="|recomputed - engine|, max")
    pass_at_1: float | None
    pass_vs_reference: Interval | None = Field(description="paired difference of pass@1")


class BenchResult(BaseModel):
    """results.json."""

    schema_version: int = SCHEMA_VERSION
    created: str
    command: list[str]
    config: BenchConfig
    machine: dict[str, Any]
    versions: dict[str, str]
    git: dict[str, Any]
    prompts: list[dict[str, Any]]
    transformers_settings: dict[str, Any] = Field(description="what hf-* methods ran with")
    transformers_assisted_with_beams: dict[str, Any]
    energy_note: str
    notes: list[str]
    summary: dict[str, MethodSummary]
    records: list[MethodRecord]
