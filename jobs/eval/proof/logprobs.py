"""Teacher-forced log-probabilities, in sglang's ``input_token_logprobs`` layout: what the canary stores at
export and recomputes on an in-process engine (:mod:`ckpteval.jobs.eval.proof.canary`), what
:mod:`ckpteval.jobs.eval.engines.sglang.logprobs` reads from a server, and what ``ckpteval serve`` answers
``return_logprob`` with. Torch is imported when a forward pass runs, never at import time.

Limits: one forward pass over the rows, right-padded: rows that do not fit the device together fail as
one (the canary's probe is a few short rows).
"""

from __future__ import annotations

from typing import Any


def teacher_forced(model: Any, tokenizer: Any, pairs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Token ids, continuation log-probabilities and argmax of each ``(prompt, continuation)`` under
    ``model`` (:func:`token_logprobs`: one forward pass over the rows)."""
    rows = [(list(tokenizer(p + c)["input_ids"]), len(tokenizer(p)["input_ids"])) for p, c in pairs]
    scored = token_logprobs(model, [ids for ids, _ in rows], 1)
    return [probe_result(pair, ids, start, lps, [top[0][1] if top else None for top in tops])
            for pair, (ids, start), (lps, tops) in zip(pairs, rows, scored, strict=True)]


def probe_result(
    pair: tuple[str, str], ids: list[int], start: int, logprobs: list[float | None], argmax: list[int | None]
) -> dict[str, Any]:
    """One probe's record from per-position values in sglang's ``input_token_logprobs`` layout: entry
    ``i`` is about token ``i`` (its log-probability given the tokens before it; the argmax of that
    distribution), entry 0 is None. Kept: the continuation's positions (``start`` on, at least 1)."""
    positions = range(max(start, 1), len(ids))
    return {"prompt": pair[0], "continuation": pair[1], "ids": ids, "start": start,
            "logprobs": [float(logprobs[i]) for i in positions], "argmax": [int(argmax[i]) for i in positions]}


def token_logprobs(
    model: Any, rows: list[list[int]], top_k: int = 0
) -> list[tuple[list[float | None], list[list[tuple[float, int]] | None]]]:
    """Teacher-forced log-probabilities of each row of token ids, in sglang's ``input_token_logprobs``
    layout (entry ``i``: log p(token i | tokens before it), entry 0 None) and its ``top_k`` most likely
    ``(logprob, id)`` per position (``input_top_logprobs``; entry 0 None): one forward pass over the rows
    right-padded (causal attention: a row's positions never see its padding), log-softmax of the raw
    logits in float32. The canary and ``ckpteval serve``'s ``return_logprob`` both use it."""
    import torch  # here, not at import time: a worker with an fn backend never loads torch (bench_fleet.py)

    if not rows:
        return []
    with torch.no_grad():
        return _token_logprobs(model, rows, top_k)


def _token_logprobs(model: Any, rows: list[list[int]], top_k: int
                    ) -> list[tuple[list[float | None], list[list[tuple[float, int]] | None]]]:
    import torch

    width = max(len(ids) for ids in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    device = next(model.parameters()).device
    logprobs = torch.log_softmax(model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float(), -1)
    out: list[tuple[list[float | None], list[list[tuple[float, int]] | None]]] = []
    for i, row in enumerate(rows):
        n = len(row)
        picked = logprobs[i, : n - 1].gather(-1, torch.tensor(row[1:], dtype=torch.long, device=device).unsqueeze(-1)).squeeze(-1)
        tops: list[list[tuple[float, int]] | None] = [None]
        if top_k > 0:
            values, indices = logprobs[i, : n - 1].topk(top_k, dim=-1)
            tops += [list(zip(v, x, strict=True)) for v, x in zip(values.tolist(), indices.tolist(), strict=True)]
        out.append(([None, *picked.tolist()], tops))
    return out
