"""Where a completion's reasoning ends: the one strip every scorer and judge sees completions through.

A dataset's ``reasoning`` (run.json) names the delimiter that ends a reasoning model's thoughts:
``{"end": "</think>"}``, optionally with the tag that opens them (``"start": "<think>"``) and
``"always": true`` (every completion begins inside its reasoning); or ``{"end": "tokenizer"}``: the
snapshot tokenizer's own pair (:func:`tokenizer_setting`). :func:`split_reasoning` is the rule, as sglang
0.5.23 applies it (``srt/parser/reasoning_parser.py``, ``BaseReasoningFormatDetector._detect_and_parse_impl``):

- A completion is *in reasoning* when every completion is (``always``, or no ``start`` known: sglang's
  ``deepseek-r1`` parser, ``force_reasoning=True``), when its prompt already opened the block (the rendered
  prompt ends with ``start``: a template whose generation prompt is ``<think>\\n``, what sglang's template
  detection calls ``force_reasoning``, ``srt/parser/template_detection.py`` ``REASONING_MODE_RULES``), or
  when ``start`` appears in the completion.
- In reasoning, the answer is the text after the *first* ``end``; the text before it is the reasoning. No
  ``end`` but a ``tool_start`` tag (sglang's ``qwen3``/``glm45`` ``<tool_call>``, ``kimi_k2``
  ``<|tool_calls_section_begin|>``: ``{"parser": NAME}``): the reasoning ends there and the answer is the
  tag and what follows. Neither: the reasoning never ended (cut at the length limit, or the model never stopped thinking) and the
  completion has **no answer** (``None``): it scores 0 and the scorer never sees the trace. sglang returns
  such a completion as all reasoning and empty content, the same verdict.
- Not in reasoning: the whole completion is the answer (a model that did not think, e.g. with
  ``enable_thinking: false``).

Guarantee: :func:`split_reasoning` is pure (text, setting, prompt in; split out) — a rescore of kept
completions applies exactly what a worker applied. Limits: the delimiters must survive decoding; engines
decode with ``skip_special_tokens`` (sglang's default), so a delimiter the tokenizer marks special never
reaches the text — :func:`tokenizer_setting` refuses one, an explicit ``end`` is taken as given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from ckpteval.jobs.eval.skips import WorkerSkip

TOKENIZER = "tokenizer"  # "end": "tokenizer" -> the snapshot tokenizer's own pair

# The pairs sglang 0.5.23's reasoning parsers know (srt/parser/reasoning_parser.py): DeepSeekR1Detector,
# Qwen3Detector, KimiK2Detector, Glm45Detector ("<think>"), KimiDetector ("◁think▷"), MistralDetector
# ("[THINK]"), CohereCommand4Detector ("<|START_THINKING|>"). First match in the vocabulary wins.
KNOWN_PAIRS: tuple[tuple[str, str], ...] = (
    ("<think>", "</think>"),
    ("◁think▷", "◁/think▷"),
    ("[THINK]", "[/THINK]"),
    ("<|START_THINKING|>", "<|END_THINKING|>"),
)


# {"parser": NAME}: sglang's DetectorMap entries (reasoning_parser.py) -> (start, end, forced, tool start tag):
# DeepSeekR1Detector forces reasoning; Qwen3Detector, Glm45Detector and KimiK2Detector end an unclosed block
# at their tool_start_token
PARSERS: dict[str, tuple[str, str, bool, str | None]] = {
    "deepseek-r1": ("<think>", "</think>", True, None),
    "qwen3": ("<think>", "</think>", False, "<tool_call>"),
    "glm45": ("<think>", "</think>", False, "<tool_call>"),
    "kimi_k2": ("<think>", "</think>", False, "<|tool_calls_section_begin|>"),
}


class ReasoningUnresolved(WorkerSkip):
    """``{"end": "tokenizer"}`` on a snapshot whose tokenizer gives no usable pair: a configuration error,
    written at once as a ``bad_config`` skip naming the setting — never a crash, never an engine restart."""

    reason = "bad_config"


@dataclass(frozen=True)
class ReasoningSetting:
    """A resolved reasoning setting: ``end`` ends the thoughts, ``start`` (None: unknown) opens them,
    ``always``: every completion begins inside its reasoning (forced when ``start`` is unknown)."""

    end: str
    start: str | None = None
    always: bool = False
    tool_start: str | None = None  # a tag that ends an unclosed reasoning block (kept in the answer)

    def __post_init__(self) -> None:
        if not self.end or self.end == TOKENIZER:
            raise ValueError(f"a reasoning setting needs a resolved end delimiter, got {self.end!r}")
        if self.start == "":
            raise ValueError("a reasoning setting's start tag must be non-empty (or absent)")

    @property
    def forced(self) -> bool:
        return self.always or self.start is None

    def identity(self) -> dict[str, Any]:
        """What a result records of the strip applied (part of its scoring identity)."""
        out = {"end": self.end, "start": self.start, "always": self.forced}
        return {**out, "tool_start": self.tool_start} if self.tool_start else out


class Split(NamedTuple):
    """A completion split: its ``reasoning`` ("" when none) and its ``answer`` (None: the reasoning never ended)."""

    reasoning: str
    answer: str | None


def prompt_opens(prompt: str, setting: ReasoningSetting) -> bool:
    """Whether the rendered prompt leaves the model inside an opened reasoning block (it ends with ``start``,
    trailing whitespace aside): the completion then begins in reasoning without writing the tag itself."""
    return setting.start is not None and prompt.rstrip().endswith(setting.start)


def split_reasoning(text: str, setting: ReasoningSetting | None, prompt: str = "") -> Split:
    """``text`` split into (reasoning, answer) by ``setting`` (None: no reasoning, the whole text answers);
    ``prompt``: the text the engine was sent (see :func:`prompt_opens`). The rule is the module docstring's."""
    if setting is None:
        return Split("", text)
    in_reasoning = setting.forced or prompt_opens(prompt, setting) or (setting.start or "") in text
    if not in_reasoning:
        return Split("", text)
    body = text
    if setting.start is not None:
        while body.lstrip().startswith(setting.start):  # the model's own opening tag(s): not reasoning text
            body = body.lstrip()[len(setting.start):]
    reasoning, found, answer = body.partition(setting.end)
    if found:
        return Split(reasoning, answer)
    tool = body.find(setting.tool_start) if setting.tool_start else -1
    return Split(body[:tool], body[tool:]) if tool >= 0 else Split(body, None)


def parse_setting(value: dict[str, Any] | None, tokenizer: Any = None, where: str = "") -> ReasoningSetting | None:
    """The run.json ``reasoning`` block resolved (None: no reasoning strip). ``{"end": "tokenizer"}`` reads
    the pair from ``tokenizer`` (:func:`tokenizer_setting`; RuntimeError naming ``where`` when it has none)."""
    if value is None:
        return None
    if "parser" in value:
        start, end, forced, tool_start = PARSERS[value["parser"]]
        return ReasoningSetting(end, start, forced, tool_start)
    if value["end"] == TOKENIZER:
        if tokenizer is None:
            raise ReasoningUnresolved(f"{where}: setting reasoning.end='tokenizer' needs the snapshot's tokenizer")
        start, end = tokenizer_pair(tokenizer, where)
        return ReasoningSetting(end, value.get("start", start), bool(value.get("always", False)))
    return ReasoningSetting(value["end"], value.get("start"), bool(value.get("always", False)))


def tokenizer_pair(tokenizer: Any, where: str = "") -> tuple[str, str]:
    """The first of :data:`KNOWN_PAIRS` whose both tags are in the tokenizer's vocabulary;
    :class:`ReasoningUnresolved` when none is, or when its end tag is a special token (decoding would drop it: every answer lost)."""
    vocab = set(tokenizer.get_vocab())
    for start, end in KNOWN_PAIRS:
        if start in vocab and end in vocab:
            if end in set(getattr(tokenizer, "all_special_tokens", ()) or ()):
                raise ReasoningUnresolved(f"{where}: setting reasoning.end='tokenizer': the tokenizer's end {end!r} is "
                                          "a special token; engines decode with skip_special_tokens, so it never "
                                          "reaches the text; name another delimiter in run.json")
            return start, end
    known = ", ".join(end for _, end in KNOWN_PAIRS)
    raise ReasoningUnresolved(f"{where}: setting reasoning.end='tokenizer', but the tokenizer has none of the known "
                              f"pairs (ends {known}); name the delimiter in run.json instead")
