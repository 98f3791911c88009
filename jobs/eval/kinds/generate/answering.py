"""Scoring the answers of generations, never their reasoning, and what each sample says about its length.

:func:`score_generations` is what a ``generate`` unit's samples go through between the engine and the
result: each completion is split by the dataset's reasoning setting (:func:`ckpteval.jobs.eval.kinds.generate.reasoning.split_reasoning`),
the scorer (and so a judge, a sandbox) is handed only the answer, and a completion whose reasoning never
ended is not scored at all (score 0, no extracted answer: it casts no ``maj@n`` vote). Every sample gets
the per-sample numbers a point averages (``Scored.extras``, summed per unit as ``{"sum", "n"}``):

- ``truncated``: 1 when the engine stopped it at the length limit (``finish_reason == "length"``), 0 when
  it stopped on its own; absent when the engine does not say (so the share is over the samples it told).
- ``no_answer``: 1 when there was nothing to score — the reasoning never ended, or the scorer found
  nothing in the answer (:func:`found_nothing`: its ``no_answer(sample, scored)``; by default an answer
  empty after stripping whitespace; ``math``: math-verify extracted nothing; ``code``: no program).
- ``completion_tokens``: the tokens the engine generated for it.
- ``reasoning_tokens``: with a reasoning setting, the reasoning's tokens (the thoughts and the end
  delimiter, re-encoded by the snapshot's tokenizer, at most ``completion_tokens``; all of them when the
  reasoning never ended); absent when no tokenizer can be read.

These names take precedence over a scorer's own extras of the same name. The scoring identity a result
records (:func:`scoring_identity`) is the scorer's plus the dataset's ``chat_template_kwargs`` and resolved
reasoning setting when set, so units prompted or stripped differently never pool into one point.

Limits: re-encoding the reasoning text is the tokenizer's count of the decoded text, which can differ by a
token or two from the ids the engine sampled; the answer's tokens are not counted separately.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ckpteval.coord.entries.generate import GenerateEntry
from ckpteval.jobs.eval.engines.base import Generation
from ckpteval.jobs.eval.kinds.generate.prompts import snapshot_tokenizer
from ckpteval.jobs.eval.kinds.generate.reasoning import (
    TOKENIZER,
    ReasoningSetting,
    ReasoningUnresolved,
    Split,
    parse_setting,
    split_reasoning,
)
from ckpteval.jobs.eval.scorers import Sample, Scored, Scorer, score_samples


@dataclasses.dataclass(frozen=True)
class Reasoning:
    """A dataset's reasoning setting resolved for one snapshot, and how to count a text's tokens there."""

    setting: ReasoningSetting | None
    count_tokens: Callable[[str], int] | None = None


def resolve_reasoning(spec: GenerateEntry, snapshot_dir: str | None) -> Reasoning:
    """``spec.reasoning`` for the snapshot at ``snapshot_dir`` (its tokenizer: ``end: "tokenizer"``, and the
    reasoning token count). A ``tokenizer`` setting the snapshot cannot resolve raises
    :class:`ReasoningUnresolved` (a ``bad_config`` skip): callers resolve it before generating."""
    if spec.reasoning is None:
        return Reasoning(None)
    tokenizer = None
    if snapshot_dir is not None:
        try:
            tokenizer = snapshot_tokenizer(snapshot_dir)
        except RuntimeError as e:
            if spec.reasoning.get("end") == TOKENIZER:
                raise ReasoningUnresolved(f"dataset {spec.name!r} on {snapshot_dir}: setting reasoning.end='tokenizer' "
                                          f"needs the snapshot's tokenizer: {e}") from e
    setting = parse_setting(spec.reasoning, tokenizer, f"dataset {spec.name!r} on {snapshot_dir}")
    if tokenizer is None:
        return Reasoning(setting)
    return Reasoning(setting, lambda text: len(tokenizer.encode(text, add_special_tokens=False)))


def chat_identity(spec: GenerateEntry, reasoning: Reasoning) -> dict[str, Any]:
    """What a result's scoring identity records of the chat settings: the template kwargs and the resolved
    reasoning strip, each only when set (``generate`` and ``env`` sets alike)."""
    out: dict[str, Any] = {}
    if spec.chat_template_kwargs:
        out["chat_template_kwargs"] = dict(spec.chat_template_kwargs)
    if reasoning.setting is not None:
        out["reasoning"] = reasoning.setting.identity()
    return out


def scoring_identity(scorer: Scorer, spec: GenerateEntry, reasoning: Reasoning) -> dict[str, Any]:
    """The result's ``scorer`` identity: the scorer's own, plus :func:`chat_identity`."""
    return {**scorer.identity(), **chat_identity(spec, reasoning)}


def found_nothing(scorer: Scorer, sample: Sample, scored: Scored) -> bool:
    """Whether the scorer extracted nothing from ``sample`` (its ``no_answer`` hook, else an empty answer)."""
    hook = getattr(scorer, "no_answer", None)
    if callable(hook):
        return bool(hook(sample, scored))
    return not sample.completion.strip()


def score_generations(scorer: Scorer, samples: list[Sample], generations: list[Generation],
                      reasoning: Reasoning) -> list[Scored]:
    """Score each sample's answer (see the module docstring); one :class:`Scored` per sample, in order."""
    splits = [split_reasoning(s.completion, reasoning.setting, s.prompt) for s in samples]
    answered = [i for i, sp in enumerate(splits) if sp.answer is not None]
    to_score = {i: dataclasses.replace(samples[i], completion=splits[i].answer) for i in answered}
    graded = dict(zip(answered, score_samples(scorer, list(to_score.values())), strict=True)) if to_score else {}
    out = []
    for i, (sample, split, gen) in enumerate(zip(samples, splits, generations, strict=True)):
        scored = graded.get(i, Scored(0.0, None))
        empty = i not in graded or found_nothing(scorer, to_score[i], scored)
        extras = {**scored.extras, **sample_extras(gen, sample.completion, split, empty, reasoning)}
        out.append(dataclasses.replace(scored, extras=extras))
    return out


def sample_extras(gen: Generation, text: str, split: Split, empty: bool, reasoning: Reasoning) -> dict[str, float]:
    """The generation numbers of one sample whose completion ``text`` split as ``split`` (module docstring)."""
    extras = {"no_answer": float(empty), "completion_tokens": float(gen.n_tokens)}
    if gen.finish_reason is not None:
        extras["truncated"] = float(gen.finish_reason == "length")
    if reasoning.setting is not None and reasoning.count_tokens is not None:
        if split.answer is None:  # all of it was reasoning
            extras["reasoning_tokens"] = float(gen.n_tokens)
        else:  # the text before the answer: opening tag, thoughts, end delimiter ("" when it did not think)
            thought = text[: len(text) - len(split.answer)]
            extras["reasoning_tokens"] = float(min(gen.n_tokens, reasoning.count_tokens(thought)) if thought else 0)
    return extras
