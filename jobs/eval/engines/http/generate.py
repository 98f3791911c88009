"""The ``/generate`` wire format of :class:`~ckpteval.jobs.eval.engines.http.engine.HTTPEngine`: request sampling, reply parsing.

Owns what one request body says and what one reply item means, against sglang 0.5.23's source (file
names inside the sglang wheel); sending, retrying and timing out are the engine's and
:mod:`~ckpteval.jobs.eval.engines.http.limits`'s.

Promises:

- :func:`request_sampling` sends only keys sglang knows (0.5.22+ rejects unknown ones), ``top_k`` 0 as
  sglang's -1, and per-prompt ``seeds`` as a list of one dict per prompt carrying ``sampling_seed``
  (``srt/managers/io_struct.py`` ``_normalize_sampling_params``); :func:`check_seeds` refuses seeds
  outside sglang's ``sampling_seed`` range with ``ValueError``.
- **Aborts are never generations**: :func:`parse_generation` returns an item whose
  ``finish_reason.type`` is ``"abort"`` as a :class:`Sample` with its abort message, never as text to score.
- **Versions per sample** (:func:`sample_version`): a sample's ``meta_info.weight_versions`` spans (sglang
  >= 0.5.19, ``srt/utils/weight_versions.py``) when present: one version if every span has it, else
  the span versions joined by ``|`` (``"3|4"``), which equals no pin and no step, so a sample that
  spans a weight update fails the pin check and counts as mixed. Without spans, ``weight_version``.

Limits: a malformed item raises :class:`~ckpteval.jobs.eval.engines.base.EngineError` (the engine's
fault, a restart); sampling values themselves are validated by the server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckpteval.coord.run.identity import MIXED_SEP
from ckpteval.jobs.eval.engines.base import EngineError, Generation, SamplingParams

FINISH_TYPES = ("stop", "length", "abort")


def request_sampling(params: SamplingParams, seeds: list[int] | None) -> dict[str, Any] | list[dict[str, Any]]:
    """sglang ``sampling_params``: one dict for the batch (``sampling_seed`` when ``params.seed`` is set), or one
    per prompt carrying its seed (sampled decoding only). Ints go as JSON ints; ``top_k`` 0 (our "off") as -1:
    sglang answers ``top_k: 0`` with a 400 (``srt/sampling/sampling_params.py`` ``verify``)."""
    body: dict[str, Any] = {
        "max_new_tokens": int(params.max_new_tokens),
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": int(params.top_k) if params.top_k > 0 else -1,
    }
    if params.seed is not None:
        body["sampling_seed"] = int(params.seed)
    if seeds is None or params.temperature == 0:
        return body
    return [body | {"sampling_seed": int(s)} for s in seeds]


def sample_version(meta: dict[str, Any]) -> str | None:
    """The version that produced a sample (the module docstring); :class:`EngineError` for malformed spans."""
    spans = meta.get("weight_versions")
    if spans is None:
        version = meta.get("weight_version")
        return None if version is None else str(version)
    if not isinstance(spans, list) or not spans:
        raise EngineError(f"malformed meta_info.weight_versions {str(spans)[:200]}")
    versions = []
    for span in spans:
        if not isinstance(span, dict) or span.get("version") is None:
            raise EngineError(f"malformed meta_info.weight_versions span {str(span)[:200]}")
        versions.append(str(span["version"]))
    return versions[0] if len(set(versions)) == 1 else MIXED_SEP.join(versions)


@dataclass(frozen=True)
class Sample:
    """One parsed ``/generate`` result: a generation, or why the server aborted it."""

    generation: Generation
    abort_message: str | None = None


def parse_generation(item: Any) -> Sample:
    """One ``/generate`` result -> :class:`Sample`; :class:`EngineError` if malformed. An abort may lack
    ``prompt_tokens`` and carries partial text (``tokenizer_manager.py`` ``_handle_abort_req``): never scored."""
    try:
        meta = item["meta_info"]
        finish = meta.get("finish_reason")
    except (KeyError, TypeError, AttributeError) as e:
        raise EngineError(f"malformed /generate result {str(item)[:200]}: missing {e}") from e
    kind = finish.get("type") if isinstance(finish, dict) else None
    if kind not in FINISH_TYPES:
        raise EngineError(f"/generate result without a finish_reason type in {FINISH_TYPES}: {str(item)[:200]}")
    version = sample_version(meta)
    if kind == "abort":
        message = str(finish.get("message") or "Aborted")
        return Sample(Generation(text="", weight_version=version, n_tokens=0), message)
    text, n_tokens = item.get("text"), meta.get("completion_tokens")
    if not isinstance(text, str) or not isinstance(n_tokens, int):
        raise EngineError(f"malformed /generate result {str(item)[:200]}")
    prompt = meta.get("prompt_tokens")
    return Sample(Generation(text=text, weight_version=version, n_tokens=n_tokens,
                             prompt_tokens=prompt if isinstance(prompt, int) else None, finish_reason=kind))  # stop | length


def check_seeds(seeds: list[int] | None, n: int) -> None:
    if seeds is None:
        return
    if not isinstance(seeds, list) or len(seeds) != n:
        raise ValueError(f"seeds must be a list of one int per prompt ({n})")
    if not all(isinstance(s, int) and not isinstance(s, bool) and -(2**63) <= s < 2**63 for s in seeds):
        raise ValueError("seeds must be ints in sglang's sampling_seed range [-2**63, 2**63-1]")
