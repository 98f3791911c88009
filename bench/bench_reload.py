"""GB/s of the hf engine's in-place reload vs a plain read of the same bytes.

A snapshot of a reference-architecture model (Llama; size from ``--hidden``/``--layers``, float32) is
written to ``--dir`` (default /dev/shm: the page cache, as a just-exported or recently read snapshot
is), then, best of ``--repeats`` each, in the same run:

* ``plain read, 16 MiB buffer``: every shard file read into one reusable, cache-hot buffer
  (``readinto``, 16 MiB chunks) — the file system's read speed; on ``cuda`` plus one host-to-device
  copy of each chunk;
* ``plain read into resident memory``: the same bytes read into an already allocated and touched
  buffer of the snapshot's size (on ``cuda``: a device buffer, through a 16 MiB pinned chunk) — what
  any reload into resident weights has to pay at least (the destination is DRAM, not cache). The ratio
  is reported against this one;
* ``reload (straight into parameters)``: ``HFEngine.load`` of the snapshot as a new version into an engine
  that holds the same architecture — header index, then each tensor's bytes ``readinto`` its parameter
  (what the engine does); the first such reload after a fresh build is reported separately (it pays
  the page faults of the freshly built model's memory);
* ``reload via a state dict``: the previous implementation, ``load_file`` of every shard into a state
  dict, then ``load_state_dict`` — one extra copy of the model in memory;
* ``from_pretrained``: a fresh model build from the same snapshot, for reference.

``--device cuda`` runs the reloads on the GPU (skipped with a message where there is none).

    .venv/bin/python bench/bench_reload.py [--hidden 1024] [--layers 8] [--repeats 3] [--device cpu] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from ckpteval.jobs.eval.engines.hf.engine import HFEngine
from ckpteval.jobs.eval.engines.hf.weights import complete_tied, read_state_dict, weight_files
from ckpteval.jobs.reference.model import ModelConfig, build_model, save_base_model_dir

CHUNK = 16 << 20


def best(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def plain_read(files: list[Path], device: torch.device) -> None:
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    staging = torch.empty(CHUNK, dtype=torch.uint8, device=device) if device.type == "cuda" else None
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(view):
                if staging is not None:
                    staging[:n].copy_(torch.frombuffer(buf, dtype=torch.uint8, count=n))
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def read_into_resident(files: list[Path], dest: torch.Tensor, device: torch.device) -> None:
    """Read ``files`` back to back into ``dest`` (resident, touched); via pinned chunks on CUDA."""
    offset = 0
    if device.type == "cpu":
        view = memoryview(dest.numpy())
        for path in files:
            with open(path, "rb", buffering=0) as f:
                while n := f.readinto(view[offset:]):
                    offset += n
        return
    chunk = torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True)
    view = memoryview(chunk.numpy())
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(view):
                dest[offset : offset + n].copy_(chunk[:n])
                offset += n
    torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dir", type=Path, default=Path("/dev/shm") if Path("/dev/shm").is_dir() else None)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_reload: --device cuda skipped: no GPU visible to torch")
        out: dict[str, Any] = {"skipped": "no GPU"}
        if args.json:
            args.json.write_text(json.dumps(out))
        return out

    print(f"load average {os.getloadavg()}, {os.cpu_count()} cpus, torch threads {torch.get_num_threads()}")
    cfg = ModelConfig(hidden_size=args.hidden, num_layers=args.layers, num_heads=16, num_kv_heads=16,
                      intermediate_size=4 * args.hidden, tie_word_embeddings=False)
    with tempfile.TemporaryDirectory(prefix="ckpteval-reload-", dir=args.dir) as tmp:
        a = save_base_model_dir(Path(tmp) / "a", cfg, model=build_model(cfg, seed=0))
        b = save_base_model_dir(Path(tmp) / "b", cfg, model=build_model(cfg, seed=1))
        files = weight_files(b)
        nbytes = sum(p.stat().st_size for p in files)
        engine = HFEngine(device=str(device), dtype="float32")
        engine.load(str(a), "a")
        plain_read(files, device)  # warm the page cache for every contender alike
        resident = torch.ones(nbytes, dtype=torch.uint8, device=device)  # allocated and touched
        versions = iter(range(10**6))

        def reload_in_place() -> None:
            engine.load(str(b), str(next(versions)))
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        # The first write into a freshly built model's parameters pays page faults (transformers maps the
        # snapshot's pages; writing makes them private): reported on its own, then excluded.
        first_reload = best(reload_in_place, 1)

        def reload_via_state_dict() -> None:
            model = engine.model
            state = complete_tied(model, read_state_dict(b, str(device)))
            with torch.no_grad():
                model.load_state_dict(state, strict=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        def fresh_build() -> None:
            AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32, local_files_only=True).to(device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        seconds = {
            "plain read, 16 MiB buffer": best(lambda: plain_read(files, device), args.repeats),
            "plain read into resident memory": best(lambda: read_into_resident(files, resident, device),
                                                    args.repeats),
            "reload (straight into parameters)": best(reload_in_place, args.repeats),
            "reload via a state dict": best(reload_via_state_dict, args.repeats),
            "from_pretrained": best(fresh_build, args.repeats),
            "first reload after the build (page faults)": first_reload,
        }
        engine.close()
    gbps = {k: nbytes / s / 1e9 for k, s in seconds.items()}
    for k in seconds:
        print(f"{k:>36}: {seconds[k]:.3f} s = {gbps[k]:.2f} GB/s")
    ratio = gbps["reload (straight into parameters)"] / gbps["plain read into resident memory"]
    print(f"   ratio: reload / plain read into resident memory = {ratio:.2f}x ({nbytes / 1e9:.2f} GB, {device}, best of {args.repeats})")
    out = {"device": str(device), "bytes": nbytes, "repeats": args.repeats, "hidden": args.hidden,
           "layers": args.layers, "torch_threads": torch.get_num_threads(), "seconds": seconds, "gb_per_s": gbps,
           "ratio_reload_plain": ratio}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
