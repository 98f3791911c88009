"""Generate the example environment sets shipped in this directory (nothing is downloaded).

    python examples/envs/generate.py          # rewrites the .jsonl files next to this script

Deterministic (fixed seeds): running it again reproduces the committed files byte for byte
(``tests/test_envs.py`` checks that). The rows are read by the registered environments of
:mod:`ckpteval.jobs.eval.kinds.env.examples`:

* ``arithmetic.jsonl`` — ``{"expression", "answer"}`` for ``"env": "arithmetic"`` (a calculator tool);
* ``guess.jsonl`` — ``{"target", "low", "high"}`` for ``"env": "guess"`` (higher/lower feedback).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from ckpteval.jobs.eval.kinds.env.examples import arithmetic_rows, guess_rows  # noqa: E402

N = 16


def main() -> None:
    for name, rows in (("arithmetic", arithmetic_rows(N, seed=7)), ("guess", guess_rows(N, seed=11))):
        (HERE / f"{name}.jsonl").write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))


if __name__ == "__main__":
    main()
