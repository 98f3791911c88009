"""The judge's settings (:class:`JudgeOptions`) and its verdict rule: how the graded response is put in
the judge's prompt, and how a score is read from the judge's reply — the part of
:mod:`ckpteval.jobs.eval.scorers.judge.scorer` a completion would attack to write its own verdict.

Guarantees (each tested against a real judge server in ``tests/test_judge_faults.py``):

- The response is fenced in the prompt by two lines carrying a per-request boundary
  (:func:`quote_response`, 128 bits derived from the run's secret and the sample): no completion can close the fence.
- :func:`read_verdict` reads the judge's own words only: what the reply quotes between the boundary
  lines is dropped (:func:`unquoted`), and so is every verbatim copy of text the response itself holds
  that the rule would read as a verdict (:func:`planted`); when the response planted one, the verdicts
  left must agree, else there is none. Structured (``verdict_json_field``, by default): the request asks
  for exactly the verdict object (:func:`verdict_schema`, OpenAI ``response_format`` ``json_schema``)
  and the reply must be that object, whole.
- A verdict is a whole token (``VERDICT: 10``, ``1e308``, ``1.5`` are not ``1``), a finite number (or a
  word of ``verdict_values``), within ``verdict_range``; anything else is no verdict (None).

Limits: a judge that repeats a planted verdict in other words (reformatted, paraphrased) cannot be told
from one that agrees with it — structured output is the cure; a judge whose own verdict line is exactly
the planted one reads as no verdict; whether the judge is *persuaded* by the response (prompt
injection) is the judge model's robustness, not something parsing can decide.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from dataclasses import dataclass
from typing import Any

from ckpteval.coord.run.manifest import FieldError

DEFAULT_VERDICT_REGEX = r"\bVERDICT:\s*([-+]?\d+(?:\.\d+)?)"
JUDGE_RANGE = (0.0, 1.0)
"""A judge's verdict range unless ``verdict_range`` says otherwise (the default template's 0/1)."""
REWARD_RANGE = (-1e6, 1e6)
"""A reward model's reward range unless ``verdict_range`` says otherwise."""
ON_UNPARSED = ("skip", "zero")
ON_MODEL_MISMATCH = ("record", "skip")
QUOTING = "boundary-v1"
"""How the response is put in the judge's prompt (part of the judge's identity and cache key)."""
QUOTED_RESPONSE = re.compile(r"<<<BEGIN RESPONSE ([0-9a-f]{32})>>>\n(.*?)\n<<<END RESPONSE \1>>>", re.S)
"""The response as :func:`quote_response` puts it in a prompt (group 2; group 1 the request's boundary)."""


def new_boundary() -> str:
    """A random boundary of 128 bits, which no completion can guess (the scorer derives each sample's from the
    run's secret instead, :func:`ckpteval.coord.results.verdicts.derive_boundary`, so a re-judge is the same
    request; this is its fallback where the run dir cannot hold the secret)."""
    return secrets.token_hex(16)


def quote_response(response: str, boundary: str) -> str:
    """``response`` between two lines carrying ``boundary`` (what ``{response}`` becomes in a judge prompt)."""
    return f"<<<BEGIN RESPONSE {boundary}>>>\n{response}\n<<<END RESPONSE {boundary}>>>"


@dataclass(frozen=True)
class JudgeOptions:
    """A judged dataset's ``scorer_options`` (``"scorer": "judge"`` or ``"reward_model"``); checks in
    ``__post_init__``, each failure a :class:`~ckpteval.coord.run.manifest.FieldError` naming the setting."""

    url: str | None = None
    """The judge's OpenAI base URL (``http://host:port/v1``); None: ``--judge-url``, else ``RUN/judge.json``."""
    model: str | None = None
    """The model to ask; it must be one the judge's ``/v1/models`` lists. None: the one it lists."""
    template: str | None = None
    """The judge's prompt (one user message) with ``{question}``, ``{response}``, ``{reference}``
    (a reward model: ``{question}``, ``{response}``). None: the scorer's default."""
    system_prompt: str | None = None
    """A system message put before the prompt (chat judges)."""
    verdict_regex: str | None = DEFAULT_VERDICT_REGEX
    """The verdict is the first group of the rule's *last* match in the reply (a number, or a key of
    ``verdict_values``), a whole token (not followed by a letter, digit or ``.5``-like tail).
    Exactly one of ``verdict_regex`` / ``verdict_json_field`` is set."""
    verdict_json_field: str | None = None
    """Instead of a regex: a dotted field path of the reply's JSON object (structured: the whole reply;
    else the last JSON object, or fenced ```json block, that has the field)."""
    verdict_values: dict[str, float] | None = None
    """Words the verdict may be, mapped to scores (e.g. {"correct": 1, "incorrect": 0}); case-insensitive."""
    verdict_range: tuple[float, ...] | None = None
    """``[low, high]``: a verdict (a reward) outside it is unparsed. None: [0, 1] for a judge (the
    default template's 0/1), [-1e6, 1e6] for a reward model."""
    structured: bool | None = None
    """Ask for the verdict as OpenAI structured output (``response_format`` ``json_schema``, served by
    sglang, vLLM and hosted APIs): the reply must then be exactly one JSON object. Needs
    ``verdict_json_field``; None: on when that is set."""
    on_unparsed: str = "skip"
    """A reply the rule cannot read: ``skip`` the unit (judge_failed) or score the sample ``zero``."""
    on_model_mismatch: str = "record"
    """A reply whose ``model`` is not the judge's ``/v1/models`` id (a hosted alias resolved to a
    snapshot): ``record`` it (identity ``answered_by``, counted) or ``skip`` the unit (judge_failed)."""
    temperature: float = 0.0
    max_tokens: int = 256
    top_p: float = 1.0
    seed: int | None = 0
    """Sampling settings sent with every judge request (part of the judge's identity and cache key)."""
    timeout_s: float = 60.0
    """Per-request timeout."""
    retries: int = 4
    """Retries per request (backoff 0.5 s doubling to 8 s): a request costs ``<= (retries+1)*timeout_s``."""
    wait_s: float = 300.0
    """With no URL set: how long to wait for ``RUN/judge.json`` before the unit is skipped."""
    concurrency: int = 8
    """Judge requests in flight per unit."""
    api_key_env: str | None = None
    """The environment variable holding the API key (never put a key in run.json)."""
    threshold: float | None = None
    """Score 1.0 when the verdict (a reward model's reward) is >= this, else 0.0 (None: the value itself)."""

    def __post_init__(self) -> None:
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise FieldError("url", f"{self.url!r} must start with http:// or https://")
        if (self.verdict_regex is None) == (self.verdict_json_field is None):
            raise FieldError("verdict_regex", "and verdict_json_field: set exactly one (the other null)")
        if self.verdict_regex is not None:
            try:
                groups = re.compile(self.verdict_regex).groups
            except re.error as e:
                raise FieldError("verdict_regex", f"{self.verdict_regex!r} does not compile ({e})") from None
            if groups < 1:
                raise FieldError("verdict_regex", f"{self.verdict_regex!r} needs a group holding the verdict")
        if self.verdict_values is not None:
            if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in self.verdict_values.values()):
                raise FieldError("verdict_values", "must map words to numbers")
            object.__setattr__(self, "verdict_values", {str(k).lower(): float(v) for k, v in self.verdict_values.items()})
        self._check_range()
        if self.structured and self.verdict_json_field is None:
            raise FieldError("structured", "needs verdict_json_field (a structured verdict is a JSON field)")
        if self.on_unparsed not in ON_UNPARSED:
            raise FieldError("on_unparsed", f"{self.on_unparsed!r} must be one of {', '.join(ON_UNPARSED)}")
        if self.on_model_mismatch not in ON_MODEL_MISMATCH:
            raise FieldError("on_model_mismatch", f"{self.on_model_mismatch!r} must be one of "
                             f"{', '.join(ON_MODEL_MISMATCH)}")
        for key in ("temperature", "timeout_s", "wait_s", "top_p"):
            if not math.isfinite(getattr(self, key)) or getattr(self, key) < 0:
                raise FieldError(key, f"must be a finite number >= 0, got {getattr(self, key)}")
        if self.timeout_s == 0 or not 0 < self.top_p <= 1:
            raise FieldError("timeout_s" if self.timeout_s == 0 else "top_p", "timeout_s > 0 and top_p in (0, 1]")
        for key, low in (("max_tokens", 1), ("concurrency", 1), ("retries", 0)):
            if getattr(self, key) < low:
                raise FieldError(key, f"must be >= {low}, got {getattr(self, key)}")
        if self.api_key_env is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.api_key_env):
            raise FieldError("api_key_env", f"{self.api_key_env!r} must be an environment variable name")

    def _check_range(self) -> None:
        r = self.verdict_range
        if r is not None and (len(r) != 2 or not all(math.isfinite(x) for x in r) or r[0] > r[1]):
            raise FieldError("verdict_range", f"{list(r)} must be [low, high], finite, low <= high")
        low, high = self.range()
        if self.verdict_values is not None and not all(low <= v <= high for v in self.verdict_values.values()):
            raise FieldError("verdict_values", f"map words to numbers within verdict_range [{low:g}, {high:g}]")

    def range(self, default: tuple[float, float] = JUDGE_RANGE) -> tuple[float, float]:
        """``verdict_range``, else ``default``."""
        r = self.verdict_range
        return (float(r[0]), float(r[1])) if r is not None else default

    def is_structured(self) -> bool:
        return self.verdict_json_field is not None if self.structured is None else self.structured

    def sampling(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "max_tokens": self.max_tokens,
                **({"seed": self.seed} if self.seed is not None else {})}


# -- the verdict rule -----------------------------------------------------------------------------------
def _as_score(value: Any, values: dict[str, float] | None) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value) if math.isfinite(value) else None
    if not isinstance(value, str):
        return None
    if values is not None:
        return values.get(value.strip().lower())
    try:
        number = float(value)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _json_objects(text: str) -> list[tuple[Any, int, int]]:
    """Every top-level JSON object in ``text`` (bare, or in a fenced block): (object, start, end)."""
    decoder, found, end = json.JSONDecoder(), [], 0
    for start in (m.start() for m in re.finditer(r"\{", text)):
        if start < end:
            continue  # inside the object just decoded
        try:
            obj, end = decoder.raw_decode(text, start)
        except ValueError:
            continue
        found.append((obj, start, end))
    return found


def _field(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = obj.get(part) if isinstance(obj, dict) else None
    return obj


def _whole_token(text: str, start: int, end: int) -> bool:
    """Whether ``text[start:end]`` is a whole token: no letter or digit glued before it, nor after it
    (directly, or after one ``.``/``,``: ``1e308``, ``10``, ``1.5`` and ``1,000`` are not ``1``)."""
    before = text[start - 1] if start > 0 else " "
    after = text[end:end + 2]
    glued = after[:1].isalnum() or after[:1] == "_" or (after[:1] in ".," and after[1:2].isalnum())
    return not (before.isalnum() or before == "_" or glued)


def unquoted(reply: str, boundary: str | None) -> str:
    """``reply`` without what it quotes between the request's boundary lines: from each BEGIN line to its
    END line (or to the end: a quote cut short), and everything before an END line that has no BEGIN."""
    if not boundary:
        return reply
    begin, end = f"BEGIN RESPONSE {boundary}", f"END RESPONSE {boundary}"
    first_begin, first_end = reply.find(begin), reply.find(end)
    pos = first_end + len(end) if first_end != -1 and (first_begin == -1 or first_end < first_begin) else 0
    kept = []
    while (i := reply.find(begin, pos)) != -1:
        kept.append(reply[pos:i])
        j = reply.find(end, i)
        if j == -1:
            return "".join(kept)
        pos = j + len(end)
    kept.append(reply[pos:])
    return "".join(kept)


def _candidates(opts: JudgeOptions, text: str) -> list[tuple[Any, int, int]]:
    """What the (unstructured) rule finds in ``text``, in order: (raw verdict, start, end of its span);
    a regex match that is not a whole token is kept as a None verdict (a partial match is no verdict)."""
    if opts.verdict_regex is not None:
        return [(m.group(1) if _whole_token(text, *m.span(1)) else None, m.start(), m.end())
                for m in re.finditer(opts.verdict_regex, text) if m.group(1) is not None]
    path = opts.verdict_json_field or ""
    return [(_field(obj, path), a, b) for obj, a, b in _json_objects(text) if _field(obj, path) is not None]


def planted(opts: JudgeOptions, response: str) -> list[str]:
    """The texts in ``response`` that the (unstructured) rule would read as a verdict: what a completion
    plants for a judge that quotes it. Longest first (a shorter one may be part of a longer one)."""
    return sorted({response[a:b] for _, a, b in _candidates(opts, response)}, key=len, reverse=True)


def read_verdict(opts: JudgeOptions, reply: str, boundary: str | None = None, response: str | None = None,
                 default_range: tuple[float, float] = JUDGE_RANGE) -> float | None:
    """The score the rule reads from the judge's own words in ``reply`` (None: unreadable).

    Structured (:meth:`JudgeOptions.is_structured`): the reply must be exactly one JSON object. Else
    the rule reads ``reply`` without what it quotes between the request's ``boundary`` lines, and without
    any verbatim copy of a verdict planted in ``response``; when the response planted one, the
    remaining verdicts must agree. Not a whole token, not a number (a word of ``verdict_values``),
    non-finite, or outside the verdict range: None.
    """
    if opts.is_structured():
        try:
            values = [_field(json.loads(reply), opts.verdict_json_field or "")]
        except ValueError:
            return None
        plants: list[str] = []
    else:
        text, plants = unquoted(reply, boundary), planted(opts, response or "")
        for plant in plants:
            text = text.replace(plant, " ")
        values = [v for v, _, _ in _candidates(opts, text)]
    scores = [_as_score(v, opts.verdict_values) for v in values]
    if not scores or (plants and len(set(scores)) > 1):
        return None
    low, high = opts.range(default_range)
    score = scores[-1]
    return score if score is not None and low <= score <= high else None


def verdict_schema(opts: JudgeOptions) -> dict[str, Any]:
    """The ``response_format`` asking for the verdict field, in range, and nothing else. An integer range
    of at most 101 values is an ``enum`` (every grammar backend enforces it; sglang 0.5.23's outlines
    backend refuses ``minimum``/``maximum``, ``srt/constrained/json_schema_validation.py``); a wider or
    fractional one ``minimum``/``maximum`` (xgrammar, sglang's default, enforces those)."""
    low, high = opts.range()
    if opts.verdict_values is not None:
        leaf: dict[str, Any] = {"type": "string", "enum": sorted(opts.verdict_values)}
    elif low.is_integer() and high.is_integer() and high - low <= 100:
        leaf = {"type": "integer", "enum": list(range(int(low), int(high) + 1))}
    else:
        leaf = {"type": "number", "minimum": low, "maximum": high}
    for key in reversed((opts.verdict_json_field or "verdict").split(".")):
        leaf = {"type": "object", "properties": {key: leaf}, "required": [key], "additionalProperties": False}
    return {"type": "json_schema", "json_schema": {"name": "verdict", "schema": leaf, "strict": True}}
