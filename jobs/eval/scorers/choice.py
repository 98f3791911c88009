"""Scorer ``choice``: the letter of a multiple-choice answer against the row's ``answer`` (MMLU-STEM of the
catalog). docs/USER_GUIDE.md "The benchmark catalog".

The letter is the one in the last ``\\boxed{}`` holding a lone letter, else the first after the last "answer
is" / "choice is" / "answer:", else the last lone capital letter of the completion (``B``, ``(B)``)."""

from __future__ import annotations

import re

from ckpteval.jobs.eval.scorers import BaseScorer, Sample, Scored

LETTERS = "ABCD"
BOXED = re.compile(rf"\\boxed\{{\s*(?:\\text\{{)?\(?([{LETTERS}{LETTERS.lower()}])\)?\}}?\s*\}}")
TRIGGER = re.compile(r"(?:answer|choice)\s*(?:is|:)", re.IGNORECASE)
LONE = re.compile(rf"(?<![A-Za-z])([{LETTERS}])(?![A-Za-z])")


def extract_choice(text: str) -> str | None:
    """The chosen letter of ``text`` (see the module docstring), None when it names none."""
    if boxed := BOXED.findall(text):
        return boxed[-1].upper()
    parts = TRIGGER.split(text)
    if len(parts) > 1 and (after := LONE.search(parts[-1])):
        return after.group(1)
    lone = LONE.findall(text)
    return lone[-1] if lone else None


class ChoiceScorer(BaseScorer):
    """1 when the extracted letter is the row's ``answer`` (see the module docstring)."""

    def score(self, samples: list[Sample]) -> list[Scored]:
        out = []
        for s in samples:
            got = extract_choice(s.completion)
            out.append(Scored(float(got is not None and got == (s.answer or "").strip().upper()), got))
        return out

    def no_answer(self, sample: Sample, scored: Scored) -> bool:
        return scored.answer is None
