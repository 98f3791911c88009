"""Attestation seconds vs the load they follow (#19), same run.

Two snapshots of a reference-architecture model (Llama; ``--hidden``/``--layers``, ``--dtype``) are
exported with :func:`ckpteval.jobs.trainer.export.hf_files.write_hf_files` and published (markers with
per-tensor digests) under ``--dir`` (default /dev/shm). Then, best of ``--repeats`` each:

* ``first load (from_pretrained)``: a fresh :class:`HFEngine` builds the model from snapshot A;
* ``reload in place``: the engine loads B, then A, as new versions (what a fleet worker does per step);
* ``attest (tensor digests, xxh3)``: :func:`ckpteval.jobs.eval.proof.attest.attest` of the engine against the marker —
  every tensor cast to the snapshot dtype and XXH3-64'd, compared with the marker (what the worker adds
  after each load);
* ``engine digests (crc32)``: the engine's digests of every tensor with CRC-32 instead (what every
  attestation cost before XXH3; markers without ``xxh3`` are no longer read);
* ``stand-in /weights_checker checksum``: the sglang-style per-tensor SHA-256 the stand-in server
  computes (:meth:`ckpteval.jobs.reference.serve.engine.EngineService.check_weights`, no HTTP), for scale.

Printed: seconds (best of ``--repeats``; reload and the two attestations interleaved round by round,
their medians too) and the ratio of each attestation to the in-place reload (goal: under 0.10).
``--device cuda`` runs the engine on the GPU. ``--smoke``: a tiny model, one repeat (a check that it
runs, not a measurement). Numbers are only comparable on a quiet machine: the load average is printed.

    .venv/bin/python bench/bench_attest.py [--hidden 1024] [--layers 8] [--dtype float32] [--repeats 3] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.snapshots.snapshot import publish_snapshot, read_marker
from ckpteval.jobs.eval.engines.hf.engine import HFEngine
from ckpteval.jobs.eval.proof.attest import attest
from ckpteval.jobs.reference.model import ModelConfig, build_model, save_base_model_dir
from ckpteval.jobs.reference.serve.engine import EngineService
from ckpteval.jobs.trainer.export.hf_files import write_hf_files

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def best(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def publish(root: Path, base: Path, cfg: ModelConfig, step: int, dtype: torch.dtype) -> Path:
    sd = {k: v.to(dtype).contiguous() for k, v in build_model(cfg, seed=step).state_dict().items()}
    return publish_snapshot(root, step, lambda d: write_hf_files(d, sd, base))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dir", type=Path, default=Path("/dev/shm"))
    ap.add_argument("--smoke", action="store_true", help="tiny model, one repeat")
    ap.add_argument("--json", type=Path, help="also write the results here as JSON")
    args = ap.parse_args(argv)
    if args.smoke:
        args.hidden, args.layers, args.repeats = 128, 2, 1
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device here: skipped")
        return 0
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}  cpus: {os.cpu_count()}")
    cfg = ModelConfig(hidden_size=args.hidden, num_layers=args.layers, num_heads=16, num_kv_heads=16,
                      intermediate_size=4 * args.hidden, tie_word_embeddings=False)
    dtype = DTYPES[args.dtype]
    with tempfile.TemporaryDirectory(prefix="ckpteval-attest-", dir=args.dir) as tmp:
        root, run = Path(tmp) / "snapshots", RunDir.create(Path(tmp) / "run")
        base = save_base_model_dir(Path(tmp) / "base", cfg)
        a, b = publish(root, base, cfg, 1, dtype), publish(root, base, cfg, 2, dtype)
        marker = read_marker(a)
        nbytes = sum(f["bytes"] for n, f in marker.files.items() if n.endswith(".safetensors"))
        engines: list[HFEngine] = []

        def first_load() -> None:
            engine = HFEngine(device=args.device)
            engine.load(str(a), "a")
            engines.append(engine)

        seconds = {"first load (from_pretrained)": best(first_load, args.repeats)}
        engine = engines[-1]
        for e in engines[:-1]:
            e.close()
        versions = iter(range(10**6))

        def reload() -> None:
            engine.load(str(b), f"b{next(versions)}")
            engine.load(str(a), f"a{next(versions)}")

        dtypes = {name: d["dtype"] for name, d in (marker.tensors or {}).items()}
        contenders = {"reload in place": reload, "attest (tensor digests, xxh3)": lambda: attest(engine, a, marker, run),
                      "engine digests (crc32)": lambda: engine.weight_digests(dtypes, "crc32")}
        rounds: dict[str, list[float]] = {name: [] for name in contenders}
        for _ in range(args.repeats):  # interleaved: a change in the machine's load hits every contender alike
            for name, fn in contenders.items():
                rounds[name].append(best(fn, 1) / (2 if name == "reload in place" else 1))
        seconds.update({name: min(times) for name, times in rounds.items()})
        medians = {name: statistics.median(times) for name, times in rounds.items()}
        service = EngineService(engine, str(a))
        seconds["stand-in /weights_checker checksum"] = best(lambda: service.check_weights("checksum"), args.repeats)
        engine.close()
    print(f"model: hidden {args.hidden}, {args.layers} layers, {args.dtype}, {nbytes / 1e6:.0f} MB of weights, "
          f"device {args.device}")
    ratios = {}
    for name, s in seconds.items():
        ratios[name] = s / seconds["reload in place"]
        median = (f"  (median {medians[name] * 1e3:.1f} ms, ratio {medians[name] / medians['reload in place']:.3f})"
                  if name in medians else "")
        print(f"{name:<40} {s * 1e3:9.1f} ms  ratio to the in-place reload {ratios[name]:.3f}{median}")
    if args.json:
        args.json.write_text(json.dumps({"load_average": os.getloadavg(), "bytes": nbytes, "seconds": seconds, "medians": medians,
                                         "ratio_to_reload": ratios, "args": vars(args)}, default=str, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
