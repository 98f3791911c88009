"""The cross-engine check on demand (run.json ``eval.canary.cross_engine: N``): on the snapshot the worker's engine
holds, the in-process transformers engine answers the same pinned prompts greedy; per-prompt agreement and the
largest |Δ log-prob| of the in-process answers, teacher-forced on both. See docs/USER_GUIDE.md "Cross-engine check".

Limits: it compares with transformers in the engine's own dtype on the worker's CPU (float32 when the engine does not
say); the log-prob side needs an engine that teacher-forces (else only agreement); LoRA snapshots are not compared.
"""

from __future__ import annotations

import time
from typing import Any

from ckpteval.coord.entries.generate import GenerateEntry
from ckpteval.coord.run.manifest import RunManifest
from ckpteval.jobs.eval.engines.base import ReportsComputeDtype, SamplingParams, TeacherForced
from ckpteval.jobs.eval.proof.canary_check import engine_kind

PREFIX = "cross_engine"  # eval/fidelity/cross_engine/<dataset>/<engine>-<dtype>_vs_hf-<dtype>/<field>


def first_generate(manifest: RunManifest) -> GenerateEntry:
    for spec in manifest.eval.entries:
        if isinstance(spec, GenerateEntry):
            return spec
    raise ValueError(f"run {manifest.run_id}: eval.canary.cross_engine needs a generate entry in eval.datasets")


def cross_check(engine: Any, spec: GenerateEntry, prompts: list[str], snapshot: str) -> dict[str, float]:
    """``engine`` (holding ``snapshot``) against the in-process transformers engine on ``prompts``, greedy, the
    entry's ``max_new_tokens``: ``{<PREFIX>/<dataset>/<label>/<field>: value}`` with fields ``prompts``, ``agree``
    (answers equal, text and token count), ``agreement``, ``max_abs_logprob_diff`` (over every token of the in-process
    answers, teacher-forced on both; absent when the engine cannot) and ``seconds``."""
    from ckpteval.jobs.eval.engines.hf.engine import HFEngine  # torch: only when a check is asked for

    t0 = time.perf_counter()
    dtype = (engine.compute_dtype if isinstance(engine, ReportsComputeDtype) else None) or "float32"
    reference = HFEngine(dtype=dtype if dtype in ("float32", "bfloat16", "float16") else "float32")
    try:
        reference.load(snapshot, "cross-engine")
        params = SamplingParams(max_new_tokens=spec.max_new_tokens)
        theirs, ours = engine.generate(prompts, params), reference.generate(prompts, params)
        agree = sum(a.text == b.text and a.n_tokens == b.n_tokens for a, b in zip(theirs, ours, strict=True))
        fields = {"prompts": float(len(prompts)), "agree": float(agree), "agreement": agree / max(len(prompts), 1)}
        if isinstance(engine, TeacherForced):
            pairs = [(p, g.text) for p, g in zip(prompts, ours, strict=True) if g.text]
            fields["max_abs_logprob_diff"] = max_logprob_diff(engine.teacher_forced(pairs), reference.teacher_forced(pairs))
    finally:
        reference.close()
    fields["seconds"] = time.perf_counter() - t0
    label = f"{engine_kind(engine)}-{dtype}_vs_hf-{reference.compute_dtype or dtype}"
    return {f"{PREFIX}/{spec.name}/{label}/{k}": v for k, v in fields.items()}


def max_logprob_diff(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> float:
    """The largest |Δ log-prob| over the positions both records score (inf when the token ids differ)."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if x["ids"] != y["ids"]:
            return float("inf")
        for p, q in zip(x["logprobs"], y["logprobs"], strict=True):
            if p is not None and q is not None:
                worst = max(worst, abs(p - q))
    return worst

