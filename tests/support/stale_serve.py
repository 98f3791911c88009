"""``ckpteval serve`` with a deliberately buggy engine (``python -m tests.support.stale_serve serve ARGS``).

Everything is the real stand-in (:mod:`ckpteval.jobs.reference.serve.main`) except its engine's load: every
load after the first keeps layer 0's attention weights of the weights held before (:class:`StaleLayerEngine`),
the deterministic stale-layer bug attestation must not take for the truth. A fresh launch loads correctly
(nothing was held before), an in-place reload does not.
"""

from __future__ import annotations

import sys

import torch

from ckpteval.jobs.eval.engines.hf import engine as hf


class StaleLayerEngine(hf.HFEngine):
    """A buggy engine: every load keeps layer 0's attention weights of the weights it held before."""

    def load(self, snapshot_dir: str, weight_version: str) -> None:
        old = None if self.model is None else {
            n: p.detach().clone() for n, p in self.model.named_parameters() if n.startswith("model.layers.0.self_attn")
        }
        super().load(snapshot_dir, weight_version)
        if old:
            params = dict(self.model.named_parameters())
            with torch.no_grad():
                for name, value in old.items():
                    params[name].copy_(value)


def main(argv: list[str]) -> int:
    from ckpteval.jobs.reference.serve import main as serve

    if argv[:1] != ["serve"]:
        raise ValueError("usage: python -m tests.support.stale_serve serve ARGS (the arguments of ckpteval serve)")
    hf.HFEngine = StaleLayerEngine  # type: ignore[misc]  # serve's main builds the engine it finds here
    return serve.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
