"""A catalog entry of an eval config made whole (:func:`expand_entry`), its rows rendered with its template
(:func:`rendered_rows`), and its check at worker start. docs/USER_GUIDE.md "The benchmark catalog"."""

from __future__ import annotations

import json
from typing import Any

from ckpteval.coord.atomic import read_jsonl_file
from ckpteval.coord.entries.catalog import CatalogEntry
from ckpteval.jobs.eval.catalog.sets import load_set, template_of

OWN_KEYS = ("path", "kind")  # a catalog entry's data and kind are the catalog's


def expand_entry(ds: dict[str, Any], where: str) -> dict[str, Any]:
    """``{"catalog": NAME, ...overrides}`` as a full ``catalog`` entry of run.json: the set's default settings,
    its template's system turn, and the vendored rows as ``path``, under the user's own keys."""
    name = ds.get("catalog")
    if not isinstance(name, str):
        raise ValueError(f"{where}.catalog: must name a catalog set, got {name!r}")
    try:
        catalog_set = load_set(name)
        given = [k for k in OWN_KEYS if k in ds and not (k == "kind" and ds[k] == "catalog")]
        if given:
            raise ValueError(f"cannot set {', '.join(given)} (a catalog entry's data and kind are the catalog's)")
        out: dict[str, Any] = {"kind": "catalog", "name": name, **json.loads(json.dumps(catalog_set.entry)), **ds}
        template = template_of(catalog_set, out["template"])
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if isinstance(ds.get("scorer_options"), dict):  # an override adds to the set's scorer options
        out["scorer_options"] = {**catalog_set.entry.get("scorer_options", {}), **ds["scorer_options"]}
    out.setdefault("system_prompt", template.system_prompt)
    out["path"] = str(catalog_set.rows_path)
    return out


def rendered_rows(spec: CatalogEntry) -> bytes:
    """The set's rows as the run keeps them: each row's user turn from the entry's template (``messages``;
    the row's ``prompt`` is kept for the scorer, e.g. HumanEval's signature before the code)."""
    catalog_set = load_set(spec.catalog)
    template = template_of(catalog_set, spec.template)
    rows = [row for _line, row in read_jsonl_file(catalog_set.rows_path, what="catalog row")]
    if template.user != "{prompt}":
        if spec.prompt_format != "chat":
            raise ValueError(f"dataset {spec.name!r}: template {spec.template!r} writes a user turn, so "
                             f"prompt_format must be 'chat', not {spec.prompt_format!r}")
        rows = [{**row, "messages": [{"role": "user", "content": template.user_turn(row["prompt"])}]} for row in rows]
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()


def check_catalog_entry(cache: Any, spec: CatalogEntry) -> None:
    """At worker start: the set and template exist here, then the generate checks (rows, scorer)."""
    from ckpteval.jobs.eval.kinds.generate.scoring import check_generate

    template_of(load_set(spec.catalog), spec.template)
    check_generate(cache, spec)
