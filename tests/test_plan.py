"""The sample-size planner (#40): its variance split recovers known sigma2_p, sigma2_s, sigma2_d by simulation; the
designs it advises reach the nominal power by simulation; on a real run (a real worker, ``--engine http:`` against a
scripted stand-in whose prompts differ in difficulty and whose samples are drawn per prompt) its MDE is the one
``compare`` reports, and its advice from half the prompts or half the samples lands near the design that reached it."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from ckpteval.coord.run.rundir import RunDir
from ckpteval.jobs.decide.compare import main as compare_main
from ckpteval.jobs.decide.data import open_run
from ckpteval.jobs.decide.plan import Settings, design_mde, plan, run_points, variance_split
from ckpteval.jobs.decide.plan import main as plan_main
from ckpteval.jobs.decide.stats import paired_interval
from tests.support.canned_engine import ScriptedEngine
from tests.support.workers import scripted_run

PROMPTS, SAMPLES, STEPS = 80, 4, (0, 10, 20)


def simulate(rng: np.random.Generator, prompts: int, samples: int, steps: int, var_a: float, var_b: float,
             var_s: float, effect: float = 0.0) -> list[np.ndarray]:
    """Normal scores ``a_i + b_si + e_sij`` (+ ``effect`` per step): sigma2_p = var_a + var_b, sigma2_d = 2 var_b."""
    a = rng.normal(0, var_a**0.5, prompts)
    return [s * effect + a[:, None] + rng.normal(0, var_b**0.5, prompts)[:, None]
            + rng.normal(0, var_s**0.5, (prompts, samples)) for s in range(steps)]


def test_the_split_recovers_known_variances() -> None:
    rng = np.random.default_rng(7)
    split = variance_split(simulate(rng, 400, 6, 5, var_a=0.03, var_b=0.01, var_s=0.09))
    assert split.prompt_var == pytest.approx(0.04, rel=0.15)
    assert split.sample_var == pytest.approx(0.09, rel=0.05)
    assert split.pair_var == pytest.approx(0.02, rel=0.2)
    assert (split.prompts, split.samples, split.steps, split.pairs) == (400, 6, 5, 4)


def test_one_sample_per_prompt_or_one_step_is_refused() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="cannot be told apart"):
        variance_split(simulate(rng, 20, 1, 3, 0.03, 0.01, 0.09))
    with pytest.raises(ValueError, match="needs two"):
        plan("ds", variance_split(simulate(rng, 20, 4, 1, 0.03, 0.01, 0.09)), 0.1, None, Settings())


@pytest.mark.parametrize("way", ["more_prompts", "more_samples"])
def test_an_advised_design_reaches_the_nominal_power(way: str) -> None:
    """Fit on a pilot run, take the advised design, simulate new runs at it with a true effect of the MDE it says the
    design has (the target, less the rounding up to whole prompts or samples): compare's paired interval excludes 0
    in about ``power`` of them."""
    var_a, var_b, var_s = 0.03, 0.01, 0.2
    split = variance_split(simulate(np.random.default_rng(1), 200, 4, 8, var_a, var_b, var_s))
    p = plan("ds", split, 0.06, 100.0, Settings())
    design = getattr(p, way)
    assert design is not None and design.mde <= 0.06 < p.now.mde
    assert (design.prompts > 200) if way == "more_prompts" else (design.samples > 4 and design.prompts == 200)
    rng = np.random.default_rng(2)
    hits = [paired_interval(*(y.mean(axis=1) for y in simulate(rng, design.prompts, design.samples, 2, var_a, var_b,
                                                                var_s, effect=design.mde))).distinguishable
            for _ in range(600)]
    assert np.mean(hits) == pytest.approx(0.8, abs=0.06)  # 600 runs: sd of the rate 0.016


def _uniform(*key: object) -> float:
    return int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "big") / 2**64


def policy(text: str, engine: ScriptedEngine) -> str:
    """Prompt ``a+b=``: right with a probability set by the prompt, shifted by the step and by a prompt-step term."""
    step = int(engine.label.rsplit("@", 1)[1])
    prompt = text.strip()
    a, b = prompt.rstrip("=").split("+")
    j = engine.seen[(engine.label, prompt)]
    engine.seen[(engine.label, prompt)] += 1
    p = 0.1 + 0.6 * _uniform(prompt) + step / 200 + 0.6 * (_uniform(prompt, step) - 0.5)
    answer = f"{int(a) + int(b):03d}" if _uniform(prompt, step, j) < p else "999"
    return "<think>" + " w" * (3 + int(a) % 5) + "</think>" + answer


@pytest.fixture(scope="module")
def sampled(tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    return scripted_run(tmp_path_factory.mktemp("plan"), policy, STEPS, reasoning={"end": "</think>", "start": "<think>"},
                        n_prompts=PROMPTS, shard_size=40, n_samples=SAMPLES, max_new_tokens=40)

def _compare_mdes(run: RunDir, capsys: pytest.CaptureFixture[str]) -> list[float]:
    out = []
    for a, b in zip(STEPS, STEPS[1:], strict=False):
        assert compare_main([str(run.path), "--steps", str(a), str(b), "--json"]) == 0
        (row,) = json.loads(capsys.readouterr().out)["datasets"]
        out.append(row["mde"])
    return out


def test_on_a_real_run_the_plan_matches_compare_and_its_advice_the_mde_reached(
        sampled: RunDir, capsys: pytest.CaptureFixture[str]) -> None:
    reached = float(np.mean(_compare_mdes(sampled, capsys)))
    assert plan_main([str(sampled.path), "--mde", f"{reached / 2:.4f}", "--json"]) == 0
    (got,) = json.loads(capsys.readouterr().out)
    assert got["now"]["prompts"] == PROMPTS and got["now"]["samples"] == SAMPLES
    assert got["now"]["mde"] == pytest.approx(reached, rel=0.1)  # the MDE compare reported between the steps
    assert got["advice"] in ("prompts", "samples") and got["more_prompts"]["mde"] <= reached / 2
    assert got["tokens_per_sample"] > 1 and got["now"]["tokens"] == pytest.approx(
        PROMPTS * SAMPLES * got["tokens_per_sample"])
    points = run_points(open_run(sampled.path), "addition")
    half_prompts = plan("addition", variance_split([y[: PROMPTS // 2] for y in points]), reached, 1.0, Settings())
    assert half_prompts.more_prompts is not None and 0.6 * PROMPTS <= half_prompts.more_prompts.prompts <= 1.5 * PROMPTS
    half_samples = variance_split([y[:, : SAMPLES // 2] for y in points])
    assert design_mde(half_samples, PROMPTS, SAMPLES, Settings()) == pytest.approx(reached, rel=0.25)
    advised = plan("addition", half_samples, reached, 1.0, Settings()).more_samples
    assert advised is not None and SAMPLES - 1 <= advised.samples <= 2 * SAMPLES  # what reached it: 4
    assert plan_main([str(sampled.path), "--mde", f"{reached / 2:.4f}"]) == 0
    text = capsys.readouterr().out
    assert "addition: 80 prompts x 4 samples" in text and "advice: more" in text, text
    assert plan_main([str(sampled.path), "--mde", "0.03", "--dataset", "nope"]) == 2
    assert "no such dataset" in capsys.readouterr().err
