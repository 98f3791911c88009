"""Benchmark: ``write_hf_files`` (write + crc32 of every file) vs ``cp`` of the same bytes.

Builds a ~500 MB bf16 state dict shaped like a small LLM, exports it into a fresh directory under
``--root`` (default /dev/shm) ``--reps`` times and copies the resulting shard with ``cp`` just as
often, all in the same run, and prints the best GB/s of each and their ratio. Alternatives the
exporter was chosen over are timed too: ``safetensors.torch.save`` to bytes followed by a chunked
write + crc32, and ``save_file`` followed by a re-read for the crc32.

Then the trainer's view: an :class:`~ckpteval.jobs.trainer.export.async_export.AsyncExporter` exports the same state
dict ``--reps`` times into ``--root``; per export it reports what the caller was blocked for (free-space
check + host copy: ``eval/export_blocked_seconds``) against the whole export up to the published
marker (``eval/export_time_seconds``).

Then the cost of the per-tensor digests the marker records (#19), against the write itself, same run:
the same shard written with no checksum at all (the write), with the file CRC-32 only (the writer
before per-tensor digests) and by the exporter (file CRC-32 combined from per-tensor CRC-32s);
printed as ratios to the write.

Usage: ``.venv/bin/python bench/bench_export.py [--mb 500] [--reps 3] [--root /dev/shm] [--json OUT]``;
``--smoke``: 100 MB, one rep, digests only (seconds; a check that the pipeline runs, not a measurement).
Numbers are only comparable on a quiet machine: the load average is printed first.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import safetensors.torch as st
import torch

from ckpteval.jobs.trainer.export.async_export import AsyncExporter
from ckpteval.jobs.trainer.export.hf_files import write_hf_files
from ckpteval.jobs.trainer.export.safetensors_io import (
    CHUNK_BYTES,
    _tagged_chunks,
    write_chunks,
    write_safetensors,
)

HIDDEN = 4096
EXPORTER = "write_hf_files (zero-copy write + threaded crc32)"
CP = "cp of the same bytes (no checksum)"


def make_state_dict(total_mb: int) -> dict[str, torch.Tensor]:
    """bf16: one embedding of ~half the bytes, square matrices for the rest, plus norm vectors."""
    gen = torch.Generator().manual_seed(0)
    target = total_mb * 1_000_000
    vocab = max(1, target // 2 // (HIDDEN * 2))
    sd = {"model.embed_tokens.weight": torch.randn(vocab, HIDDEN, generator=gen, dtype=torch.bfloat16)}
    used = vocab * HIDDEN * 2
    i = 0
    while used + HIDDEN * HIDDEN * 2 <= target:
        sd[f"model.layers.{i}.mlp.weight"] = torch.randn(HIDDEN, HIDDEN, generator=gen, dtype=torch.bfloat16)
        sd[f"model.layers.{i}.norm.weight"] = torch.randn(HIDDEN, generator=gen, dtype=torch.bfloat16)
        used += HIDDEN * HIDDEN * 2 + HIDDEN * 2
        i += 1
    return sd


def best_seconds(fn: Callable[[Path], object], scratch: Path, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        target = scratch / "target"
        shutil.rmtree(target, ignore_errors=True)
        start = time.perf_counter()
        fn(target)
        best = min(best, time.perf_counter() - start)
    shutil.rmtree(scratch / "target", ignore_errors=True)
    return best


def crc_write(path: Path, data: bytes) -> int:
    value = 0
    view = memoryview(data)
    with open(path, "wb", buffering=0) as f:
        for i in range(0, len(view), CHUNK_BYTES):
            f.write(view[i : i + CHUNK_BYTES])
            value = zlib.crc32(view[i : i + CHUNK_BYTES], value)
    return value


def async_exports(sd: dict[str, torch.Tensor], meta: dict[str, object], root: Path, reps: int) -> list[dict[str, float]]:
    """Export ``sd`` ``reps`` times with an AsyncExporter; blocked vs total seconds of each."""
    exporter = AsyncExporter(root, None)
    out = []
    for step in range(1, reps + 1):
        exporter.submit(step, sd, config=meta)
        exporter.wait()
        (outcome,) = exporter.poll()
        if not outcome.ok:
            raise RuntimeError(f"async export failed: {outcome.error}")
        out.append({"blocked_s": outcome.blocked_s, "total_s": outcome.total_s})
        shutil.rmtree(outcome.path)
    return out


def digest_costs(sd: dict[str, torch.Tensor], scratch: Path, reps: int) -> dict[str, float]:
    """Best seconds of one shard: written plain, with its file CRC-32, with file CRC + tensor digests."""

    def plain(target: Path) -> None:
        target.mkdir()
        with open(target / "model.safetensors", "xb", buffering=0) as f:
            for _segment, chunk in _tagged_chunks(sd):
                f.write(chunk)

    def file_crc(target: Path) -> None:
        write_chunks(target / "model.safetensors", (c for _s, c in _tagged_chunks(sd)), zlib.crc32, fsync=False)

    def digests(target: Path) -> None:
        write_safetensors(target / "model.safetensors", sd, zlib.crc32, fsync=False)

    contenders = [("write", plain), ("write + file crc32", file_crc), ("write + file crc32 + tensor digests", digests)]
    best: dict[str, float] = {}
    for _ in range(reps):  # interleaved, so a change in the machine's load hits every contender alike
        for name, fn in contenders:
            best[name] = min(best.get(name, float("inf")), best_seconds(fn, scratch, 1))
    return best


def report_digests(costs: dict[str, float], file_bytes: int) -> dict[str, float]:
    base = costs["write"]
    for name, seconds in costs.items():
        print(f"{name:<52} {seconds * 1e3:8.1f} ms  {file_bytes / seconds / 1e9:6.2f} GB/s  "
              f"ratio to the write {seconds / base:.2f}")
    return {name: seconds / base for name, seconds in costs.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=500)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--root", type=Path, default=Path("/dev/shm"))
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    parser.add_argument("--smoke", action="store_true", help="100 MB, one rep, the digest costs only")
    args = parser.parse_args(argv)
    if args.smoke:
        args.mb, args.reps = 100, 1

    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}  cpus: {os.cpu_count()}")
    sd = make_state_dict(args.mb)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    if shutil.disk_usage(args.root).free < 4 * nbytes:
        raise SystemExit(f"{args.root}: not enough free space for the benchmark (need {4 * nbytes} bytes)")
    meta = {"model_type": "llama", "tie_word_embeddings": False}
    scratch = Path(tempfile.mkdtemp(prefix="ckpteval-bench-", dir=args.root))
    try:
        source = scratch / "source"
        records = write_hf_files(source, sd, None, meta)
        shard = source / "model.safetensors"
        file_bytes = records["model.safetensors"]["bytes"]

        def export(target: Path) -> None:
            write_hf_files(target, sd, None, meta)

        def save_bytes(target: Path) -> None:
            target.mkdir()
            crc_write(target / "model.safetensors", st.save(sd, metadata={"format": "pt"}))

        def save_file_reread(target: Path) -> None:
            target.mkdir()
            st.save_file(sd, str(target / "model.safetensors"), metadata={"format": "pt"})
            value = 0
            with open(target / "model.safetensors", "rb") as f:
                while block := f.read(CHUNK_BYTES):
                    value = zlib.crc32(block, value)

        def cp(target: Path) -> None:
            target.mkdir()
            subprocess.run(["cp", str(shard), str(target / "model.safetensors")], check=True)

        print(f"state dict: {len(sd)} tensors, {nbytes / 1e6:.0f} MB; shard file {file_bytes / 1e6:.0f} MB")
        digest_ratios = report_digests(digest_costs(sd, scratch, args.reps), file_bytes)
        if args.smoke:
            return 0
        results = {}
        for name, fn in [
            (EXPORTER, export),
            ("safetensors.save -> bytes, write + crc32", save_bytes),
            ("save_file, then re-read for crc32", save_file_reread),
            (CP, cp),
        ]:
            seconds = best_seconds(fn, scratch, args.reps)
            results[name] = file_bytes / seconds / 1e9
            print(f"{name:<52} {seconds * 1e3:8.1f} ms  {results[name]:6.2f} GB/s")
        exporter, cp_rate = results[EXPORTER], results[CP]
        print(f"ratio exporter / cp: {exporter / cp_rate:.2f}")

        exports = async_exports(sd, meta, scratch / "async", args.reps)
        blocked = statistics.median(e["blocked_s"] for e in exports)
        total = statistics.median(e["total_s"] for e in exports)
        print(f"AsyncExporter ({args.reps} exports, median): trainer blocked {blocked * 1e3:.1f} ms "
              f"(eval/export_blocked_seconds), whole export {total * 1e3:.1f} ms (eval/export_time_seconds), "
              f"blocked/total {blocked / total:.2f}")
        if args.json:
            args.json.write_text(json.dumps({
                "load_average": os.getloadavg(), "root": str(args.root), "state_dict_bytes": nbytes,
                "file_bytes": file_bytes, "gb_per_s": results, "exporter": EXPORTER, "cp": CP,
                "ratio_exporter_cp": exporter / cp_rate, "async_exports": exports,
                "async_blocked_s_median": blocked, "async_total_s_median": total,
                "digest_ratios_to_write": digest_ratios,
            }, indent=1))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
