"""One episode's model turns: their versions, and the generation numbers a point averages per episode.

Both episode paths record through :class:`Turns` — the lockstep runner (:mod:`ckpteval.jobs.eval.kinds.env.runner`)
and the loopback endpoint of environments that drive the model (:mod:`ckpteval.jobs.eval.kinds.env.endpoint`) —
so an ``env`` set reports ``eval/<env>/truncated``, ``no_answer``, ``completion_tokens`` (and
``reasoning_tokens``) like a ``generate`` set, per episode instead of per sample:

- ``completion_tokens`` / ``reasoning_tokens``: summed over the episode's turns (each turn's counted as
  :func:`ckpteval.jobs.eval.kinds.generate.answering.sample_extras` counts a sample's; ``reasoning_tokens`` only when every turn
  had it: a reasoning setting and a readable tokenizer).
- ``truncated``: 1 when any turn stopped at the length limit, 0 when every turn that said stopped on its
  own; absent when the engine never said.
- ``no_answer``: 1 when a turn's reasoning never ended (:func:`ckpteval.jobs.eval.kinds.generate.reasoning.split_reasoning`'s
  ``None``): that turn had no answer, and the episode ends ``no_answer`` there (reward 0) — the
  environment is never handed the trace, as a scorer never is (:mod:`ckpteval.jobs.eval.kinds.generate.answering`).

Limits: a turn that ended its reasoning and then said nothing is handed to the environment as an empty
reply (the environment judges it; it is not counted ``no_answer`` here).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ckpteval.jobs.eval.engines.base import Generation
from ckpteval.jobs.eval.kinds.generate.answering import Reasoning, sample_extras
from ckpteval.jobs.eval.kinds.generate.reasoning import Split

ENDED_NO_ANSWER = "no_answer"  # an episode ending (the model's): a turn's reasoning never ended


@dataclass
class Turns:
    """What one episode's turns were: the version and numbers of each, in order."""

    versions: list[str | None] = field(default_factory=list)
    tokens: int = 0
    unanswered: int = 0  # turns whose reasoning never ended
    cut: list[float] = field(default_factory=list)  # per turn that said: 1.0 stopped at the length limit
    reasoning_tokens: float | None = 0.0  # None once a turn could not count them

    def add(self, g: Generation, split: Split, reasoning: Reasoning) -> None:
        """Record one turn: its generation ``g`` and how its text split into reasoning and answer."""
        extras = sample_extras(g, g.text, split, split.answer is None, reasoning)
        self.versions.append(g.weight_version)
        self.tokens += g.n_tokens
        self.unanswered += int(extras["no_answer"])
        if "truncated" in extras:
            self.cut.append(extras["truncated"])
        counted = extras.get("reasoning_tokens")
        self.reasoning_tokens = None if counted is None or self.reasoning_tokens is None else self.reasoning_tokens + counted

    def extras(self) -> dict[str, float]:
        """The episode's generation numbers (the module docstring); none for an episode without turns."""
        if not self.versions:
            return {}
        out = {"no_answer": float(self.unanswered > 0), "completion_tokens": float(self.tokens)}
        if self.cut:
            out["truncated"] = max(self.cut)
        if self.reasoning_tokens is not None:
            out["reasoning_tokens"] = self.reasoning_tokens
        return out
