"""The canary: the eval engine computes what the trainer computed, on a small fixed probe.

Attestation (:mod:`jobs.eval.attest`) proves an engine holds the snapshot's tensors; it cannot see a
tokenizer, a dtype or a kernel that makes the same tensors compute something else. At export a trainer
holding an HF-style model stores teacher-forced log-probabilities of a probe — the first
:data:`PROBE_ROWS` rows (``prompt`` + reference ``answer``) of the run's first eval set — in the
snapshot as :data:`coord.snapshot.CANARY` (listed in the marker like every file): per probe the text,
the token ids the trainer's tokenizer gave, each continuation token's log-probability and the argmax.
After pinning, an engine that can (:meth:`~jobs.eval.engines.hf.HFEngine.teacher_forced`) recomputes
them with the tokenizer it generates with; :func:`compare` gives ``max_abs_logprob_diff`` and
``argmax_agreement`` (``eval/fidelity/*``). Token ids that differ (another tokenizer) make the probe
incomparable: the difference is infinite and agreement 0.

Limits: a probe of a few short rows exercises the kernels and the tokenizer on those rows only; a
trainer that cannot compute it (Megatron, foreign checkpoints) stores none and the canary is reported
absent, not passed; engines without teacher forcing over HTTP are not compared here.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from coord.snapshot import CANARY, Marker
from jobs.eval.pinning import WorkerSkip

PROBE_ROWS = 4


@dataclass(frozen=True)
class Fidelity:
    """The canary's comparison for one load: ``max_abs_logprob_diff`` over every probe token (inf when
    the tokenizations differ), ``argmax_agreement`` (fraction of positions whose argmax matches),
    ``tokens`` compared and ``seconds`` spent."""

    max_abs_logprob_diff: float
    argmax_agreement: float
    tokens: int
    seconds: float = 0.0

    def to_json(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}


class CanaryFailed(WorkerSkip):
    """The engine's log-probs of the probe differ from the trainer's by more than the threshold."""

    reason = "canary_failed"


def check_canary(engine: Any, snapshot: Path, marker: Marker, max_abs_diff: float | None) -> Fidelity | None:
    """Recompute ``snapshot``'s canary on every engine behind ``engine`` that can (the worst is kept);
    None when the snapshot has no canary or no engine can teacher-force. :class:`CanaryFailed` when
    ``max_abs_diff`` > 0 and the difference exceeds it (0: record only; None: the measured default for
    the engine's dtype against the trainer's, :func:`default_bound`). ValueError for an unreadable
    canary file."""
    members = [e for e in (getattr(engine, "engines", None) or [engine]) if hasattr(e, "teacher_forced")]
    if CANARY not in marker.files or not members:
        return None
    t0 = time.perf_counter()
    try:
        stored = json.loads((snapshot / CANARY).read_text())
        pairs = [(p["prompt"], p["continuation"]) for p in stored["probes"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{snapshot / CANARY}: unreadable canary ({e})") from e
    results = [compare(stored, e.teacher_forced(pairs)) for e in members]
    worst = max(results, key=lambda f: (f.max_abs_logprob_diff, -f.argmax_agreement))
    fidelity = Fidelity(worst.max_abs_logprob_diff, worst.argmax_agreement, worst.tokens, time.perf_counter() - t0)
    if max_abs_diff is None:
        max_abs_diff = max(default_bound(getattr(e, "compute_dtype", None), stored.get("dtype")) for e in members)
    if 0 < max_abs_diff < fidelity.max_abs_logprob_diff:
        raise CanaryFailed(
            f"canary: max |Δ log-prob| {fidelity.max_abs_logprob_diff:.4g} over {fidelity.tokens} probe tokens "
            f"(argmax agreement {fidelity.argmax_agreement:.3f}) exceeds {max_abs_diff:g} — another tokenizer, "
            f"dtype or kernel than the trainer's ({stored.get('dtype')})"
        )
    return fidelity


def default_bound(engine_dtype: str | None, trainer_dtype: str | None) -> float:
    """``--canary-max-diff``'s default: the same-dtype bound when the engine computes in the trainer's
    dtype, else the narrower-dtype one (jobs.eval.options, measured in bench/RESULTS.md "Canary")."""
    from jobs.eval.options import CANARY_MAX_DIFF_NARROWER, CANARY_MAX_DIFF_SAME_DTYPE

    return CANARY_MAX_DIFF_SAME_DTYPE if engine_dtype == trainer_dtype else CANARY_MAX_DIFF_NARROWER


def probe_rows(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """``(prompt, continuation)`` pairs: the first rows with a string ``prompt`` and ``answer``."""
    pairs = [(r["prompt"], str(r["answer"])) for r in rows
             if isinstance(r.get("prompt"), str) and isinstance(r.get("answer"), str | int | float)]
    return pairs[:PROBE_ROWS]


def teacher_forced(model: Any, tokenizer: Any, pairs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Token ids, continuation log-probabilities and argmax of each ``(prompt, continuation)`` under
    ``model``: one forward pass over the rows right-padded (causal attention: a row's positions never
    see its padding)."""
    import torch  # here, not at import time: a worker with an fn backend never loads torch (bench_fleet.py)

    with torch.no_grad():
        rows = [(list(tokenizer(p + c)["input_ids"]), len(tokenizer(p)["input_ids"])) for p, c in pairs]
        if not rows:
            return []
        width = max(len(ids) for ids, _ in rows)
        ids = torch.tensor([i + [0] * (width - len(i)) for i, _ in rows])
        mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in rows])
        device = next(model.parameters()).device
        logprobs = torch.log_softmax(model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float(), -1)
        out = []
        for row, ((full, start), (prompt, continuation)) in enumerate(zip(rows, pairs, strict=True)):
            positions = range(max(start, 1), len(full))
            out.append({
                "prompt": prompt, "continuation": continuation, "ids": full, "start": start,
                "logprobs": [float(logprobs[row, i - 1, full[i]]) for i in positions],
                "argmax": [int(logprobs[row, i - 1].argmax()) for i in positions],
            })
        return out


def canary_bytes(model: Any, tokenizer: Any, pairs: list[tuple[str, str]]) -> bytes:
    """The :data:`coord.snapshot.CANARY` file a trainer stores with a snapshot."""
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    probes = teacher_forced(model, tokenizer, pairs)
    return (json.dumps({"dtype": dtype, "probes": probes}) + "\n").encode()


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
        if self.base is None or not self.manifest.eval.datasets:
            return None, []
        from transformers import AutoTokenizer

        from jobs.eval.evalsets import load_dataset

        try:
            tokenizer = AutoTokenizer.from_pretrained(self.base, local_files_only=True)
            return tokenizer, probe_rows(load_dataset(self.run, self.manifest.eval.datasets[0]))
        except (OSError, ValueError) as e:
            print(f"ckpteval: no canary for this run ({e})", file=sys.stderr)
            return None, []


def compare(stored: dict[str, Any], recomputed: list[dict[str, Any]]) -> Fidelity:
    """The stored probes against an engine's recomputation of the same rows."""
    worst, agree, total = 0.0, 0, 0
    for want, got in zip(stored["probes"], recomputed, strict=True):
        if want["ids"] != got["ids"] or want["start"] != got["start"]:
            return Fidelity(math.inf, 0.0, 0)
        for a, b in zip(want["logprobs"], got["logprobs"], strict=True):
            worst = max(worst, abs(a - b))
        agree += sum(x == y for x, y in zip(want["argmax"], got["argmax"], strict=True))
        total += len(want["argmax"])
    return Fidelity(worst, agree / total if total else 1.0, total)
