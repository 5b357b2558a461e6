"""The static HTML report of a run, checked against numbers computed independently from the Parquet files.

The data is the synthetic store of ``tests/synthetic_store.py``; run 'default'
gets manifests for iterations 0-2 only, so iteration 3 is "in progress".
"""

from __future__ import annotations

import ppo_core  # noqa: F401  (OpenBLAS before mlx)

import html
import json
import re
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from typer.testing import CliRunner

from flows.cli import app
from ppo_core.layout import RunLayout
from ppo_core.query import connect
from ppo_core.report import batch_advantage_matrix, build_report, token_spans
from ppo_core.tables import write_table
from synthetic_store import build_store

RUN = "default"
COMPLETE = (0, 1, 2)
EVAL_PROMPT = 'Say <b>hi</b> & "bye"'
EVAL_RESPONSE = "<script>alert(1)</script>\nsecond line"
F64 = pl.Float64


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("report-store") / "artifacts"
    data = build_store(root)
    layout = RunLayout(root, RUN)
    pinned = {"run": RUN, "training_hash": "0123abcd", "config": {"kl_coef": 0.05, "batch_size": 20, "reward": "vader"}}
    layout.run_json.write_text(json.dumps(pinned))
    write_table(
        layout.iter_dir(2), "eval",
        {"prompt_id": ["eval-0001", "eval-0000"], "prompt": [EVAL_PROMPT, "Hello"],
         "response": [EVAL_RESPONSE, "Hi there!"], "response_tokens": [9, 3], "finish_reason": ["eos", "eos"],
         "score": [0.25, 0.75], "prompt_token_ids": [[1], [2]], "response_token_ids": [[3], [4]]},
    )  # fmt: skip
    for it in COMPLETE:
        layout.manifest(it).write_text("{}")
    path = build_report(root, RUN)
    return root, data, path, path.read_text(encoding="utf-8")


# --------------------------------------------------------------------------- parsing the page


def section(page: str, section_id: str) -> str:
    return re.search(rf'<section id="{section_id}">(.*?)</section>', page, re.S).group(1)


def summary_rows(page: str) -> dict[int, dict[str, str]]:
    rows = re.findall(r'<tr data-iter="(\d+)">(.*?)</tr>', section(page, "numbers"), re.S)
    return {int(it): dict(re.findall(r'<td data-col="([^"]+)" class="[^"]+">(.*?)</td>', cells)) for it, cells in rows}


def rollout_blocks(page: str) -> list[tuple[int, str]]:
    """(rollout_id, response HTML) of each token-by-token rollout, in page order."""
    return [
        (int(rid), body)
        for rid, body in re.findall(r'<div class="rollout" data-rollout="(\d+)".*?<div class="response">(.*?)</div></div>',
                                    section(page, "heatmap"), re.S)
    ]  # fmt: skip


SPAN = re.compile(r'<span class="tok" data-t="(\d+)" style="background:rgb\((\d+),(\d+),(\d+)\);[^"]*" title="([^"]*)">(.*?)</span>')


# --------------------------------------------------------------------------- independent numbers


def expected_summary(root: Path, iteration: int) -> dict[str, float]:
    path = lambda name: RunLayout(root, RUN).table(iteration, name)  # noqa: E731
    read = lambda name: pl.read_parquet(path(name)) if path(name).is_file() else None  # noqa: E731
    out: dict[str, float] = {}
    if (rw := read("rewards")) is not None:
        per_rollout = rw.group_by("rollout_id").agg(pl.col("score", "reward").cast(F64).sum())
        out["mean_score"], out["mean_reward"] = per_rollout["score"].mean(), per_rollout["reward"].mean()
    if (sa := read("sa_pairs")) is not None:
        kl = sa["kl"].cast(F64)
        out |= {"kl_per_token": kl.mean(), "kl_per_response": kl.sum() / sa["rollout_id"].n_unique(),
                "entropy": sa["entropy"].cast(F64).mean()}  # fmt: skip
    if (ro := read("rollouts")) is not None:
        out["response_length"] = ro["response_token_ids"].list.len().mean()
    if (ev := read("eval")) is not None:
        out["eval_score"] = ev["score"].cast(F64).mean()
    if (me := read("metrics")) is not None:
        out |= {k: me[k].cast(F64).mean() for k in ("policy_loss", "value_loss", "clip_fraction", "approx_kl")}
    return out


def ranked_rollouts(data, iteration: int) -> list[int]:
    """Rollout ids of one iteration, highest score first (ties by id)."""
    ro = data["rollouts"].filter((pl.col("run") == RUN) & (pl.col("iter") == iteration))
    return ro.sort(["score", "rollout_id"], descending=[True, False])["rollout_id"].to_list()


# --------------------------------------------------------------------------- tests


def test_numbers_per_iteration_match_the_tables(store):
    root, _, _, page = store
    rows = summary_rows(page)
    assert sorted(rows) == list(COMPLETE)  # iteration 3 has no manifest: not shown
    for it in COMPLETE:
        expected = expected_summary(root, it)
        for col, cell in rows[it].items():
            if col == "iter":
                assert cell == str(it)
            elif col in expected:
                assert float(cell) == pytest.approx(expected[col], rel=1e-3, abs=1e-9), (it, col)
            else:
                assert cell == "\u2013", (it, col)  # not measured in that iteration: a dash, never a fake 0
    assert set(expected_summary(root, 1)) >= {"mean_score", "mean_reward", "kl_per_token", "entropy", "policy_loss", "clip_fraction"}


def test_header_lists_completed_and_in_progress_iterations_and_the_pinned_config(store):
    _, _, _, page = store
    assert '<b id="iterations">0\u20132</b>' in page
    assert "in progress (not shown): 3" in page
    assert "<dt>kl_coef</dt><dd>0.05</dd>" in page and "<dt>training_hash</dt><dd>0123abcd</dd>" in page


def test_every_chart_is_an_inline_svg_and_nothing_is_fetched(store):
    _, _, _, page = store
    figures = re.findall(r'<figure id="fig-([\w-]+)"><svg', page)
    assert {"score", "kl_per_token", "entropy", "policy_loss", "value_loss", "clip_fraction", "batch-heatmap"} <= set(figures)
    assert not re.search(r'(?:src|href)="(?:https?:)?//', page)  # opens offline
    assert len(set(re.findall(r'\bid="([^"]+)"', page))) == len(re.findall(r'\bid="([^"]+)"', page))  # SVG ids unique


def test_heatmap_shows_the_highest_and_lowest_scoring_rollouts_token_by_token(store):
    root, data, _, page = store
    assert "Advantage per token \u2014 iteration 2" in page  # the last completed iteration, not in-progress 3
    ranked = ranked_rollouts(data, 2)
    blocks = rollout_blocks(page)
    assert [rid for rid, _ in blocks] == ranked[:3] + ranked[-3:]

    tokens = data["tokens"].filter((pl.col("run") == RUN) & (pl.col("iter") == 2))
    responses = dict(data["rollouts"].filter((pl.col("run") == RUN) & (pl.col("iter") == 2)).select("rollout_id", "response").iter_rows())
    scale = tokens.filter(pl.col("rollout_id").is_in(ranked[:3] + ranked[-3:]))["whitened_advantage"].abs().max()
    for rid, body in blocks:
        spans = SPAN.findall(body)
        rows = tokens.filter(pl.col("rollout_id") == rid).sort("t")
        assert [int(s[0]) for s in spans] == rows["t"].to_list()
        shown = "".join(html.unescape(s[5]) for s in spans)
        assert shown == responses[rid].replace("\n", "\u21b5")
        for (_, r, g, b, title, _), w in zip(spans, rows["whitened_advantage"]):
            assert f"(whitened {float(f'{w:.3g}'):g})" in html.unescape(title).replace("e-0", "e-")
            if abs(w) > 0.2 * scale:  # red for an advantage above 0, blue below
                assert (int(r) > int(b)) == (w > 0), (rid, w, r, g, b)


def test_batch_heatmap_matrix_is_every_rollout_by_score_and_position(store):
    root, data, _, page = store
    matrix = batch_advantage_matrix(connect(root), RUN, 2)
    ranked = ranked_rollouts(data, 2)
    tokens = data["tokens"].filter((pl.col("run") == RUN) & (pl.col("iter") == 2))
    assert matrix.shape == (len(ranked), tokens["t"].max() + 1)
    for row, rid in enumerate(ranked):
        w = tokens.filter(pl.col("rollout_id") == rid).sort("t")["whitened_advantage"].to_numpy()
        np.testing.assert_allclose(matrix[row, : len(w)], w, rtol=1e-6)
        assert np.isnan(matrix[row, len(w):]).all()
    assert f"All {len(ranked)} rollouts of iteration 2 ({tokens.height} tokens)" in page


def test_eval_samples_are_escaped_text_in_prompt_order(store):
    _, _, _, page = store
    evals = section(page, "eval")
    assert "Evaluation samples \u2014 before training and at iteration 2" in evals
    # each row: the prompt's answer at iteration 0 beside its answer now (eval-0001 was not asked at iteration 0)
    rows = {m[0]: m[1] for m in re.findall(r'<tr><td data-col="prompt_id" class="text">(eval-\d+)</td>(.*?)</tr>', evals, re.S)}
    assert '<td data-col="before" class="text">r</td><td data-col="score_before" class="num">0.5</td>' in rows["eval-0000"]
    assert '<td data-col="after" class="text">Hi there!</td><td data-col="score_after" class="num">0.75</td>' in rows["eval-0000"]
    assert '<td data-col="before" class="text"></td>' in rows["eval-0001"]
    assert "&lt;script&gt;alert(1)&lt;/script&gt;\u21b5\nsecond line" in evals
    assert "Say &lt;b&gt;hi&lt;/b&gt; &amp; &quot;bye&quot;" in evals
    assert "<script" not in page and "<b>hi</b>" not in page
    assert evals.index("eval-0000") < evals.index("eval-0001")


def test_token_spans_escape_markup_and_show_invisible_tokens():
    tokens = pl.DataFrame({
        "rollout_id": [0] * 5, "t": list(range(5)), "token": ["<b>", "&amp;", "\n", "", '"q"\t'],
        "advantage": [1.0, -1.0, 0.0, 0.5, -0.5], "whitened_advantage": [1.0, -1.0, 0.0, 0.5, -0.5],
        "reward": [0.0] * 5, "value": [0.0] * 5, "kl": [0.0] * 5,
    })  # fmt: skip
    [spans] = token_spans(tokens, scale=1.0)["spans"].to_list()
    texts = [m[5] for m in SPAN.findall(spans)]
    assert texts == ["&lt;b&gt;", "&amp;amp;", "\u21b5", "\u2205", "&quot;q&quot;\u21e5"]
    assert spans.count("<span") == 5 and "<b>" not in spans


def test_a_chosen_iteration_and_bad_requests(store, tmp_path):
    root, _, _, _ = store
    page = build_report(root, RUN, output=tmp_path / "it1.html", iteration=1).read_text()
    assert "Advantage per token \u2014 iteration 1" in page
    assert "no evaluation table for iteration 1" in section(page, "eval")
    with pytest.raises(ValueError, match=r"iteration 3 of run 'default' .* not a completed iteration.*completed: 0\u20132"):
        build_report(root, RUN, output=tmp_path / "x.html", iteration=3)
    with pytest.raises(ValueError, match="run 'nobody' has no iterations"):
        build_report(root, "nobody", output=tmp_path / "y.html")
    assert not (tmp_path / "x.html").exists() and not (tmp_path / "y.html").exists()


def test_a_run_with_nothing_completed_still_reports(store, tmp_path):
    root, _, _, _ = store
    page = build_report(root, "sunny", output=tmp_path / "sunny.html").read_text()  # no manifests, no run.json
    assert '<b id="iterations">none completed</b>' in page and "in progress (not shown): 0\u20133" in page
    assert "no completed training iteration yet" in page and "no readable run.json" in page
    assert summary_rows(page) == {}


def test_cli_writes_the_report_and_names_bad_input(store, tmp_path):
    root, _, _, _ = store
    out = tmp_path / "cli.html"
    result = CliRunner().invoke(app, ["report", "--root", str(root), "--run", RUN, "--output", str(out), "--rollouts", "4"])
    assert result.exit_code == 0, result.output
    assert out.resolve().as_uri() in result.output
    assert len(rollout_blocks(out.read_text())) == 4
    bad = CliRunner().invoke(app, ["report", "--root", str(root), "--run", RUN, "--iteration", "7"])
    assert bad.exit_code == 2 and "iteration 7 of run 'default'" in bad.output


def test_the_report_renders_in_chromium(store, chromium, test_artifacts):
    _, data, path, _ = store
    page = chromium.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.goto(path.resolve().as_uri())
    for fig in page.locator("figure svg").all():
        box = fig.bounding_box()
        assert box and box["width"] > 250 and box["height"] > 120
    raster = page.locator("#fig-batch-heatmap svg image").first.bounding_box()  # then the colour bar
    assert raster and raster["width"] > 200 and raster["height"] > 50
    first = page.locator(".rollout").first
    rid = int(first.get_attribute("data-rollout"))
    response = data["rollouts"].filter((pl.col("run") == RUN) & (pl.col("iter") == 2) & (pl.col("rollout_id") == rid))["response"][0]
    assert first.locator(".response").inner_text() == response.replace("\n", "\u21b5")
    assert "advantage=" in first.locator(".tok").first.get_attribute("title")
    assert page.locator("#summary tbody tr").count() == len(COMPLETE)
    page.screenshot(path=str(test_artifacts / "report.png"), full_page=True)
    assert errors == []
