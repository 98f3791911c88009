"""``ckpteval status``'s noise section: per dataset the replay spread and the minimum detectable effect.

For each per-sample dataset with a complete point: the newest complete point's prompts and per-prompt
variance ``s2_y``, what the run's replays (``eval.replay``) measured of the engine
(:func:`ckpteval.jobs.decide.noise.engine_noise`: pairs, the fraction of prompts that changed, the largest
replay difference of the mean, the shared engine variance ``tau2``), and the MDE of comparing that point
with another step of the run at level 0.95 and power 0.8, *unpaired*:
``MDE = (t_0.975 + t_0.8) sqrt(2 s2_y / n + 2 tau2)`` (:func:`ckpteval.jobs.decide.noise.mde`; an upper bound for steps whose prompts agree, which
``ckpteval compare`` pairs; ``tau2`` 0 and said so without replays; undefined, with the reason, for one prompt or
no spread: :func:`ckpteval.jobs.decide.noise.mde_undefined`). Also the replays' share of the run's
eval compute (``eval/cost/replay_share`` over every point).

Guarantee: reads only the result files of the steps it needs (the newest complete point of each dataset and
the replayed steps), never writes. Limits: the MDE is the newest point's; an older point's spread may differ.
"""

from __future__ import annotations

import math
from typing import Any

from ckpteval.coord.run.rundir import RunDir
from ckpteval.jobs.decide.data import Metric, RunValues
from ckpteval.jobs.decide.noise import DEFAULT_POWER, engine_noise, mde, mde_text, mde_undefined

LEVEL = 0.95


def noise_status(run: RunDir, points: list[dict[str, Any]]) -> dict[str, Any]:
    """The noise section of ``status --json``: ``{"datasets": {name: {...}}, "replay_share": x | None}``."""
    manifest = run.manifest()
    newest: dict[str, int] = {}
    for p in points:
        for name in p.get("datasets") or {}:
            newest[name] = max(newest.get(name, p["step"]), p["step"])
    replayed = {p["step"] for p in points if manifest.eval.replay.due(p["step"])}
    wanted = [d.name for d in manifest.eval.entries if d.name in newest]  # newest: per-sample entries
    out: dict[str, Any] = {"datasets": {}, "replay_share": replay_share(points)}
    if not wanted:
        return out
    side = RunValues(run, only_steps=set(newest.values()) | replayed)
    for name in wanted:
        metric = Metric(name, "mean")
        try:
            values = side.values(newest[name], metric)
            noise = engine_noise(side.replay_pairs(metric))
        except ValueError:
            continue  # its point is not whole in what was read (a result landed meanwhile): next time
        s2 = float(values.var(ddof=1)) if values.size > 1 else 0.0
        shared, pairs = (noise.shared_var, noise.df_pairs) if noise else (0.0, 0)
        why = mde_undefined(2 * s2, int(values.size), shared)
        out["datasets"][name] = {
            "step": newest[name], "prompts": int(values.size), "prompt_var": s2,
            "mde": None if why else mde(2 * s2, int(values.size), shared, LEVEL, DEFAULT_POWER, pairs),
            **({"mde_undefined": why} if why else {}),
            "level": LEVEL, "power": DEFAULT_POWER, "engine": noise.to_json() if noise else None}
    return out


def replay_share(points: list[dict[str, Any]]) -> float | None:
    """The replays' share of the eval compute of every point (GPU-seconds, else engine seconds); None when
    no point has replays."""
    costs = [p.get("cost") or {} for p in points]
    if not any("replay_share" in c for c in costs):
        return None
    for name in ("gpu_s", "engine_s"):
        total = math.fsum(c.get(name, 0.0) for c in costs)
        if total > 0:
            return math.fsum(c.get(f"replay_{name}", 0.0) for c in costs) / total
    return 0.0


def noise_lines(section: dict[str, Any] | None) -> list[str]:
    """One line per dataset (its MDE and replay spread) and one for the replays' cost."""
    if not section or not section["datasets"]:
        return []
    lines = []
    for name, d in section["datasets"].items():
        e = d["engine"]
        spread = (f"replays {e['pairs']}: {e['changed']:.1%} of prompts changed, |diff| <= {e['max_abs_diff']:.4f}, "
                  f"shared sd {math.sqrt(e['shared_var']):.4f}" if e else "engine noise not measured (no replays)")
        lines.append(f"noise {name}: {mde_text(d['mde'], d.get('mde_undefined'))} (step {d['step']}, {d['prompts']} prompts, "
                     f"{d['level']:.0%}/power {d['power']:.0%}) | {spread}")
    if section.get("replay_share") is not None:
        lines.append(f"replays cost {section['replay_share']:.1%} of eval compute")
    return lines
