"""``status``, ``compare`` and ``best`` text fits ``COLUMNS`` (#31: at 80 columns titles broke inside the run id,
the cost and health lines passed 100 characters, ``compare`` rows were 107 wide whatever ``COLUMNS`` was).

Real run dirs written through the protocol; status printed the way the command prints it (``show`` on a
rich console of the given width, no colour, as in a pipe); compare and best: tests/test_decide.py.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from ckpteval.coord.entries.generate import GenerateEntry
from ckpteval.coord.results.files import ok_result, write_result
from ckpteval.coord.run.manifest import EvalSpec, LeaseSettings, RunManifest
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.snapshots.snapshot import publish_snapshot
from ckpteval.coord.work.units import units_for_step
from ckpteval.jobs.views.status import text as status_text
from ckpteval.jobs.views.status.main import collect_status, show
from tests.support.runs import write_tiny_shards

RUN_ID = "grpo-qwen3-8b-math-lr3e-6-warmup-20261203-a"  # long, as real run ids are


def _run(tmp_path: Path, run_id: str = RUN_ID, datasets: tuple[str, ...] = ("gsm8k_style", "math500"),
         cut_at: int | None = None) -> RunDir:
    """A run of two points (one sample per prompt); ``cut_at``: at that step every second gsm8k_style prompt was cut off."""
    specs = tuple(GenerateEntry(name=n, path=f"data/{n}.jsonl", n_prompts=4, shard_size=2) for n in datasets)
    manifest = RunManifest(run_id=run_id, eval=EvalSpec(entries=specs),
                           snapshot_roots=(str(tmp_path / "a-rather-long-staging-root" / "snapshots"),),
                           lease=LeaseSettings(30.0, 5.0))
    run = RunDir.create(tmp_path / "run", manifest)
    for step, score in ((10, 0.25), (20, 0.75)):
        publish_snapshot(Path(manifest.snapshot_roots[0]), step, lambda d: write_tiny_shards(d, n_shards=1, numel=8))
        for unit in units_for_step(manifest, step):
            cut = {"truncated": (0.0, 1.0)} if step == cut_at and unit.dataset == "gsm8k_style" else {}
            write_result(run.results, ok_result(unit, [score, score + 0.125], [str(step)] * 2, **cut))
    return run


def _shown(statuses: list[dict], width: int) -> list[str]:
    out = io.StringIO()
    show(Console(file=out, width=width, color_system=None), statuses, as_json=False)
    return out.getvalue().splitlines()


def _too_wide(lines: list[str], width: int) -> list[str]:
    """Lines wider than ``width`` that are not one unbreakable word."""
    return [line for line in lines if len(line) > width and len(line.split()) > 1]


def test_status_at_80_columns_fits_and_keeps_the_run_id_whole(tmp_path: Path) -> None:
    run = _run(tmp_path)
    run.mark_interrupted("ckpteval demo", "SIGINT")
    status = collect_status(run.path)
    lines = _shown([status], 80)
    assert not _too_wide(lines, 80), "\n".join(lines)
    assert any(RUN_ID in line for line in lines), "\n".join(lines)  # never broken inside the run id
    text = "\n".join(lines)
    for part in ("eval cost", "GPU-s per point", "tokens/s per engine", "units done 8", "expired leases 0",
                 "GB free", "0.312±0.036", "0.812±0.036"):
        assert part in text, (part, text)
    assert lines[-1] == "training interrupted (SIGINT to ckpteval demo)"  # README: status | tail -n 1
    wide = _shown([status], 250)
    assert wide[-1].startswith("training interrupted (SIGINT to ckpteval demo) | units done 8")  # one line when it fits
    assert any(line.strip() == f"points of {RUN_ID}" for line in wide)  # the whole table, titled


def test_status_of_two_runs_at_80_columns_names_each_run_whole(tmp_path: Path) -> None:
    a, b = _run(tmp_path / "a"), _run(tmp_path / "b", run_id="b")
    lines = _shown([collect_status(a.path), collect_status(b.path)], 80)
    assert not _too_wide(lines, 80), "\n".join(lines)
    text = " ".join(line.strip() for line in lines)
    assert f"run {RUN_ID} ({a.path})" in text and f"run b ({b.path})" in text  # not cut to "…"
    assert "…" not in text


def test_a_dataset_line_renderer_and_an_unpooled_reason_show_up_fitted(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The hooks other status lines plug into: a per-dataset line (fitted to the width) and a reason a
    dataset has no one number at a point (its cell)."""
    status = collect_status(_run(tmp_path).path)
    monkeypatch.setattr(status_text, "DATASET_LINES", [lambda s, ds: f"{ds}: a per-dataset line " + "word " * 30])
    del status["points"][0]["datasets"]["math500"]  # units on two engines: no one number (as mixed_scorers)
    status["points"][0]["mixed_engines"] = ["math500"]
    monkeypatch.setitem(status_text.UNPOOLED, "mixed_engines", "not pooled: engines differ")
    lines = _shown([status], 80)
    assert not _too_wide(lines, 80), "\n".join(lines)
    assert sum(line.startswith(("gsm8k_style: a per-dataset line", "math500: a per-dataset line")) for line in lines) == 2
    assert any("not pooled: engines" in line for line in lines), "\n".join(lines)



def test_status_shows_the_completed_only_score_and_censored_share_fitted_only_when_cut_off(tmp_path: Path) -> None:
    """#40: where a sample was cut at the length limit, status shows per point the completed-only score ± its stderr
    and the censored share (``<ds> completed-only``), within the width; with nothing cut off, no such column."""
    plain = _shown([collect_status(_run(tmp_path / "plain").path)], 250)
    assert not any("completed-only" in line for line in plain), "\n".join(plain)
    status = collect_status(_run(tmp_path / "cut", cut_at=20).path)
    c = next(p for p in status["points"] if p["step"] == 20)["datasets"]["gsm8k_style"]["censoring"]
    assert (c["completed"], c["censored"]) == (0.75, 0.5)  # step 20: prompts scoring 0.875 cut, 0.75 kept
    want = f"{c['completed']:.3f}±{c['completed_stderr']:.3f}cut{c['censored']:.0%}"
    for width in (250, 80, 60):
        lines = _shown([status], width)
        assert not _too_wide(lines, width), "\n".join(lines)
        squeezed = "".join("".join(lines).split())  # a folded cell or header read back whole
        assert "gsm8k_stylecompleted-only" in squeezed and want in squeezed, (want, "\n".join(lines))
        assert "math500completed-only" not in squeezed  # nothing of math500 was cut off
