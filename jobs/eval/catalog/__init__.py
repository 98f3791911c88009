"""The benchmark catalog: vendored eval sets with an upstream harness's template, grader and settings
(``{"catalog": "math500"}`` in an eval config), and published reference scores checked at step 0.

docs/USER_GUIDE.md "The benchmark catalog"; each set's data, licence, source and followed harness are in
``data/<set>/``."""

from ckpteval.coord.faces import face

__all__, __getattr__ = face(__name__, {
    "CatalogSet": "sets", "load_set": "sets", "set_names": "sets", "TEMPLATES": "sets",
    "expand_entry": "expand", "rendered_rows": "expand", "check_catalog_entry": "expand",
})
