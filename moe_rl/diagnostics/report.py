"""Mismatch report: `mismatch.json`, `REPORT.md` and PNG plots in one output directory.

    write_report("runs/mm", {"bf16": res_bf16, "fp8": res_fp8}, meta={"checkpoint": ...})

Several settings (a `--sweep`) share one summary table and overlaid plots. The write is
atomic (`moe_rl.runtime.atomic.atomic_output_dir`): everything goes into a temp directory next to
`out_dir`, which replaces `out_dir` only once every file exists. On any exception the temp
directory is removed and an older report at `out_dir` is left exactly as it was; a new
`out_dir` is never created.

Plots use matplotlib's Agg canvas on bare `Figure`s (no pyplot state, no display needed).
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from moe_rl.diagnostics.buckets import BUCKET_COLUMNS, BucketTable
from moe_rl.diagnostics.metrics import PREFIX, MismatchResult
from moe_rl.runtime.atomic import atomic_output_dir

# Rules of thumb for "look at this" (our choice, from the TIS/IcePop defaults: a token
# whose ratio leaves [0.5, 2] is one the correction would cap or drop). Used for the
# flags column and the "How to read this" section, so the two never disagree.
ALARMS: dict[str, float] = {
    "k3": 1e-3,
    "frac_tis_capped": 0.01,
    "frac_outside_icepop": 0.01,
    "frac_dlogp_gt_ln2": 0.01,
}

SUMMARY_COLUMNS = (
    ("num_sequences", "seqs"),
    ("num_tokens", "tokens"),
    ("dp_mean", "mean abs dp"),
    ("dp_max_mean", "max abs dp (seq mean)"),
    ("dp_max", "max abs dp"),
    ("k1", "k1"),
    ("k3", "k3"),
    ("log_ppl_diff", "log-ppl diff"),
    ("frac_tis_capped", "TIS-capped"),
    ("frac_outside_icepop", "outside IcePop"),
    ("frac_dlogp_gt_ln2", "abs dlogp > ln 2"),
    ("chi2_token", "chi2 token"),
    ("chi2_seq", "chi2 seq"),
    ("ess_token", "ESS token"),
)

PLOT_FILES = {
    "log_ratio_hist": "plots/log_ratio_hist.png",
    "prob_scatter": "plots/prob_scatter.png",
    "dp_max_vs_length": "plots/dp_max_vs_length.png",
    "by_position": "plots/mismatch_by_position.png",
    "routing": "plots/routing_disagreement.png",
}
PLOT_CAPTIONS = {
    "log_ratio_hist": "Histogram of per-token log ratios (log-scale counts)",
    "prob_scatter": "Sampler vs learner probability per token (subsampled), with y = x",
    "dp_max_vs_length": "Max abs dp per sequence vs response length",
    "by_position": "Mean abs dp and k3 by response position",
    "routing": "Sampler vs learner routing disagreement per layer",
}
SCATTER_MAX_POINTS = 20_000  # per setting; a deterministic subsample keeps PNGs small


# --------------------------------------------------------------------------- formatting


def fmt_num(x: float | None) -> str:
    """Readable number: '–' for missing/NaN, scientific for tiny or huge, else 4 digits."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    x = float(x)
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == 0:
        return "0"
    if x.is_integer() and abs(x) < 1e9:
        return str(int(x))
    if abs(x) < 1e-3 or abs(x) >= 1e5:
        return f"{x:.2e}"
    return f"{x:.4g}"


def _md_escape(s: object) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _json_clean(obj: Any) -> Any:
    """NaN / inf -> None (JSON has no NaN), tuples -> lists, recursively."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {str(k): _json_clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_clean(v) for v in obj]
    return obj


# --------------------------------------------------------------------------- plots


def _figure(nrows: int = 1, ncols: int = 1, size_in: tuple[float, float] = (6.4, 4.2)):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size_in, dpi=100)
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(nrows, ncols, i + 1) for i in range(nrows * ncols)]
    return fig, axes


def _legend(ax, **kwargs) -> None:
    """Legend only when something is labelled (an all-empty setting draws nothing)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small", **kwargs)
    else:
        ax.text(0.5, 0.5, "no valid tokens", transform=ax.transAxes, ha="center")


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, format="png")


def plot_log_ratio_hist(results: Mapping[str, MismatchResult], path: Path) -> None:
    """Histogram of d = log p - log q over valid tokens, one step curve per setting, log y."""
    fig, (ax,) = _figure()
    ds = {name: r.tokens.valid("log_ratio").cpu().numpy() for name, r in results.items()}
    lo = min((float(d.min()) for d in ds.values() if d.size), default=-1.0)
    hi = max((float(d.max()) for d in ds.values() if d.size), default=1.0)
    if hi - lo < 1e-9:  # identical engines: give the single spike some width
        lo, hi = lo - 1e-3, hi + 1e-3
    for name, d in ds.items():
        if d.size:
            ax.hist(d, bins=100, range=(lo, hi), histtype="step", log=True, label=name)
    for x in (-math.log(2), math.log(2)):
        if lo < x < hi:
            ax.axvline(x, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("log ratio d = log p_learner - log p_sampler")
    ax.set_ylabel("tokens (log scale)")
    ax.set_title("Per-token log ratio (dotted: ±ln 2)")
    _legend(ax)
    _save(fig, path)


def plot_prob_scatter(results: Mapping[str, MismatchResult], path: Path) -> None:
    """Sampler vs learner probability per token, one panel per setting, with y = x."""
    n = len(results)
    ncols = min(n, 3)
    nrows = math.ceil(n / ncols)
    fig, axes = _figure(nrows, ncols, (4.0 * ncols, 4.0 * nrows))
    gen = torch.Generator().manual_seed(0)
    for ax, (name, r) in zip(axes, results.items()):
        q, p = r.tokens.valid("sampler_p").cpu(), r.tokens.valid("learner_p").cpu()
        if q.numel() > SCATTER_MAX_POINTS:
            keep = torch.randperm(q.numel(), generator=gen)[:SCATTER_MAX_POINTS]
            q, p = q[keep], p[keep]
        ax.scatter(q.numpy(), p.numpy(), s=3, alpha=0.3, linewidths=0)
        ax.plot([0, 1], [0, 1], color="red", linewidth=1, label="y = x")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_aspect("equal")
        ax.set_xlabel("sampler probability q")
        ax.set_ylabel("learner probability p")
        ax.set_title(str(name))
        _legend(ax, loc="upper left")
    for ax in axes[n:]:
        ax.set_visible(False)
    _save(fig, path)


def plot_dp_max_vs_length(results: Mapping[str, MismatchResult], path: Path) -> None:
    """Per sequence: max |dp| against response length (long responses have more chances)."""
    fig, (ax,) = _figure()
    for name, r in results.items():
        keep = r.tokens.length > 0
        ax.scatter(
            r.tokens.length[keep].cpu().numpy(),
            r.tokens.dp_max[keep].cpu().numpy(),
            s=8,
            alpha=0.5,
            label=str(name),
        )
    ax.set_xlabel("response length (tokens)")
    ax.set_ylabel("max abs dp in the sequence")
    ax.set_title("Max probability difference vs response length")
    _legend(ax)
    _save(fig, path)


def plot_by_position(results: Mapping[str, MismatchResult], path: Path) -> None:
    """Mean |dp| and k3 per response-position bucket, one line per setting.

    x is the bucket's midpoint on a log2 axis (the default buckets double in width).
    """
    fig, (ax_dp, ax_k3) = _figure(1, 2, (10.0, 4.0))
    for name, r in results.items():
        e = r.by_position.edges
        x = [max((a + b) / 2, 0.5) for a, b in itertools.pairwise(e)]
        ax_dp.plot(x, r.by_position.columns["dp_mean"].cpu().numpy(), marker="o", label=name)
        ax_k3.plot(x, r.by_position.columns["k3"].cpu().numpy(), marker="o", label=name)
    for ax, what in ((ax_dp, "mean abs dp"), (ax_k3, "k3 (KL estimate)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("response position (bucket midpoint)")
        ax.set_ylabel(what)
        ax.set_ylim(bottom=0)
        ax.set_title(f"{what} by position")
        _legend(ax)
    _save(fig, path)


def plot_routing(results: Mapping[str, MismatchResult], path: Path) -> None:
    """Per-layer sampler-learner top-k disagreement, one line per setting with routing."""
    fig, (ax,) = _figure()
    for name, r in results.items():
        if r.routing_disagree_per_layer is not None:
            y = r.routing_disagree_per_layer.cpu().numpy()
            ax.plot(
                range(len(y)),
                y,
                marker="o",
                label=f"{name} (any layer: {fmt_num(None if r.routing_disagree_any is None else float(r.routing_disagree_any))})",
            )
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("fraction of tokens with a different top-k set")
    ax.set_ylim(bottom=0)
    ax.set_title("Sampler vs learner routing disagreement")
    _legend(ax)
    _save(fig, path)


def _write_plots(root: Path, results: Mapping[str, MismatchResult], has_routing: bool) -> None:
    (root / "plots").mkdir()
    plot_log_ratio_hist(results, root / PLOT_FILES["log_ratio_hist"])
    plot_prob_scatter(results, root / PLOT_FILES["prob_scatter"])
    plot_dp_max_vs_length(results, root / PLOT_FILES["dp_max_vs_length"])
    plot_by_position(results, root / PLOT_FILES["by_position"])
    if has_routing:
        plot_routing(results, root / PLOT_FILES["routing"])


# --------------------------------------------------------------------------- markdown


def _flags(summary: Mapping[str, float]) -> str:
    hits = [k for k, lim in ALARMS.items() if summary.get(f"{PREFIX}{k}", 0.0) > lim]
    return ", ".join(f"{k} > {fmt_num(ALARMS[k])}" for k in hits) or "ok"


def _bucket_md(table: BucketTable) -> str:
    header = ["bucket", *BUCKET_COLUMNS]
    rows = [
        [str(row["bucket"]), *(fmt_num(float(row[c])) for c in BUCKET_COLUMNS)] for row in table.rows()
    ]
    text = _md_table(header, rows)
    if float(table.num_outside) > 0:
        text += f"\n\n{fmt_num(float(table.num_outside))} valid tokens fell in no bucket."
    return text


def _how_to_read(params: Mapping[str, Any]) -> str:
    cap = fmt_num(params.get("tis_cap", 2.0))
    lo, hi = params.get("icepop_band", [0.5, 2.0])
    return f"""\
The sampler (q) generated every response; the learner (p), with the same weights, scored
the same tokens. Per token, d = log p - log q and the ratio is exp(d) (what TIS and IcePop
use). Identical engines give d = 0 everywhere, so every number below would be 0.

- **mean abs dp**: |p - q| averaged over a response's tokens, then over responses. It stays
  small and similar across most setups; large gaps show up in the max instead.
- **max abs dp (seq mean)**: each response's largest |p - q|, averaged over responses. This
  is where real gaps show (different parallelism in sampler and learner, low-precision
  rollouts, long responses). It grows with response length even at a fixed mean, because a
  long response has more chances for one large divergence: compare settings at equal length.
- **k1** = mean(log q - log p), **k3** = mean(exp(d) - 1 - d): two estimates of KL(q || p)
  over the sampled tokens. k3 is >= 0 token by token and has lower variance; k1 can be
  negative on a finite sample. k3 > {fmt_num(ALARMS["k3"])} is worth attention: the "on-policy"
  samples are measurably off-policy for the learner.
- **log-ppl diff** = log ppl(learner) - log ppl(sampler) per response, averaged: positive when
  the learner finds the sampled text less likely than the sampler did.
- **TIS-capped**: fraction of tokens with exp(d) > {cap}, where truncated importance sampling
  would cap the weight. Above {fmt_num(ALARMS["frac_tis_capped"] * 100)}% of tokens the
  correction is doing real work: run with `rollout_correction=tis` (or fix the gap).
- **outside IcePop**: fraction with exp(d) outside [{fmt_num(lo)}, {fmt_num(hi)}]: tokens IcePop /
  MIS would drop. Above {fmt_num(ALARMS["frac_outside_icepop"] * 100)}% a noticeable part of the
  batch would be masked out.
- **abs dlogp > ln 2**: tokens whose probability differs by more than a factor of 2 either way
  (equal to "outside IcePop" at the default band): the "extreme" tokens of the routing-replay
  study, whose frequency it found an order of magnitude higher for an MoE than a dense model.
- **chi2 token** = mean(exp(d)^2) - 1 and **ESS token** = mean(exp(d))^2 / mean(exp(d)^2): the
  variance the token importance weights add (0 and 1 when sampler and learner agree); ESS is
  the fraction of the tokens' count that an importance-weighted mean is worth.
- **chi2 seq** = mean over responses of exp(2 sum_t d) - 1: the same for a whole response's
  ratio, which compounds over its tokens (why sequence-level weights are capped or taken as a
  geometric mean; docs/rollout_correction.md).
- **routing** (when routings were given): per MoE layer, the fraction of tokens whose top-k
  expert set differs between sampler and learner, and the fraction differing in at least one
  layer. Without routing replay the any-layer fraction is typically large even when each
  layer agrees on most tokens; it is the reason for R3 replay or sequence-level objectives.
- **Buckets**: the same token-level numbers by response position and by sampler probability.
  Low-probability tokens carry the largest ratios for a given |dp| (the ratio divides by q),
  so expect the fractions to concentrate in the low-q rows; a mismatch that grows with
  position suggests looking at long-context numerics (attention, KV-cache precision).
- **flags** in the summary table list the thresholds exceeded ({
        ", ".join(f"{k} > {fmt_num(v)}" for k, v in ALARMS.items())
    }); they are rules of thumb, not hard limits.
"""


def _summary_md(summaries: Mapping[str, dict[str, float]], has_routing: bool) -> str:
    """One row per setting: the summary numbers, the any-layer routing disagreement, flags."""
    header = ["setting", *(label for _, label in SUMMARY_COLUMNS)]
    if has_routing:
        header.append("routing any-layer")
    header.append("flags")
    rows = []
    for name, s in summaries.items():
        row = [_md_escape(name), *(fmt_num(s[f"{PREFIX}{k}"]) for k, _ in SUMMARY_COLUMNS)]
        if has_routing:
            row.append(fmt_num(s.get(f"{PREFIX}routing_disagree_any")))
        row.append(_flags(s))
        rows.append(row)
    return _md_table(header, rows)


def _routing_md(results: Mapping[str, MismatchResult]) -> str:
    """Per-layer disagreement, one column per setting that has routing ('–' past its layers)."""
    per_layer = {n: r.routing_disagree_per_layer.double().cpu().tolist() for n, r in results.items()
                 if r.routing_disagree_per_layer is not None}
    L = max(len(v) for v in per_layer.values())
    rows = [
        [str(layer), *(fmt_num(v[layer]) if layer < len(v) else "–" for v in per_layer.values())]
        for layer in range(L)
    ]
    return _md_table(["MoE layer", *(_md_escape(n) for n in per_layer)], rows)


def _plots_md(has_routing: bool) -> list[str]:
    out = []
    for key, rel in PLOT_FILES.items():
        if key == "routing" and not has_routing:
            continue
        out += [f"### {PLOT_CAPTIONS[key]}", "", f"![{PLOT_CAPTIONS[key]}]({rel})", ""]
    return out


def _buckets_md(results: Mapping[str, MismatchResult]) -> list[str]:
    out = []
    for title, attr in (
        ("By response position", "by_position"),
        ("By sampler probability", "by_sampler_prob"),
    ):
        out += [f"## {title}", ""]
        for name, r in results.items():
            out += [f"### {_md_escape(name)}", "", _bucket_md(getattr(r, attr)), ""]
    return out


def _markdown(
    results: Mapping[str, MismatchResult],
    summaries: Mapping[str, dict[str, float]],
    meta: Mapping[str, Any],
    generated: str,
    has_routing: bool,
) -> str:
    first = next(iter(results.values()))
    out = ["# Sampler–learner mismatch report", "", f"Generated {generated}."]
    if meta:
        out += [
            "",
            _md_table(["meta", "value"], [[_md_escape(k), _md_escape(v)] for k, v in meta.items()]),
        ]

    out += [
        "",
        "## What was measured",
        "",
        f"{len(results)} setting(s). For each, per-token log-probs of the sampled responses under "
        "the sampler and under the learner; aggregates over valid (unmasked) response tokens. "
        "Definitions and thresholds are under *How to read this* at the end; the same numbers "
        "are in `mismatch.json`.",
        "",
        "## Summary",
        "",
        _summary_md(summaries, has_routing),
    ]
    if has_routing:
        out += [
            "",
            "## Routing: sampler vs learner top-k disagreement per MoE layer",
            "",
            _routing_md(results),
        ]
    out += ["", "## Plots", "", *_plots_md(has_routing), *_buckets_md(results)]
    out += ["## How to read this", "", _how_to_read(first.params)]
    return "\n".join(out)


# --------------------------------------------------------------------------- entry point


def _check_args(out_dir: Path, results: Any, meta: Any) -> None:
    if not isinstance(results, Mapping) or not results:
        raise ValueError("results must be a non-empty dict {setting name: MismatchResult}")
    for name, r in results.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"results keys must be non-empty setting names, got {name!r}")
        if not isinstance(r, MismatchResult):
            raise TypeError(f"results[{name!r}] must be a MismatchResult, got {type(r).__name__}")
    if not isinstance(meta, Mapping):
        raise TypeError(f"meta must be a dict, got {type(meta).__name__}")
    try:
        json.dumps(_json_clean(meta), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"meta must be JSON-serializable: {e}") from e
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"out_dir {out_dir} exists and is not a directory")


def write_report(
    out_dir: str | Path,
    results: Mapping[str, MismatchResult],
    meta: Mapping[str, Any] | None = None,
) -> Path:
    """Write mismatch.json, REPORT.md and plots/*.png for one or more settings; atomic.

    results: {setting name: MismatchResult}, in table order. meta: JSON-serializable facts
    about the run (checkpoint, sampler, precision, prompts, ...), shown at the top.
    Returns the report directory. Raises before touching the disk on bad arguments, and
    leaves `out_dir` as it was (absent or holding the older report) on any failure.
    """
    out = Path(out_dir).resolve()
    meta = {} if meta is None else meta
    _check_args(out, results, meta)
    summaries = {name: r.summary() for name, r in results.items()}
    has_routing = any(r.routing_disagree_per_layer is not None for r in results.values())
    generated = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())

    doc = {
        "generated": generated,
        "meta": dict(meta),
        "settings": {name: r.to_dict() for name, r in results.items()},
    }
    doc_text = json.dumps(_json_clean(doc), indent=2, allow_nan=False)
    md_text = _markdown(results, summaries, meta, generated, has_routing)

    with atomic_output_dir(out, force=True) as tmp:  # force: an older report is replaced
        tmp.chmod(0o755)  # whatever the umask: reports are meant to be shared
        (tmp / "mismatch.json").write_text(doc_text + "\n")
        (tmp / "REPORT.md").write_text(md_text)
        _write_plots(tmp, results, has_routing)
    return out
