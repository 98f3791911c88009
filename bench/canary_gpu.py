"""Measure the canary's bound for sglang on one GPU (#30): max |Δ log-prob| of sglang vs the trainer's function.

Until this has run on a GPU, the ``sglang`` engine kind has no entry in
:func:`ckpteval.jobs.eval.proof.canary.measured_bounds`, and its canary only flags (never skips). This script
produces the number that entry needs: for an HF model dir it computes the canary a trainer stores
(:func:`ckpteval.jobs.eval.proof.canary.canary_bytes`: transformers, the trainer's dtype, on the GPU) for probe rows,
then asks sglang for the same rows' input-token log-probs (:meth:`HTTPEngine.teacher_forced`, launched
here with ``--dtype`` unless ``--url`` attaches to a running server) and prints the comparison
(:func:`ckpteval.jobs.eval.proof.canary.compare`) per trainer dtype, and a bound (x3 the worst, as for the hf
entries in bench/RESULTS.md "Canary").

    python bench/canary_gpu.py --model /models/Qwen2.5-0.5B [--trainer-dtype float32 bfloat16]
        [--sglang-dtype bfloat16] [--rows 16] [--url http://127.0.0.1:30000] [--extra-args "--tp-size 1"]

Limits: one model, the rows below (arithmetic and short prose); a bound is valid for the GPU
generation, sglang version, attention backend and TP size it was measured on — record them with it.
Against ``ckpteval serve --logprob-offset X`` (``--url``) it runs on CPU and must print X (a smoke test).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

ROWS = [(f"{a}+{b}=", str(a + b)) for a, b in ((12, 34), (7, 8), (250, 125), (99, 1), (31, 47), (5, 600))] + [
    ("The capital of France is", " Paris."), ("Water boils at", " 100 degrees Celsius."),
    ("def add(a, b):\n    return", " a + b"), ("Once upon a time", ", there was a princess."),
    ("The square root of 81 is", " 9."), ("Translate 'chat' to English:", " cat"),
    ("1, 2, 3, 4,", " 5, 6"), ("Q: What color is the sky?\nA:", " Blue."),
    ("The opposite of hot is", " cold."), ("Photosynthesis converts", " light into chemical energy."),
]  # fmt: skip


def trainer_canary(model_dir: str, dtype: str, pairs: list[tuple[str, str]]) -> dict:
    """The canary a trainer holding ``model_dir`` in ``dtype`` would store (on the GPU when there is one)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ckpteval.jobs.eval.proof.canary import canary_bytes

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    try:
        return json.loads(canary_bytes(model, tokenizer, pairs))
    finally:
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="HF model dir (what the trainer exports)")
    parser.add_argument("--trainer-dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--sglang-dtype", default="bfloat16", help="sglang's --dtype when launched here")
    parser.add_argument("--rows", type=int, default=len(ROWS))
    parser.add_argument("--url", help="attach to a running sglang (or ckpteval serve) instead of launching one")
    parser.add_argument("--extra-args", default="", help="more sglang launch flags (one string)")
    args = parser.parse_args(argv)
    pairs = ROWS[: args.rows]
    stored = {dtype: trainer_canary(args.model, dtype, pairs) for dtype in args.trainer_dtype}  # before sglang

    from ckpteval.jobs.eval.engines.http.engine import HTTPEngine
    from ckpteval.jobs.eval.engines.sglang.engine import SGLangEngine
    from ckpteval.jobs.eval.proof.canary import compare

    if args.url:
        engine: HTTPEngine = HTTPEngine(args.url)
    else:
        extra = ["--dtype", args.sglang_dtype, *shlex.split(args.extra_args)]
        engine = SGLangEngine(args.model, weight_version="canary", extra_args=extra)
    try:
        got = engine.teacher_forced(pairs)
        info = engine.server_info()
    finally:
        engine.close()
    out = {"model": args.model, "rows": len(pairs), "sglang": info.get("version"),
           "attention_backend": info.get("attention_backend"), "tp_size": info.get("tp_size"),
           "sglang_dtype": info.get("dtype", args.sglang_dtype), "by_trainer_dtype": {}}
    for dtype, canary in stored.items():
        fidelity = compare(canary, got)
        out["by_trainer_dtype"][dtype] = {"max_abs_logprob_diff": fidelity.max_abs_logprob_diff,
                                          "argmax_agreement": fidelity.argmax_agreement, "tokens": fidelity.tokens,
                                          "suggested_bound": 3 * fidelity.max_abs_logprob_diff}
    print(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
