"""From records to figures: per-method aggregates, results.json, table.md and the plots.

Everything here is a pure function of the records, so `dsbd bench --report-only` rebuilds the
outputs of a finished (or partial) run, with records of another harness folded in.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from dsbd.bench.decode.quality import paired_bootstrap, ratio_bootstrap
from dsbd.bench.decode.schema import BenchResult, Interval, MethodRecord, MethodSummary

MIB = 1 << 20


def method_key(record: MethodRecord) -> str:
    """Summary key: the method name, prefixed by the source for other harnesses' records."""
    return record.method if record.source == "dsbd" else f"{record.source}:{record.method}"


def summarize(records: list[MethodRecord]) -> dict[str, MethodSummary]:
    """One MethodSummary per method (in first-seen order)."""
    groups: dict[str, list[MethodRecord]] = defaultdict(list)
    for record in records:
        groups[method_key(record)].append(record)
    ours = {key: rows for key, rows in groups.items() if rows[0].source == "dsbd"}
    sps = next((rows for key, rows in ours.items() if key.startswith("sps-")), None)
    return {key: _summary(rows, ours.get(rows[0].reference), sps) for key, rows in groups.items()}


def _by_prompt(rows: list[MethodRecord] | None) -> dict[str, MethodRecord]:
    return {r.prompt_id: r for r in rows or []}


def _interval(stats: dict) -> Interval | None:
    if not stats["n"]:
        return None
    value = stats.get("ratio", stats.get("mean"))
    return Interval(n=stats["n"], value=value, low=stats["low"], high=stats["high"])


def _per_token(record: MethodRecord) -> float | None:
    return record.loglik / record.answer_tokens if record.answer_tokens else None


def compare(records: list[MethodRecord], method: str, reference: str) -> MethodSummary:
    """`method`'s figures with `reference` (any other method of the run) as the reference:
    time ratio, log-likelihood and pass@1 differences, paired over the prompts both decoded."""
    rows = [r for r in records if method_key(r) == method]
    against = [r for r in records if method_key(r) == reference]
    if not rows or not against:
        raise ValueError(f"no records of {method if not rows else reference!r}")
    return _summary(rows, against, None)


def _summary(
    rows: list[MethodRecord],
    reference: list[MethodRecord] | None,
    sps: list[MethodRecord] | None,
) -> MethodSummary:
    first = rows[0]
    tokens = sum(r.tokens for r in rows) or 1
    ref = _by_prompt(reference)
    paired = [(r, ref[r.prompt_id]) for r in rows if r.prompt_id in ref]
    time_ratio = ratio_bootstrap(
        [(r.seconds, r.tokens) for r, _ in paired], [(b.seconds, b.tokens) for _, b in paired]
    )
    cpu_ratio = ratio_bootstrap(
        [(r.cpu_seconds, r.tokens) for r, _ in paired],
        [(b.cpu_seconds, b.tokens) for _, b in paired],
    )
    loglik_pairs = [(_per_token(r), _per_token(b)) for r, b in paired]
    loglik_diff = paired_bootstrap(
        [a - b for a, b in loglik_pairs if a is not None and b is not None]
    )
    passes = [r.passed for r in rows if r.passed is not None]
    pass_diff = paired_bootstrap(
        [
            float(r.passed) - float(b.passed)
            for r, b in paired
            if r.passed is not None and b.passed is not None
        ]
    )
    per_token = [v for v in (_per_token(r) for r in rows) if v is not None]
    sps_peak = _by_prompt(sps)
    kv_ratios = [
        r.target_kv_peak_bytes / sps_peak[r.prompt_id].target_kv_peak_bytes
        for r in rows
        if r.prompt_id in sps_peak and sps_peak[r.prompt_id].target_kv_peak_bytes
    ]
    energies = [r.energy_joules for r in rows]
    cuda = [r.cuda_peak_bytes for r in rows if r.cuda_peak_bytes is not None]
    engine_ll = [abs(r.loglik - r.engine_loglik) for r in rows if r.engine_loglik is not None]
    return MethodSummary(
        method=first.method,
        source=first.source,
        width=first.width,
        reference=first.reference,
        prompts=len(rows),
        tokens=tokens,
        seconds_per_token=sum(r.seconds for r in rows) / tokens,
        cpu_seconds_per_token=sum(r.cpu_seconds for r in rows) / tokens,
        time_vs_reference=_interval(time_ratio),
        cpu_vs_reference=_interval(cpu_ratio),
        target_passes_per_token=sum(r.target_forward_passes for r in rows) / tokens,
        draft_passes_per_token=sum(r.draft_forward_passes for r in rows) / tokens,
        **_speculation(rows, tokens),
        target_kv_peak_bytes_mean=statistics.fmean(r.target_kv_peak_bytes for r in rows),
        target_kv_peak_bytes_max=max(r.target_kv_peak_bytes for r in rows),
        target_kv_vs_sps=statistics.fmean(kv_ratios) if kv_ratios else None,
        rss_peak_delta_bytes_max=max(r.rss_peak_delta_bytes for r in rows),
        cuda_peak_bytes_max=max(cuda) if cuda else None,
        energy_joules_per_token=(
            sum(e for e in energies if e is not None) / tokens
            if all(e is not None for e in energies)
            else None
        ),
        loglik_per_token=statistics.fmean(per_token) if per_token else float("nan"),
        loglik_vs_reference=_interval(loglik_diff),
        engine_loglik_max_abs_diff=max(engine_ll) if engine_ll else None,
        pass_at_1=statistics.fmean(passes) if passes else None,
        pass_vs_reference=_interval(pass_diff) if passes else None,
    )


def _speculation(rows: list[MethodRecord], tokens: int) -> dict:
    """Acceptance, accepted lengths and widths: from DecodeStats (ours) or derived (assisted)."""
    none: dict[str, Any] = {
        "acceptance_rate": None,
        "mean_accepted_length": None,
        "accepted_length_histogram": None,
        "position_acceptance": None,
        "mean_width": None,
        "width_histogram": None,
        "forward_counts_match_engine": None,
    }
    stats = [r.engine_stats for r in rows if r.engine_stats is not None]
    if len(stats) < len(rows):  # some row has none
        if any(r.draft_forward_passes for r in rows):  # transformers' assisted generation
            calls = sum(r.target_forward_passes for r in rows)
            none["mean_accepted_length"] = tokens / calls - 1 if calls else None
        return none
    match = all(
        r.target_forward_passes == s["target_forward_passes"]
        and r.draft_forward_passes == s["draft_forward_passes"]
        for r, s in zip(rows, stats, strict=True)
    )
    drafted = sum(s["drafted_tokens"] for s in stats)
    if not drafted:
        return {**none, "forward_counts_match_engine": match}
    layers = [a for s in stats for a in s["accepted_layers"]]
    verified = [len(w) for s in stats for w in s["widths"]]
    widths = [w for s in stats for it in s["widths"] for w in it]
    deepest = max(verified, default=0)
    position = []
    for depth in range(1, deepest + 1):
        reached = sum(v >= depth for v in verified)
        position.append(sum(a >= depth for a in layers) / reached if reached else 0.0)
    histogram = Counter(layers)
    return {
        "acceptance_rate": sum(s["accepted_tokens"] for s in stats) / drafted,
        "mean_accepted_length": statistics.fmean(layers) if layers else 0.0,
        "accepted_length_histogram": [
            histogram.get(k, 0) for k in range(max(layers, default=0) + 1)
        ],
        "position_acceptance": position,
        "mean_width": statistics.fmean(widths) if widths else None,
        "width_histogram": dict(sorted(Counter(widths).items())),
        "forward_counts_match_engine": match,
    }


# ------------------------------------------------------------------------------ outputs


def write_outputs(result: BenchResult, out_dir: Path) -> list[Path]:
    """results.json, table.md and the plots; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "results.json", out_dir / "table.md"]
    paths[0].write_text(result.model_dump_json(indent=1) + "\n")
    paths[1].write_text(markdown_table(result))
    paths += write_plots(result, out_dir)
    return paths


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def _ci(interval: Interval | None, spec: str = ".2f") -> str:
    if interval is None:
        return "-"
    return f"{interval.value:{spec}} [{interval.low:{spec}}, {interval.high:{spec}}]"


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / MIB:.1f}"


def markdown_table(result: BenchResult) -> str:
    """The summaries as two markdown tables (speed / calls, quality / memory) with a header."""
    c, m = result.config, result.machine
    humaneval = any(s.pass_at_1 is not None for s in result.summary.values())
    lines = [
        f"# dsbd bench: {c.pair} ({c.mode})",
        "",
        f"target `{c.target}`, draft `{c.draft}`; {c.prompts} prompts of `{c.prompt_set}`, "
        f"max {c.max_new_tokens} new tokens, gamma {c.gamma} unless named, T = {c.temperature}, "
        f"top-k {c.top_k}, top-p {c.top_p}, seed {c.seed}; device {m.get('device')}, "
        f"{c.threads} torch thread(s), {m.get('cpu') or m.get('platform')}; "
        f"{result.created}, commit {str(result.git.get('commit', ''))[:10]}"
        f"{' (uncommitted changes)' if result.git.get('dirty_code') else ''}; "
        f"load average at the start {_loads(m.get('load_average_start'))}, "
        f"at the end {_loads(m.get('load_average'))}.",
        "",
        "Ratios are to beam sampling at the same W (`sample` for W = 1), paired over prompts, "
        "with 95 % bootstrap intervals; per token = per decoding step. Energy: "
        f"{result.energy_note}.",
        *(
            [
                "",
                f"**Only {c.prompts} prompts: a bootstrap over so few prompts gives intervals "
                "that are too narrow; read them as indications, not tests.**",
            ]
            if c.prompts < 10
            else []
        ),
        "",
        "## Speed and model calls",
        "",
        "| method | W | ms/token | time vs beam [95% CI] | CPU time vs beam | target passes/token"
        " | draft passes/token | acceptance | accepted length | mean width |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key, s in result.summary.items():
        lines.append(
            f"| {key} | {s.width} | {s.seconds_per_token * 1000:.1f} | {_ci(s.time_vs_reference)}"
            f" | {_fmt(s.cpu_vs_reference.value if s.cpu_vs_reference else None, '.2f')}"
            f" | {s.target_passes_per_token:.3f} | {s.draft_passes_per_token:.2f}"
            f" | {_fmt(s.acceptance_rate)} | {_fmt(s.mean_accepted_length, '.2f')}"
            f" | {_fmt(s.mean_width, '.2f')} |"
        )
    head = "| method | loglik/token | Δ loglik vs beam [95% CI] |"
    rule = "|---|---:|---:|"
    if humaneval:
        head += " pass@1 | Δ pass@1 vs beam [95% CI] |"
        rule += "---:|---:|"
    head += " target KV peak MiB (max) | KV vs SpS | RSS Δ peak MiB | CUDA peak MiB | J/token |"
    rule += "---:|---:|---:|---:|---:|"
    lines += ["", "## Quality and memory", "", head, rule]
    for key, s in result.summary.items():
        row = f"| {key} | {s.loglik_per_token:.3f} | {_ci(s.loglik_vs_reference, '.3f')} |"
        if humaneval:
            row += f" {_fmt(s.pass_at_1, '.3f')} | {_ci(s.pass_vs_reference)} |"
        row += (
            f" {_mib(s.target_kv_peak_bytes_max)} | {_fmt(s.target_kv_vs_sps, '.2f')}"
            f" | {_mib(s.rss_peak_delta_bytes_max)} | {_mib(s.cuda_peak_bytes_max)}"
            f" | {_fmt(s.energy_joules_per_token)} |"
        )
        lines.append(row)
    probe = result.transformers_assisted_with_beams
    if "assistant_used" in probe:
        lines += [
            "",
            f"transformers `{probe['call']}`: assistant forward calls "
            f"{probe['assistant_forward_calls']} (assistant used: {probe['assistant_used']}); "
            f"warnings: {'; '.join(w.splitlines()[0] for w in probe['warnings']) or 'none'}.",
        ]
    for note in result.notes:
        lines += ["", note]
    return "\n".join(lines) + "\n"


def write_plots(result: BenchResult, out_dir: Path) -> list[Path]:
    """speed_quality.png, accepted_length.png, width_histogram.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result.summary
    return [
        _plot_speed_quality(plt, summary, out_dir),
        _plot_accepted_length(plt, summary, out_dir),
        _plot_width_histogram(plt, summary, out_dir),
    ]


def _save_figure(plt: Any, fig: Any, path: Path) -> Path:
    """Lay out, write at the one resolution all the plots share, and free the figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_speed_quality(plt: Any, summary: dict[str, MethodSummary], out_dir: Path) -> Path:
    """speed_quality.png: time vs beam sampling against answer quality (and pass@1 when the
    run scored HumanEval), one point per method, coloured by W."""
    humaneval = any(s.pass_at_1 is not None for s in summary.values())
    fig, axes = plt.subplots(
        1, 2 if humaneval else 1, figsize=(13 if humaneval else 8, 5.5), squeeze=False
    )
    quality = [("loglik_per_token", "target log-likelihood / token of the answer")]
    if humaneval:
        quality.append(("pass_at_1", "HumanEval pass@1"))
    for ax, (field, label) in zip(axes[0], quality, strict=True):
        for key, s in summary.items():
            if s.time_vs_reference is None or getattr(s, field) is None:
                continue
            _speed_quality_point(ax, key, s, s.time_vs_reference, getattr(s, field))
        ax.axvline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("time per token / beam sampling's at the same W (o wall, 95% CI; x CPU time)")
        ax.set_ylabel(label)
        ax.set_title("speed vs quality (colour = W; left of the line = faster)", fontsize=9)
    return _save_figure(plt, fig, out_dir / "speed_quality.png")


def _speed_quality_point(ax: Any, key: str, s: MethodSummary, t: Interval, quality: float) -> None:
    """One method on the speed/quality plane: wall-time ratio `t` (vs beam sampling) with its
    95 % CI as an error bar, and the CPU-time ratio as a cross."""
    ax.errorbar(
        t.value,
        quality,
        xerr=[[t.value - t.low], [t.high - t.value]],
        fmt="o",
        color=f"C{min(s.width, 9)}",
        capsize=3,
    )
    if s.cpu_vs_reference is not None:  # CPU time: robust to a busy shared machine
        ax.plot(
            s.cpu_vs_reference.value,
            quality,
            marker="x",
            ms=6,
            color=f"C{min(s.width, 9)}",
        )
    ax.annotate(
        key,
        (t.value, quality),
        fontsize=7,
        xytext=(3, 3),
        textcoords="offset points",
    )


def _plot_accepted_length(plt: Any, summary: dict[str, MethodSummary], out_dir: Path) -> Path:
    """accepted_length.png: per-position acceptance (left) and the accepted-length histogram
    (right) of the speculative methods."""
    spec_methods = {k: s for k, s in summary.items() if s.position_acceptance}
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for i, (key, s) in enumerate(spec_methods.items()):
        positions = range(1, len(s.position_acceptance or []) + 1)
        left.plot(positions, s.position_acceptance, marker="o", label=key, color=f"C{i % 10}")
        hist = s.accepted_length_histogram or []
        total = sum(hist) or 1
        width = 0.8 / max(len(spec_methods), 1)
        right.bar(
            [k + i * width for k in range(len(hist))],
            [h / total for h in hist],
            width=width,
            label=key,
            color=f"C{i % 10}",
        )
    deepest = max((len(s.position_acceptance or []) for s in spec_methods.values()), default=1)
    left.set_xticks(range(1, deepest + 1))
    longest = max(
        (len(s.accepted_length_histogram or []) for s in spec_methods.values()), default=1
    )
    right.set_xticks(
        [k + 0.4 - 0.4 / max(len(spec_methods), 1) for k in range(longest)],
        [str(k) for k in range(longest)],
    )
    left.set_xlabel("draft position l (layer of the forest)")
    left.set_ylabel("P(layer l accepted | layer l verified)")
    left.set_title("acceptance per draft position", fontsize=9)
    right.set_xlabel("accepted length (layers accepted in an iteration)")
    right.set_ylabel("fraction of iterations")
    right.set_title("accepted length per iteration", fontsize=9)
    if spec_methods:
        left.legend(fontsize=7)
    return _save_figure(plt, fig, out_dir / "accepted_length.png")


def _plot_width_histogram(plt: Any, summary: dict[str, MethodSummary], out_dir: Path) -> Path:
    """width_histogram.png: the widths K of the verified layers of the methods with W > 1."""
    width_methods = {k: s for k, s in summary.items() if s.width_histogram and s.width > 1}
    fig, ax = plt.subplots(figsize=(9, 5))
    for i, (key, s) in enumerate(width_methods.items()):
        hist = s.width_histogram or {}
        total = sum(hist.values()) or 1
        bar = 0.8 / max(len(width_methods), 1)
        ax.bar(
            [w + i * bar - 0.4 for w in hist],
            [n / total for n in hist.values()],
            width=bar,
            label=key,
            color=f"C{i % 10}",
            align="edge",
        )
    widest = max((max(s.width_histogram or {0: 0}) for s in width_methods.values()), default=1)
    ax.set_xticks(range(1, widest + 1))
    ax.set_xlabel("width K of a verified layer")
    ax.set_ylabel("fraction of verified layers")
    ax.set_title("verified widths (fixed width: always W; dynamic: the threshold rule)", fontsize=9)
    if width_methods:
        ax.legend(fontsize=7)
    return _save_figure(plt, fig, out_dir / "width_histogram.png")


def _loads(values: object) -> str:
    """(1, 5, 15)-minute load averages, or "not recorded" (runs before it was)."""
    if not isinstance(values, list | tuple):
        return "not recorded"
    return str(tuple(round(float(x), 2) for x in values))
