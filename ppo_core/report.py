"""A self-contained HTML report of one PPO run, built from the run's tables on disk.

Everything is inline (SVG figures drawn by matplotlib, CSS), so the file opens
offline and can be mailed around. Aggregates are computed by DuckDB over the
``ppo_core.query`` views; HTML fragments with one piece per token or per row
are built with Polars string expressions, never a Python loop per token.

Only completed iterations (those with a manifest, which the pipeline writes
after the last phase) are shown: an iteration still being trained has
some tables and not others, so it is listed in the header and left out of
the curves, the summary and the heatmap.
"""

from __future__ import annotations

import html
import io
import json
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import reduce
from pathlib import Path

import duckdb
import numpy as np
import polars as pl
from matplotlib import colormaps
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from ppo_core.layout import RunLayout
from ppo_core.query import connect
from ppo_core.tables import atomic_path

HEATMAP_TABLES = ("rollouts", "sa_pairs", "rewards", "advantages")  # what the heatmaps read
COLORMAP = "RdBu_r"  # diverging with a white centre: 0 advantage reads as no colour
KEY_CONFIG = (
    "model", "reward", "reward_norm", "batch_size", "max_new_tokens", "temperature", "top_p",
    "kl_coef", "adaptive_kl", "kl_target", "missing_eos_penalty", "gamma", "lam", "whiten_advantages",
    "ppo_epochs", "num_minibatches", "policy_lr", "value_lr", "clip_range", "value_clip_range",
    "lora_rank", "lora_layers", "eval_size", "eval_temperature", "seed",
)  # fmt: skip


# --------------------------------------------------------------------------- what is drawn


@dataclass(frozen=True)
class Curve:
    column: str  # a column of the per-iteration summary
    label: str


@dataclass(frozen=True)
class Chart:
    key: str
    title: str
    caption: str
    curves: tuple[Curve, ...]


def _one_curve(column: str, title: str, label: str, caption: str) -> Chart:
    """A chart of one summary column, keyed by it."""
    return Chart(column, title, caption, (Curve(column, label),))


CHARTS = (
    Chart("score", "Score and reward", "Mean score of the rollouts (with the missing-EOS penalty) and of the held-out "
          "evaluation (greedy; iteration 0 is the baseline before training), and the shaped reward PPO maximises: "
          "the rollouts' score minus \u03b2 \u00b7 their summed KL.",
          (Curve("mean_score", "rollouts"), Curve("mean_reward", "shaped reward"), Curve("eval_score", "eval"))),
    _one_curve("kl_per_token", "KL per token", "KL / token", "Mean per-token KL of the policy to the reference (k1 estimator)."),
    _one_curve("kl_per_response", "KL per response", "KL / response", "Mean over rollouts of the summed per-token KL."),
    _one_curve("entropy", "Entropy", "entropy", "Mean per-token entropy of the policy on its own rollouts."),
    _one_curve("response_length", "Response length", "tokens", "Mean number of generated tokens per rollout."),
    _one_curve("policy_loss", "Policy loss", "policy loss", "Clipped PPO policy loss, mean over the iteration's optimiser steps."),
    _one_curve("value_loss", "Value loss", "value loss", "Clipped value loss, mean over the iteration's optimiser steps."),
    _one_curve("clip_fraction", "Clip fraction", "clip fraction",
               "Share of tokens whose probability ratio was clipped, mean over optimiser steps."),
    _one_curve("approx_kl", "Approx. KL of the update", "approx KL",
               "Approximate KL between the rollout policy and the policy being trained, mean over optimiser steps."),
)  # fmt: skip

SUMMARY_COLUMNS = {
    "mean_score": "score", "mean_reward": "shaped reward", "eval_score": "eval score", "kl_per_token": "KL / token",
    "kl_per_response": "KL / response", "entropy": "entropy", "response_length": "length",
    "policy_loss": "policy loss", "value_loss": "value loss", "clip_fraction": "clip frac.",
    "approx_kl": "approx KL",
}  # fmt: skip

# One aggregate query per table: a table missing from every iteration (no view) is simply skipped.
_PER_ITERATION_SQL = {
    "rollouts": "SELECT iter, avg(len(response_token_ids)) AS response_length FROM rollouts {where} GROUP BY iter",
    # the score sits on the last token of each response: sum per rollout, then average
    "rewards": """SELECT iter, avg(score) AS mean_score, avg(reward) AS mean_reward FROM (
                      SELECT iter, rollout_id, sum(score) AS score, sum(reward) AS reward
                      FROM rewards {where} GROUP BY iter, rollout_id)
                  GROUP BY iter""",
    "sa_pairs": """SELECT iter, avg(kl) AS kl_per_token, sum(kl) / count(DISTINCT rollout_id) AS kl_per_response,
                          avg(entropy) AS entropy
                   FROM sa_pairs {where} GROUP BY iter""",
    "eval": "SELECT iter, avg(score) AS eval_score FROM eval {where} GROUP BY iter",
    "metrics": """SELECT iter, avg(policy_loss) AS policy_loss, avg(value_loss) AS value_loss,
                         avg(clip_fraction) AS clip_fraction, avg(approx_kl) AS approx_kl
                  FROM metrics {where} GROUP BY iter""",
}
_RUN_ITERS = "WHERE run = $run AND list_contains($iters, iter)"

# The n_best highest- and n_worst lowest-scoring rollouts of one iteration, in one total order.
_CHOSEN_ROLLOUTS_SQL = """
WITH scored AS (
    SELECT rollout_id, sum(score) AS score, count(*) AS n_tokens
    FROM rewards WHERE run = $run AND iter = $iter GROUP BY rollout_id
), ranked AS (
    SELECT *, row_number() OVER (ORDER BY score DESC, rollout_id) AS rank, count(*) OVER () AS n_rollouts
    FROM scored
)
SELECT k.rollout_id, k.score, k.n_tokens, ro.prompt, ro.finish_reason,
       CASE WHEN k.rank <= $n_best THEN 'highest #' || k.rank
            ELSE 'lowest #' || (k.n_rollouts - k.rank + 1) END AS place
FROM ranked k JOIN rollouts ro ON ro.run = $run AND ro.iter = $iter AND ro.rollout_id = k.rollout_id
WHERE k.rank <= $n_best OR k.rank > k.n_rollouts - $n_worst
ORDER BY k.rank
"""

# every token of one iteration, its row = the rollout's rank by score (0 = highest)
_BATCH_ADVANTAGE_SQL = """
WITH scored AS (
    SELECT rollout_id, sum(score) AS score FROM rewards WHERE run = $run AND iter = $iter GROUP BY rollout_id
), ranked AS (
    SELECT rollout_id, row_number() OVER (ORDER BY score DESC, rollout_id) - 1 AS row FROM scored
)
SELECT k.row, a.t, a.whitened_advantage
FROM advantages a JOIN ranked k USING (rollout_id)
WHERE a.run = $run AND a.iter = $iter
"""

_CHOSEN_TOKENS_SQL = """
SELECT rollout_id, t, token, advantage, whitened_advantage, reward, value, kl
FROM tokens WHERE run = $run AND iter = $iter AND list_contains($rollout_ids, rollout_id)
ORDER BY rollout_id, t
"""

_EVAL_SAMPLES_SQL = """
SELECT prompt_id, prompt, response, response_tokens AS tokens, finish_reason AS finish, score
FROM eval WHERE run = $run AND iter = $iter ORDER BY prompt_id
"""

# the same held-out prompts answered before training (iteration 0) and at $iter
_EVAL_BEFORE_AFTER_SQL = """
SELECT a.prompt_id, a.prompt, b.response AS before, b.score AS score_before,
       a.response AS after, a.score AS score_after, a.finish_reason AS finish
FROM eval a LEFT JOIN eval b ON b.run = a.run AND b.iter = 0 AND b.prompt_id = a.prompt_id
WHERE a.run = $run AND a.iter = $iter ORDER BY a.prompt_id
"""


# --------------------------------------------------------------------------- entry point


def build_report(
    artifact_root: Path,
    run: str,
    output: Path | None = None,
    n_heatmap: int = 6,
    iteration: int | None = None,
) -> Path:
    """Write the HTML report of ``run`` and return its path.

    ``output`` defaults to the run's ``RunLayout.report``. ``iteration``
    picks the iteration of the advantage heatmap and the eval samples
    (default: the last completed one). Raises ValueError when the run has no
    iteration on disk, or when ``iteration`` is not a completed one.
    """
    root = Path(artifact_root)
    layout = RunLayout(root, run)
    complete, in_progress = iterations_on_disk(layout)
    if not complete and not in_progress:
        raise ValueError(f"run '{run}' has no iterations under artifact root {root}")
    token_iter = _pick_iteration(layout, complete, iteration, HEATMAP_TABLES)
    eval_iter = _pick_iteration(layout, complete, iteration, ("eval",))
    con = connect(root)
    summary = per_iteration_summary(con, layout, complete)
    sections = [
        header_html(layout, complete, in_progress),
        charts_html(summary),
        summary_table_html(summary),
        heatmap_html(con, run, token_iter, n_heatmap),
        eval_samples_html(con, run, eval_iter, iteration),
    ]
    path = Path(output) if output is not None else layout.report
    with atomic_path(path) as tmp:
        tmp.write_text(page_html(run, sections), encoding="utf-8")
    return path


def iterations_on_disk(layout: RunLayout) -> tuple[list[int], list[int]]:
    """(completed, in progress) iteration numbers of one run."""
    complete = layout.completed_iterations()
    return complete, [i for i in layout.iterations() if i not in complete]


def _pick_iteration(layout: RunLayout, complete: list[int], requested: int | None, tables: tuple[str, ...]) -> int | None:
    """The requested iteration, or the last completed one holding ``tables`` (None if there is none).

    A requested iteration without the token tables is an error; one without
    an evaluation just shows none (``eval_size = 0``).
    """
    with_tables = [i for i in complete if all(layout.table(i, t).is_file() for t in tables)]
    if requested is None:
        return with_tables[-1] if with_tables else None
    if requested in with_tables:
        return requested
    if "eval" in tables and requested in complete:
        return None
    where = f"iteration {requested} of run '{layout.run}' under artifact root {layout.root}"
    if requested not in complete:
        raise ValueError(f"{where} is not a completed iteration; completed: {_ranges(complete) or 'none'}")
    why = " (iteration 0 is the starting checkpoint and its baseline evaluation: nothing is sampled or trained)" if requested == 0 else ""
    raise ValueError(f"{where} has no {', '.join(tables)} tables{why}; iterations with them: {_ranges(with_tables) or 'none'}")


# --------------------------------------------------------------------------- numbers


def per_iteration_summary(con: duckdb.DuckDBPyConnection, layout: RunLayout, complete: list[int]) -> pl.DataFrame:
    """One row per completed iteration, one column per SUMMARY_COLUMNS entry (null where not measured)."""
    base = pl.DataFrame({"iter": complete}, schema={"iter": pl.Int32})
    params = {"run": layout.run, "iters": complete}
    parts = [
        con.sql(sql.format(where=_RUN_ITERS), params=params).pl().with_columns(pl.col("iter").cast(pl.Int32))
        for table, sql in _PER_ITERATION_SQL.items()
        if complete and layout.has_table(table)
    ]
    joined = reduce(lambda left, right: left.join(right, on="iter", how="left"), parts, base)
    missing = [pl.lit(None, pl.Float64).alias(c) for c in SUMMARY_COLUMNS if c not in joined.columns]
    return joined.with_columns(missing).select("iter", *SUMMARY_COLUMNS).sort("iter")


# --------------------------------------------------------------------------- text helpers

_HTML_SPECIAL = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}
# control characters are invalid in HTML text and invisible anyway: show Unicode's pictures of them
_CONTROL_PICTURES = {chr(c): chr(0x2400 + c) for c in range(32)} | {"\x7f": "\u2421", "\t": "\u21e5"}


def html_text(expr: pl.Expr, newline: str = "\u21b5") -> pl.Expr:
    """Escape for HTML text or attributes, with whitespace made visible (one pass, so '&' is never doubled)."""
    return expr.str.replace_many(_CONTROL_PICTURES | {"\n": newline} | _HTML_SPECIAL)


def number_text(expr: pl.Expr, digits: int = 4) -> pl.Expr:
    return expr.round_sig_figs(digits).cast(pl.String).fill_null("\u2013")


def _ranges(values: list[int]) -> str:
    """[0, 1, 2, 5] -> '0–2, 5'."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][-1] + 1:
            runs[-1].append(v)
        else:
            runs.append([v])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}\u2013{r[-1]}" for r in runs)


def frame_table_html(frame: pl.DataFrame, table_id: str, headers: dict[str, str], row_key: str | None = None) -> str:
    """An HTML table of ``frame``: floats to 4 significant digits, text escaped; each cell tagged data-col."""
    cells = [
        pl.format(
            '<td data-col="{}" class="{}">{}</td>',
            pl.lit(col),
            pl.lit("num" if frame.schema[col].is_numeric() else "text"),
            number_text(pl.col(col)) if frame.schema[col].is_float() else html_text(pl.col(col).cast(pl.String), "\u21b5\n").fill_null(""),
        )
        for col in frame.columns
    ]
    row_attr = pl.format(' data-{}="{}"', pl.lit(row_key), pl.col(row_key)) if row_key else pl.lit("")
    rows = frame.select(pl.format("<tr{}>{}</tr>", row_attr, pl.concat_str(cells)).alias("row"))["row"]
    head = "".join(f'<th data-col="{c}">{html.escape(headers.get(c, c))}</th>' for c in frame.columns)
    return f'<table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


# --------------------------------------------------------------------------- sections


def header_html(layout: RunLayout, complete: list[int], in_progress: list[int]) -> str:
    generated = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    progress = f" · in progress (not shown): {_ranges(in_progress)}" if in_progress else ""
    return (
        f"<header><h1>PPO run <code>{html.escape(layout.run)}</code></h1>"
        f'<p class="sub">iterations: <b id="iterations">{_ranges(complete) or "none completed"}</b>{progress}'
        f" · artifact root <code>{html.escape(str(layout.root))}</code> · generated {generated}</p>"
        f"{config_html(layout.run_json)}</header>"
    )


def config_html(path: Path) -> str:
    """The key fields of the run's pinned config."""
    try:
        pinned = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return f'<p class="warn">no readable {path.name} ({html.escape(str(exc))})</p>'
    cfg = pinned.get("config", {})
    items = [(k, cfg[k]) for k in KEY_CONFIG if k in cfg] + [("training_hash", pinned.get("training_hash"))]
    body = "".join(f"<div><dt>{html.escape(k)}</dt><dd>{html.escape(str(v))}</dd></div>" for k, v in items)
    return f'<details open><summary>Config (pinned in {path.name})</summary><dl class="config">{body}</dl></details>'


def charts_html(summary: pl.DataFrame) -> str:
    figures = "".join(
        f'<figure id="fig-{c.key}">{chart_svg(c, summary)}<figcaption>{html.escape(c.caption)}</figcaption></figure>'
        for c in CHARTS
    )
    return f'<section id="curves"><h2>Per iteration</h2><div class="charts">{figures}</div></section>'


def chart_svg(chart: Chart, summary: pl.DataFrame) -> str:
    # Figure without pyplot: no global backend or figure registry is touched (safe inside notebooks/servers)
    fig = Figure(figsize=(4.2, 2.6), layout="constrained")
    ax = fig.subplots()
    drawn = 0
    for curve in chart.curves:
        points = summary.select("iter", curve.column).drop_nulls().filter(pl.col(curve.column).is_finite())
        if points.height:
            ax.plot(points["iter"].to_numpy(), points[curve.column].to_numpy(), marker="o", ms=4, label=curve.label)
            drawn += 1
    ax.set_title(chart.title, fontsize=11)
    ax.set_xlabel("iteration", fontsize=9)
    ax.tick_params(labelsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if not drawn:
        ax.text(0.5, 0.5, "no data yet", ha="center", va="center", color="0.5", transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
    elif len(chart.curves) > 1:
        ax.legend(fontsize=8)
    return svg_text(fig, prefix=f"{chart.key}-")


def svg_text(fig: Figure, prefix: str) -> str:
    """The figure as an inline <svg> element, its ids prefixed so several figures can share one page."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    svg = buf.getvalue()
    svg = svg[svg.index("<svg") :]  # drop the XML prolog and DOCTYPE: not allowed inside HTML
    return re.sub(r'(\bid="|href="#|url\(#)', rf"\g<1>{prefix}", svg)


def summary_table_html(summary: pl.DataFrame) -> str:
    table = frame_table_html(summary, "summary", {"iter": "iteration", **SUMMARY_COLUMNS}, row_key="iter")
    return f'<section id="numbers"><h2>Numbers per iteration</h2>{table}</section>'


def heatmap_html(con: duckdb.DuckDBPyConnection, run: str, iteration: int | None, n_heatmap: int) -> str:
    title = "<h2>Advantage per token</h2>"
    if iteration is None:
        return f'<section id="heatmap">{title}<p class="empty">no completed training iteration yet</p></section>'
    n_best = n_heatmap // 2
    chosen = con.sql(
        _CHOSEN_ROLLOUTS_SQL, params={"run": run, "iter": iteration, "n_best": n_best, "n_worst": n_heatmap - n_best}
    ).pl()
    tokens = con.sql(
        _CHOSEN_TOKENS_SQL, params={"run": run, "iter": iteration, "rollout_ids": chosen["rollout_id"].to_list()}
    ).pl()
    scale = float(tokens["whitened_advantage"].abs().max() or 0.0) or 1.0
    spans = token_spans(tokens, scale)
    blocks = rollout_blocks(chosen, spans)
    intro = (
        f"<p>Iteration <b>{iteration}</b>: the {n_best} highest- and {n_heatmap - n_best} lowest-scoring rollouts. "
        "Each token is coloured by its whitened GAE advantage (red: the update makes it more likely, blue: less); "
        "hover a token for its numbers. \u21b5 is a newline, \u21e5 a tab.</p>"
    )
    batch = batch_heatmap_html(con, run, iteration)
    return (
        f'<section id="heatmap"><h2>Advantage per token \u2014 iteration {iteration}</h2>{batch}{intro}'
        f"{legend_html(scale)}{blocks}</section>"
    )


def batch_advantage_matrix(con: duckdb.DuckDBPyConnection, run: str, iteration: int) -> np.ndarray:
    """Whitened advantage as [rollout rank by score (0 = highest), position t]; NaN past a response's end."""
    cells = con.sql(_BATCH_ADVANTAGE_SQL, params={"run": run, "iter": iteration}).pl()
    rows, cols = cells["row"].to_numpy(), cells["t"].to_numpy()
    matrix = np.full((int(rows.max()) + 1, int(cols.max()) + 1), np.nan)
    matrix[rows, cols] = cells["whitened_advantage"].to_numpy()
    return matrix


def batch_heatmap_html(con: duckdb.DuckDBPyConnection, run: str, iteration: int) -> str:
    """Every rollout of the iteration as one row of whitened advantage by position, highest score on top."""
    matrix = batch_advantage_matrix(con, run, iteration)
    scale = float(np.nanmax(np.abs(matrix))) or 1.0
    height = min(9.0, 2.4 + 0.1 * matrix.shape[0])
    fig = Figure(figsize=(8.4, height), layout="constrained")
    ax = fig.subplots()
    cmap = colormaps[COLORMAP].with_extremes(bad="#b8b8b8")  # grey, unlike 0 (white): past the end of a response
    image = ax.imshow(matrix, cmap=cmap, norm=Normalize(-scale, scale), aspect="auto", interpolation="nearest")
    ax.set_xlabel("token position t", fontsize=9)
    ax.set_ylabel("rollouts\n(high score on top)", fontsize=9)
    ax.tick_params(labelsize=8)
    ax.set_yticks([])
    fig.colorbar(image, ax=ax, label="whitened advantage", shrink=0.9).ax.tick_params(labelsize=8)
    caption = (
        f"All {matrix.shape[0]} rollouts of iteration {iteration} ({int(np.isfinite(matrix).sum())} tokens): "
        "whitened GAE advantage by position; grey is past the end of a response."
    )
    return f'<figure id="fig-batch-heatmap">{svg_text(fig, prefix="batch-")}<figcaption>{caption}</figcaption></figure>'


def token_colours(values: np.ndarray, scale: float) -> pl.DataFrame:
    """Background (diverging, symmetric around 0) and a readable text colour per value."""
    rgba = colormaps[COLORMAP](Normalize(-scale, scale, clip=True)(values))
    rgb = np.rint(rgba[:, :3] * 255).astype(np.int64)
    luminance = rgba[:, :3] @ np.array([0.2126, 0.7152, 0.0722])
    return pl.DataFrame({"r": rgb[:, 0], "g": rgb[:, 1], "b": rgb[:, 2], "fg": np.where(luminance < 0.45, "#fff", "#111")})


def token_spans(tokens: pl.DataFrame, scale: float) -> pl.DataFrame:
    """rollout_id -> the response as one <span class="tok"> per token."""
    shown = pl.when(pl.col("token") == "").then(pl.lit("\u2205")).otherwise(pl.col("token"))  # keep empty tokens visible
    title = pl.format(
        't={} token="{}" advantage={} (whitened {}) reward={} value={} kl={}',
        pl.col("t"), shown, *(number_text(pl.col(c), 3) for c in ("advantage", "whitened_advantage", "reward", "value", "kl")),
    )  # fmt: skip
    span = pl.format(
        '<span class="tok" data-t="{}" style="background:rgb({},{},{});color:{}" title="{}">{}</span>',
        pl.col("t"), pl.col("r"), pl.col("g"), pl.col("b"), pl.col("fg"), html_text(title), html_text(shown),
    )  # fmt: skip
    colours = token_colours(tokens["whitened_advantage"].to_numpy(), scale)
    return (
        pl.concat([tokens, colours], how="horizontal")
        .group_by("rollout_id", maintain_order=True)
        .agg(span.str.join("").alias("spans"))
    )


def rollout_blocks(chosen: pl.DataFrame, spans: pl.DataFrame) -> str:
    block = pl.format(
        '<div class="rollout" data-rollout="{}" data-score="{}"><div class="meta"><b>{}</b> \u00b7 rollout {} \u00b7 '
        "score <b>{}</b> \u00b7 {} tokens \u00b7 finish: {}</div>"
        '<div class="prompt"><span class="label">prompt</span>{}</div>'
        '<div class="response">{}</div></div>',
        pl.col("rollout_id"), pl.col("score"), pl.col("place"), pl.col("rollout_id"), number_text(pl.col("score")),
        pl.col("n_tokens"), html_text(pl.col("finish_reason")), html_text(pl.col("prompt"), "\u21b5\n"),
        pl.col("spans").fill_null(""),
    )  # fmt: skip
    return "".join(chosen.join(spans, on="rollout_id", how="left", maintain_order="left").select(block).to_series())


def legend_html(scale: float) -> str:
    stops = colormaps[COLORMAP](np.linspace(0.0, 1.0, 11))
    gradient = ", ".join(f"rgb({r * 255:.0f},{g * 255:.0f},{b * 255:.0f})" for r, g, b, _ in stops)
    return (
        f'<div class="legend"><span>\u2212{scale:.3g}</span>'
        f'<span class="bar" style="background:linear-gradient(to right, {gradient})"></span>'
        f"<span>+{scale:.3g}</span><span class=\"what\">whitened advantage (0 = white)</span></div>"
    )


def eval_samples_html(con: duckdb.DuckDBPyConnection, run: str, iteration: int | None, requested: int | None) -> str:
    if iteration is None:
        why = "no evaluation yet" if requested is None else f"no evaluation table for iteration {requested} (eval_size = 0?)"
        return f'<section id="eval"><h2>Evaluation samples</h2><p class="empty">{why}</p></section>'
    params = {"run": run, "iter": iteration}
    if iteration == 0:
        table = frame_table_html(con.sql(_EVAL_SAMPLES_SQL, params=params).pl(), "eval-samples", {"prompt_id": "prompt id"})
        return f'<section id="eval"><h2>Evaluation samples \u2014 iteration 0 (before training)</h2>{table}</section>'
    samples = con.sql(_EVAL_BEFORE_AFTER_SQL, params=params).pl()
    headers = {"prompt_id": "prompt id", "before": "before training (iteration 0)", "score_before": "score",
               "after": f"iteration {iteration}", "score_after": "score"}
    table = frame_table_html(samples, "eval-samples", headers)
    return (f'<section id="eval"><h2>Evaluation samples \u2014 before training and at iteration {iteration}</h2>'
            f'<p class="sub">The same held-out prompts, answered greedily by the starting policy and by iteration '
            f'{iteration}\'s.</p>{table}</section>')


# --------------------------------------------------------------------------- page

_CSS = """
:root { --fg: #1d2330; --muted: #5b6475; --line: #dde1e8; --soft: #f5f6f8; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; color: var(--fg);
       margin: 0 auto; padding: 24px 28px 48px; max-width: 1320px; }
h1 { font-size: 24px; margin: 0 0 4px; } h2 { font-size: 18px; margin: 32px 0 10px; border-bottom: 1px solid var(--line);
     padding-bottom: 4px; }
code { font-family: ui-monospace, "DejaVu Sans Mono", Menlo, monospace; font-size: 0.92em; }
.sub { color: var(--muted); margin: 0 0 12px; }
details summary { cursor: pointer; color: var(--muted); margin-bottom: 6px; }
dl.config { display: grid; grid-template-columns: repeat(auto-fill, minmax(230px, 1fr)); gap: 2px 16px; margin: 0; }
dl.config div { display: flex; gap: 8px; border-bottom: 1px dotted var(--line); padding: 2px 0; min-width: 0; }
dl.config dt { color: var(--muted); } dl.config dd { margin: 0 0 0 auto; font-family: ui-monospace, monospace;
     overflow-wrap: anywhere; text-align: right; }
.charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(360px, 1fr)); gap: 18px; }
figure { margin: 0; border: 1px solid var(--line); border-radius: 6px; padding: 6px 8px; background: #fff; }
figure svg { display: block; width: 100%; height: auto; }
figcaption { color: var(--muted); font-size: 12px; margin-top: 2px; }
table { border-collapse: collapse; width: 100%; font-size: 13px; }
th, td { border-bottom: 1px solid var(--line); padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: var(--soft); font-weight: 600; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.text { white-space: pre-wrap; overflow-wrap: anywhere; }
#eval-samples td[data-col="response"], #eval-samples td[data-col="prompt"], #eval-samples td[data-col="before"],
#eval-samples td[data-col="after"] { min-width: 220px; }
#eval-samples td[data-col="finish"] { white-space: nowrap; }
.legend { display: flex; align-items: center; gap: 8px; margin: 8px 0 14px; font-size: 12px; color: var(--muted); }
.legend .bar { display: inline-block; width: 220px; height: 12px; border: 1px solid var(--line); border-radius: 2px; }
.rollout { border: 1px solid var(--line); border-radius: 6px; padding: 8px 10px; margin-bottom: 10px; }
.rollout .meta { font-size: 12px; color: var(--muted); margin-bottom: 4px; }
.rollout .prompt { white-space: pre-wrap; color: var(--muted); margin-bottom: 6px; overflow-wrap: anywhere; }
.label { display: inline-block; font-size: 11px; text-transform: uppercase; letter-spacing: .04em; background: var(--soft);
         border-radius: 3px; padding: 0 5px; margin-right: 6px; }
.response { font-family: ui-monospace, "DejaVu Sans Mono", Menlo, monospace; font-size: 13px; line-height: 1.9;
            white-space: pre-wrap; overflow-wrap: anywhere; }
.tok { border-radius: 3px; padding: 1px 0; margin-right: 1px; box-shadow: inset 0 0 0 1px rgba(0,0,0,.08); cursor: default; }
.empty, .warn { color: var(--muted); font-style: italic; }
"""


def page_html(run: str, sections: list[str]) -> str:
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>PPO run {html.escape(run)}</title><style>{_CSS}</style></head>"
        f"<body>{''.join(sections)}</body></html>\n"
    )
