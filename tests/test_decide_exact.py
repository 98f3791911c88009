"""Decision statistics computed exactly (#37): scipy's t at every df (fractional ones as they are), intervals
at 2-3 prompts, an MDE only where one exists, and pairing refusals that say what differs."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from ckpteval.jobs.decide import compare
from ckpteval.jobs.decide.data import RunValues, check_paired
from ckpteval.jobs.decide.noise import mde, mde_verdict
from ckpteval.jobs.decide.stats import paired_interval, t_quantile
from tests.support.runs import make_run


def _t_cdf_by_integration(q: float, df: float) -> float:
    """P(T <= q) for Student's t from its density, integrated numerically (no scipy): the independent check."""
    x = np.linspace(0.0, q, 400_001)
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    dens = c * (1 + x * x / df) ** (-(df + 1) / 2)
    return 0.5 + float(np.sum((dens[1:] + dens[:-1]) / 2 * np.diff(x)))


@pytest.mark.parametrize("p, df, table", [(0.975, 1, 12.7062), (0.975, 2, 4.3027), (0.9875, 1, 25.4517),
                                          (0.995, 2, 9.9248), (0.975, 5, 2.5706)])
def test_t_quantile_is_exact_at_small_df(p: float, df: int, table: float) -> None:
    """Before: a series around the normal quantile, 11 % low at df 1 and 7 % at df 2 for the family levels."""
    assert t_quantile(p, df) == pytest.approx(table, rel=2e-4)


def test_a_fractional_df_is_used_as_it_is() -> None:
    """df 1.89 (a Welch-Satterthwaite value): the quantile at 1.89 itself, not at 2 (before: rounded)."""
    q = t_quantile(0.975, 1.89)
    assert _t_cdf_by_integration(q, 1.89) == pytest.approx(0.975, abs=2e-5)
    assert q > t_quantile(0.975, 2) * 1.05


def test_two_prompts_whose_exact_interval_contains_0_are_not_called_better() -> None:
    """Differences 0.10 and 0.118: t(0.975, 1) x sd/sqrt(2) = 0.114 > 0.109 (before: "B better")."""
    iv = paired_interval(np.array([0.5, 0.4]), np.array([0.6, 0.518]))
    assert iv.low < 0 < iv.high and compare.verdict(iv.low, iv.high) == "not distinguishable from noise"


@pytest.mark.parametrize("a, b, says", [
    (np.full(20, 0.5), np.full(20, 0.5), "no spread"),  # identical steps
    (np.ones(20), np.ones(20), "no spread"),  # every score 1.0
    (np.array([0.4]), np.array([0.6]), "1 prompt"),  # a 1-prompt point
])
def test_no_mde_where_nothing_can_be_detected(a: np.ndarray, b: np.ndarray, says: str) -> None:
    """Before: "MDE 0.0000" — a claim that any difference would be seen."""
    got = mde_verdict(b - a, 0.95, None)
    assert got.mde is None and says in (got.undefined or "") and not got.below
    with pytest.raises(ValueError, match=says):
        mde(float((b - a).var(ddof=1)) if a.size > 1 else 0.0, a.size)
    if a.size > 1:
        row = {"bootstrap": {"low": 0.0, "high": 0.0}, **got.to_json()}
        assert "MDE undefined (" in compare.noise_line(row)


def test_runs_with_other_samples_per_prompt_are_refused_saying_so(tmp_path: Path) -> None:
    from dataclasses import replace

    from ckpteval.coord.run.rundir import RunDir

    a = make_run(tmp_path / "a", n_prompts=10)
    b = make_run(tmp_path / "b", n_prompts=10)
    m = b.manifest()
    RunDir.create(b.path, replace(m, eval=replace(m.eval, entries=(replace(m.eval.entries[0], n_samples=4),))))
    with pytest.raises(ValueError, match=r"samples per prompt \(n_samples\) 1 vs 4"):
        check_paired(RunValues(a), RunValues(RunDir.open(b.path)), "add")
