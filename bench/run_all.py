"""``make bench``: run every benchmark, print each result against its baseline, write bench/RESULTS.md.

Each benchmark is its own script (run here as a subprocess with ``--json``), measures its baseline in
the same run and prints its ratio; this driver adds the machine description (cores, RAM, the
filesystems of /dev/shm and of the run dirs, load average at start and end), a goal table and one
table per benchmark. Targets are goals, not assertions: a missed goal is reported, never fails.

=================  =========================================================  ==================
section            script                                                     goal
=================  =========================================================  ==================
trainer stall      bench_stall.py: steps/s with the fleet vs --no-eval          >= 0.98x no-eval
latency            bench_stall.py: .complete -> result -> ingested (fleet runs) (reported)
export             bench_export.py: exporter GB/s vs cp; AsyncExporter blocked   >= 0.8x cp
coordination       bench_coord.py: claim+result+release per unit, idle poll     median, p95 <= 20 ms
metadata           bench_metadata.py: strace of a backfill, per unit by syscall <= 10 ops, <= 1 ms CPU
engine             bench_engine.py: hf batched vs one prompt at a time          >= 4x
                   bench_engine.py: per-sample seeds vs one seed per call      >= 0.8x
grader             bench_grader.py: math answers/s, pool vs inline             (reported)
sandbox            bench_sandbox.py: code programs/s, sandboxed vs plain subprocess (goal >= 0.5x, #26)
reload             bench_reload.py: hf in-place reload GB/s vs a plain read     (reported)
                   (``--device cuda`` too where a GPU is visible, else skipped)
workers            bench_workers.py: units/s with 1, 2, 4 workers               (reported)
scale              bench_scale.py: 1,000 points x 20 sets x 32 shards: status,  < 2 s each;
                   plot, ingestion poll vs 10 points; idle-poll syscalls      same syscalls
fleet              bench_fleet.py: 256 fn workers: units evaluated twice,       0 but lease expiry
                   lost claims per unit, wall per point vs 1 worker           (reported)
judge              bench_judge.py: judged samples/s, verdict cache warm vs cold (reported)
                   bench_judge.py: trainer steps/s, judged set vs no-eval       (reported)
envs               bench_envs.py: episode vs single-turn tokens/s              (reported)
                   bench_envs.py: 10% tool failures reaching logged numbers    0
=================  =========================================================  ==================

Usage: ``.venv/bin/python bench/run_all.py [--quick] [--only stall,export,...] [--out bench/RESULTS.md]``
(``--quick``: small sizes, a smoke test of the whole pipeline in about two minutes; it writes to
``--out`` too, so point that elsewhere). The raw numbers go to ``RESULTS.json`` next to ``--out``;
``--render RESULTS.json`` rewrites the markdown from them without measuring again; ``--only stall --merge``
re-measures only those benchmarks and replaces their sections (the others keep theirs; the page says
which sections were re-measured when, at which load). The full run takes about 9 minutes on 2 cores.

Smoke mode: :data:`SMOKE` holds every ``bench_*.py``'s seconds-long arguments; ``tests/test_bench_smoke.py``
runs each with them in ``make test`` (exit 0 and a ratio line; numbers not asserted), so a benchmark that
no longer runs fails CI.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent

# name -> (script, full args, quick args)
BENCHES: dict[str, tuple[str, list[str], list[str]]] = {
    "stall": ("bench_stall.py", [], ["--steps", "100", "--repeats", "1", "--no-pinned"]),
    "export": ("bench_export.py", ["--mb", "500", "--reps", "5"], ["--mb", "50", "--reps", "2"]),
    "coord": ("bench_coord.py", [], ["--procs", "4", "--units", "100", "--gb", "0.05", "--snapshots", "100"]),
    "metadata": ("bench_metadata.py", [], ["--steps", "2", "--small", "4", "--large", "16", "--units", "50"]),
    "engine": ("bench_engine.py", [], ["--prompts", "16", "--repeats", "1"]),
    "grader": ("bench_grader.py", [], ["--answers", "40", "--repeats", "1"]),
    "sandbox": ("bench_sandbox.py", ["--repeats", "6"], ["--smoke"]),
    "envs": ("bench_envs.py", [], ["--smoke"]),
    "reload": ("bench_reload.py", ["--repeats", "5"], ["--hidden", "256", "--layers", "2", "--repeats", "1"]),
    "reload_cuda": ("bench_reload.py", ["--repeats", "5", "--device", "cuda"],
                    ["--hidden", "256", "--layers", "2", "--repeats", "1", "--device", "cuda"]),
    "workers": ("bench_workers.py", ["--steps", "16", "--n-prompts", "512"],
                ["--workers", "1,2", "--steps", "2", "--n-prompts", "64"]),
    "judge": ("bench_judge.py", ["--samples", "256", "--delay-ms", "200", "--trainer-steps", "400"], ["--smoke"]),
    "scale": ("bench_scale.py", [], ["--points", "100"]),
    "fleet": ("bench_fleet.py", [], ["--workers", "32", "--points", "10", "--sleep", "0.5"]),
}

# script -> arguments of its smoke run (seconds, numbers not asserted): tests/test_bench_smoke.py runs every
# bench/bench_*.py with these in `make test`, so a benchmark that no longer runs fails CI. Adding a benchmark:
# add its smoke arguments here (the test fails for a script without them); it must print a line with "ratio".
SMOKE: dict[str, list[str]] = {
    "bench_stall.py": ["--steps", "4", "--eval-interval", "2", "--batch-size", "2", "--workers", "1",
                       "--repeats", "1", "--no-pinned", "--poll", "0.1", "--only", "no-eval,fleet-staging", "--smoke"],
    "bench_export.py": ["--mb", "4", "--reps", "1"],
    "bench_coord.py": ["--procs", "2", "--units", "10", "--gb", "0.005", "--snapshots", "10"],
    "bench_metadata.py": ["--steps", "1", "--small", "2", "--large", "4", "--units", "10", "--no-cpu"],
    "bench_engine.py": ["--prompts", "4", "--max-new-tokens", "4", "--repeats", "1"],
    "bench_grader.py": ["--answers", "8", "--repeats", "1"],
    "bench_reload.py": ["--hidden", "64", "--layers", "1", "--repeats", "1"],
    "bench_workers.py": ["--workers", "1", "--steps", "1", "--n-prompts", "8", "--shard-size", "4"],
    "bench_trainer.py": ["--steps", "4", "--eval-interval", "2", "--batch-size", "2", "--n-prompts", "4",
                         "--shard-size", "4", "--smoke"],
    "bench_stop.py": ["--waits", "backpressure", "--signals", "SIGUSR1", "--bound", "60", "--settle", "0.2"],
    "bench_sandbox.py": ["--smoke"],
    "bench_judge.py": ["--smoke"],
    "bench_attest.py": ["--smoke", "--dir", os.environ.get("TMPDIR", tempfile.gettempdir())],
    "bench_canary.py": ["--smoke"],
    "bench_envs.py": ["--smoke"],
    "bench_rescore.py": ["--points", "3", "--prompts", "8", "--shard-size", "4", "--lengths", "8", "256",
                         "--store-prompts", "4"],
    "bench_scale.py": ["--smoke"],
    "bench_fleet.py": ["--workers", "2", "--points", "1", "--datasets", "1", "--shards", "4", "--sleep", "0.01",
                       "--baseline-units", "1", "--bound", "60"],
    "bench_budget.py": ["--points", "2", "--prompts", "4", "--tokens", "64"],
    "bench_coverage.py": ["--reps", "50"],
    "bench_contamination.py": ["--train-rows", "3000", "--eval-rows", "50"],
    "bench_adaptive.py": ["--reps", "2", "--points", "10", "--prompts", "40"],
    "bench_plateau.py": ["--reps", "50", "--points", "12"],
}


# -- machine --------------------------------------------------------------------------------------------
def sh(*cmd: str) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return ""


def fs_of(path: Path) -> str:
    out = sh("df", "-h", "--output=source,fstype,size,avail", str(path)).splitlines()
    if len(out) < 2:
        return "?"
    source, fstype, size, avail = out[-1].split()
    return f"{fstype} ({source}), {size}, {avail} free"


def machine(run_root: Path) -> dict[str, Any]:
    cpu_model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), platform.processor() or "?")
    mem_kb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                  if line.startswith("MemTotal:"))
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = "?"
    return {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model,
        "ram_gib": round(mem_kb / 2**20, 1),
        "fs_dev_shm": fs_of(Path("/dev/shm")),
        "run_root": str(run_root),
        "fs_run_root": fs_of(run_root),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch_version,
        "commit": sh("git", "-C", str(REPO), "rev-parse", "--short", "HEAD"),
        "dirty": bool(sh("git", "-C", str(REPO), "status", "--porcelain", "--", "bench", "coord", "jobs")),
        "load_at_start": os.getloadavg(),
    }


def checksum_speeds(mb: int = 256) -> dict[str, float]:
    """GB/s of zlib.crc32 and hashlib.sha256 over an in-memory buffer (why snapshots use CRC-32)."""
    data = os.urandom(1 << 20) * mb
    out = {}
    for name, fn in (("crc32", lambda: zlib.crc32(data)), ("sha256", lambda: hashlib.sha256(data).digest())):
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        out[name] = len(data) / best / 1e9
    return out


# -- running --------------------------------------------------------------------------------------------
def run_bench(name: str, quick: bool, run_root: Path, tmp: Path) -> dict[str, Any]:
    script, full, small = BENCHES[name]
    args = list(small if quick else full)
    if name == "stall":
        args += ["--root", str(run_root)]
    elif name in ("coord", "metadata"):
        args += ["--dir", str(run_root)]
    elif name in ("workers", "fleet"):
        args += ["--root", str(run_root)]
    out = tmp / f"{name}.json"
    cmd = [sys.executable, str(BENCH / script), *args, "--json", str(out)]
    print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
    load = os.getloadavg()
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, check=False)
    seconds = time.perf_counter() - t0
    record: dict[str, Any] = {"script": script, "args": args, "seconds": round(seconds, 1),
                              "load_at_start": load, "returncode": proc.returncode}
    if proc.returncode == 0 and out.exists():
        record["data"] = json.loads(out.read_text())
    else:
        record["error"] = f"{script} exited with {proc.returncode}"
        print(f"!!! {record['error']}", flush=True)
    return record


# -- report ---------------------------------------------------------------------------------------------
def f(x: Any, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(f(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def met(ok: bool | None) -> str:
    return "-" if ok is None else ("met" if ok else "**missed**")


def load_str(load: Any) -> str:
    return " ".join(f"{x:.2f}" for x in load)


def stall_rows(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in data["summary"]}


def goals(results: dict[str, dict[str, Any]]) -> list[list[Any]]:
    rows: list[list[Any]] = []
    if d := results.get("stall", {}).get("data"):
        s = stall_rows(d)
        for name in ("fleet-staging", "fleet-reuse", "fleet-staging pinned", "fleet-reuse pinned", "shared"):
            if name in s:
                r = s[name]
                goal = ">= 0.98x" if name != "shared" else "(reference)"
                ok = r["ratio"] >= 0.98 if name != "shared" and r["ratio"] is not None else None
                ok = None if r["ratio"] is None else ok
                rows.append([f"trainer steps/s, {name}", f"{r['steps_per_second']:.2f} steps/s",
                             f"{f(r['baseline_steps_per_second'])} ({r['baseline']})", f"{f(r['ratio'], 3)}x", goal,
                             met(ok)])
        for name in ("fleet-staging", "fleet-staging pinned"):
            lat = s.get(name, {}).get("latency", {}).get("complete_to_ingested_s")
            if lat:
                rows.append([f"latency .complete -> ingested, {name}",
                             f"median {lat['median']:.2f} s, p95 {lat['p95']:.2f} s",
                             f"poll interval {d['settings']['poll']} s", "-", "(reported)", "-"])
    if d := results.get("export", {}).get("data"):
        rows.append(["export to /dev/shm, GB/s", f"{d['gb_per_s'][d['exporter']]:.2f} GB/s",
                     f"{d['gb_per_s'][d['cp']]:.2f} GB/s (cp)", f"{d['ratio_exporter_cp']:.2f}x", ">= 0.8x",
                     met(d["ratio_exporter_cp"] >= 0.8)])
        rows.append(["AsyncExporter: trainer blocked per point", f"{d['async_blocked_s_median'] * 1e3:.0f} ms",
                     f"{d['async_total_s_median'] * 1e3:.0f} ms (whole export)",
                     f"{d['async_blocked_s_median'] / d['async_total_s_median']:.2f}x", "(reported)", "-"])
    if d := results.get("coord", {}).get("data"):
        for key, label in (("claims", f"{d['procs']} procs"), ("claims_1proc", "1 proc")):
            c = d[key]
            cpu = (f" (CPU median {c['cpu_median_ms']:.1f} ms, p95 {c['cpu_p95_ms']:.1f} ms)"
                   if "cpu_median_ms" in c else "")
            rows.append([f"claim+result+release per unit, {label}",
                         f"wall median {c['median_ms']:.1f} ms, p95 {c['p95_ms']:.1f} ms{cpu}",
                         f"result only: median {d['result_only']['median_ms']:.1f} ms" if key == "claims" else "-",
                         "-", "<= 20 ms", met(c["median_ms"] <= 20 and c["p95_ms"] <= 20)])
        p = d["idle_poll"]
        rows.append([f"idle discovery poll, {p['snapshots']} snapshots", f"{p['fs_syscalls']} fs syscalls",
                     f"first poll {p['first_poll_ms']} ms", "-", "(reported)", "-"])
    if d := results.get("metadata", {}).get("data"):
        rows += metadata_goals(d)
    if d := results.get("engine", {}).get("data"):
        rows.append(["hf engine tokens/s, batched", f"{d['batched_tokens_per_s']:,.0f}",
                     f"{d['single_tokens_per_s']:,.0f} (one at a time)", f"{d['ratio']:.1f}x", ">= 4x",
                     met(d["ratio"] >= 4)])
        if "seeded_ratio" in d:
            rows.append(["hf engine tokens/s, sampled with per-sample seeds", f"{d['seeded_tokens_per_s']:,.0f}",
                         f"{d['sampled_tokens_per_s']:,.0f} (one seed per call)", f"{d['seeded_ratio']:.2f}x",
                         ">= 0.8x", met(d["seeded_ratio"] >= 0.8)])
    if d := results.get("sandbox", {}).get("data"):
        rows.append(["code programs/s, sandboxed", f"{d['sandboxed_per_s']:.1f}",
                     f"{d['plain_per_s']:.1f} (plain subprocess)", f"{d['ratio']:.2f}x", ">= 0.5x",
                     met(d["ratio"] >= 0.5)])
    if d := results.get("grader", {}).get("data"):
        rows.append(["math grader answers/s, pool", f"{d['pooled_per_s']:,.0f}",
                     f"{d['inline_per_s']:,.0f} (inline, no deadline)", f"{d['ratio']:.2f}x", "(reported)", "-"])
    for key in ("reload", "reload_cuda"):
        if (d := results.get(key, {}).get("data")) and "gb_per_s" in d:
            g = d["gb_per_s"]
            rows.append([f"hf engine reload, {d['device']}", f"{g['reload (straight into parameters)']:.2f} GB/s",
                         f"{g['plain read into resident memory']:.2f} GB/s (plain read)",
                         f"{d['ratio_reload_plain']:.2f}x", "(reported)", "-"])
    if d := results.get("workers", {}).get("data"):
        for r in d["rows"]:
            rows.append([f"eval units/s, {r['workers']} worker(s)", f"{r['steady']:.1f} steady",
                         f"{d['rows'][0]['steady']:.1f} (1 worker)", f"{r['steady_ratio']:.2f}x", "(reported)", "-"])
    rows += scale_goals(results.get("scale", {}).get("data")) + fleet_goals(results.get("fleet", {}).get("data"))
    return rows


def scale_goals(d: dict[str, Any] | None) -> list[list[Any]]:
    if not d:
        return []
    b, s, goal = d["baseline"], d["scale"], d["goal_s"]
    rows = [[f"{label}, {s['points']} points x {d['datasets']} sets x {d['shards']} shards", f"{s[key]:.2f} s",
             f"{b[key]:.2f} s ({b['points']} points)", f"{s[key] / b[key]:.1f}x", f"< {goal:g} s",
             met(s[key] < goal)]
            for key, label in (("status_s", "`ckpteval status`"), ("plot_s", "`ckpteval plot`"),
                               ("steady_s", "trainer ingestion poll, a point landed"),
                               ("resume_s", "trainer resume (first poll)")) if key in s]
    for kind, counts in s["syscalls"].items():
        n, n0 = sum(counts.values()), sum(b["syscalls"][kind].values())
        rows.append([f"syscalls of one {kind} poll, {s['points']} points", n, f"{n0} ({b['points']} points)",
                     f"{n / max(n0, 1):.1f}x", "same count", met(n == n0)])
    return rows


def fleet_goals(d: dict[str, Any] | None) -> list[list[Any]]:
    if not d:
        return []
    f, pp = d["fleet"], d["per_point"]
    return [[f"units evaluated twice, {d['workers']} workers", f"{f['duplicates']} ({len(f['by_lease_expiry'])} by "
             f"lease expiry)", "-", "-", "0 but lease expiry", met(not f["not_explained_by_expiry"])],
            [f"lost claim attempts per unit, {d['workers']} workers", f"{f['lost_claims_per_unit']:.2f}", "-", "-",
             "(reported)", "-"],
            [f"wall per point, {d['workers']} workers", f"{pp['fleet_e2e_s']:.2f} s",
             f"{pp['one_worker_s']:.1f} s (1 worker)", f"{pp['one_worker_s'] / pp['fleet_e2e_s']:.1f}x",
             "(reported)", "-"]]


def spread(r: dict[str, Any]) -> float:
    xs = r["steps_per_second_each"]
    return (max(xs) - min(xs)) / (sum(xs) / len(xs)) if len(xs) > 1 else 0.0


def cpu_delta(r: dict[str, Any], s: dict[str, dict[str, Any]]) -> float | None:
    base = s.get(r["baseline"])
    return None if base is None or r["ratio"] is None else r["trainer_cpu_s"] - base["trainer_cpu_s"]


def stall_section(rec: dict[str, Any], cpus: int) -> str:
    d = rec["data"]
    st = d["settings"]
    s = stall_rows(d)
    out = [f"`bench_stall.py` — reference trainer `ckpteval train --steps {st['steps']} --batch-size "
           f"{st['batch_size']} --threads 1 --no-progress`, eval every {st['eval_interval']} steps (128 prompts in "
           f"2 units of 64, 4 new tokens), {st['workers']} workers `--engine hf` (1 thread each), poll interval "
           f"{st['poll']} s on both sides, staging on /dev/shm. {st['repeats']} interleaved rounds (plus a last "
           "baseline); steps/s from the trainer's JSON summary (training loop only); a config's value is the "
           "mean of its runs, its ratio is against the mean of its baseline's runs. Trainer CPU s: the trainer "
           "process's CPU time (start-up included, ≈4 s) and its difference to the baseline's; fleet CPU s: the "
           "workers' CPU time during the trainer's run.", ""]
    rows = []
    for r in d["summary"]:
        exp = (f"{r['export_blocked_s_median'] * 1e3:.1f} / {r['export_time_s_median'] * 1e3:.1f}"
               if r["export_blocked_s_median"] is not None else "-")
        delta = cpu_delta(r, s)
        rows.append([r["name"], ", ".join(f"{x:.1f}" for x in r["steps_per_second_each"]),
                     f"{r['steps_per_second']:.2f}", r["baseline"] if r["ratio"] is not None else "-",
                     f"{r['ratio']:.3f}" if r["ratio"] is not None else "-", r["points"], r["skipped_points"],
                     f"{r['backpressure_wait_s']:.2f}", exp,
                     f"{r['trainer_cpu_s']:.1f}" + (f" ({delta:+.1f})" if delta is not None else ""),
                     f"{r['fleet_cpu_s']:.1f}", ", ".join(f"{x:.1f}" for x in r["load1_at_start"])])
    out.append(table(["config", "steps/s each run", "steps/s", "baseline", "ratio", "points", "skipped",
                      "backpressure wait s", "export blocked / total ms", "trainer CPU s (Δ)", "fleet CPU s",
                      "load1 at start"], rows))
    out += ["", "**Latency** (fleet runs, pooled over the runs of a config), seconds, median / p95 (max): "
            "`.complete` marker `created` → last unit result `written_at` (point complete) → ledger `ingested` "
            "`time`; per unit: `created` → its result's `written_at`.", ""]
    rows = []
    for r in d["summary"]:
        if lat := r.get("latency"):
            def cell(k: str, lat: dict[str, Any] = lat) -> str:
                v = lat[k]
                return "-" if v is None else f"{v['median']:.2f} / {v['p95']:.2f} ({v['max']:.2f})"
            n = lat["complete_to_ingested_s"]["n"] if lat["complete_to_ingested_s"] else 0
            rows.append([r["name"], n, cell("complete_to_result_s"), cell("result_to_ingested_s"),
                         cell("complete_to_ingested_s"), cell("unit_complete_to_result_s")])
    out.append(table(["config", "points", ".complete → result", "result → ingested", ".complete → ingested",
                      "per unit .complete → result"], rows))
    out += ["", f"Each hop is dominated by polling: a worker notices a new marker within one poll ({st['poll']} s, "
            "half on average), evaluates (tens to hundreds of ms here), and the trainer notices the last result "
            "at its next rate-limited results listing (again ≤ one poll, checked once per training step). With "
            "the default 2 s polls expect ≈ 2 s per hop.", "", stall_notes(s, st, cpus)]
    return "\n".join(out)


def stall_notes(s: dict[str, dict[str, Any]], st: dict[str, Any], cpus: int) -> str:
    notes = ["**Reading the trainer numbers.**"]
    spreads = [f"{r['name']} {min(r['steps_per_second_each']):.1f}–{max(r['steps_per_second_each']):.1f} "
               f"({spread(r):.0%})" for r in s.values() if r["ratio"] is None and r["runs"] > 1]
    if spreads:
        notes.append(
            "- **Noise first.** The same no-eval configuration, repeated, spans " + "; ".join(spreads) +
            " steps/s on this shared machine (other engineers' tests run alongside; see load1). A ratio "
            "difference smaller than that spread is not a measurement, so the 0.98 goal cannot be resolved "
            "from wall-clock steps/s here, in either direction.")
    fs = s.get("fleet-staging")
    if fs:
        per_point = fs["fleet_cpu_s"] / max(1.0, fs["points"] / fs["runs"])
        cores = fs["fleet_cpu_s"] / (st["steps"] / fs["steps_per_second"])
        unpinned = [r for n, r in s.items() if n in ("fleet-staging", "fleet-reuse")]
        load = sum(x for r in unpinned for x in r["load1_at_start"]) / sum(len(r["load1_at_start"]) for r in unpinned)
        worst = min(r["ratio"] for r in unpinned)
        slack = ("in this run it mostly fit beside the trainer and the unpinned ratios stay within the noise of 1; "
                 "when other processes keep both cores busy it comes out of the trainer's time instead (on this "
                 "machine on 2026-11-29 a run at load ≈ 3.5 measured 0.87x staging and 0.85x reuse unpinned, "
                 "pinned ≈ 1)." if worst >= 0.98 else
                 "its share came partly out of the trainer's time.")
        delta = cpu_delta(fs, s)
        notes.append(
            f"- **What the fleet posture costs the trainer itself** is small and does not depend on the noise: "
            f"blocked {fs['export_blocked_s_median'] * 1e3:.1f} ms per point for the host copy "
            f"({fs['export_blocked_fraction'] * 100:.3f}% of its loop time) plus a results listing at most every "
            f"{st['poll']} s; the trainer process's CPU time differs from the no-eval runs' by "
            f"{delta:+.1f} s per run (start-up included), i.e. no measurable extra work.")
        notes.append(
            f"- **Unpinned, the fleet competes for the same 2 cores.** It burned {fs['fleet_cpu_s']:.1f} CPU-s per "
            f"run (≈{per_point:.2f} CPU-s per point: snapshot verify, model build + load, generate, idle "
            f"polls{unit_timing_text(fs)}). With the single-threaded trainer, 2 workers and other engineers' "
            "processes runnable on 2 cores, every CPU-second the fleet takes on the trainer's core is a second "
            "the trainer waits: the unpinned ratios measure CPU sharing, not the protocol. "
            f"On average the fleet used ≈{cores:.2f} of a core during a run; the load average at the fleet runs' "
            f"starts was {load:.1f} on {cpus} cores (this bench's own previous run included), and {slack}")
    pinned = [s[n] for n in ("fleet-staging pinned", "fleet-reuse pinned") if n in s]
    if pinned:
        ratios = ", ".join(f"{r['name']} {r['ratio']:.3f}x" for r in pinned)
        notes.append(
            f"- **Pinned** (trainer `taskset -c 0`, workers `taskset -c 1`, baseline on core 0 too): {ratios}. "
            "This is the situation the fleet postures are for — eval on its own hardware — and there the "
            "trainer runs at its no-eval speed within the noise (ratios above 1 are noise: other processes "
            "still land on core 0).")
    if "fleet-reuse" in s and "no-eval+save-hf" in s:
        notes.append(
            f"- **Reuse** is compared with `--no-eval --save-hf` (the periodic HF save happens anyway in a real "
            f"run; here it ran at {s['no-eval+save-hf']['ratio']:.3f}x plain no-eval — the model is a few MB, "
            "so this too is mostly noise); on the trainer's side reuse adds only the `.complete` marker (a CRC "
            "pass over the checkpoint's files), and the fleet competes for CPU exactly as in staging.")
    if "shared" in s:
        delta = cpu_delta(s["shared"], s)
        notes.append(
            f"- **Shared** (blocking eval in the trainer's process): {s['shared']['ratio']:.3f}x; trainer CPU "
            f"{delta:+.1f} s per run against no-eval (the inline evals run on the trainer's process, so their "
            "cost lands here, within the noise). The reference eval is tiny (128 prompts × 4 "
            "tokens on a 2-layer model), so inline eval is cheap *here*; with a real eval set the shared "
            "posture's stall grows with eval time while the fleet's does not.")
    return "\n".join(notes)


def unit_timing_text(row: dict[str, Any]) -> str:
    t = row.get("unit_timings") or {}
    if "load_s" not in t or "generate_s" not in t:
        return ""
    return (f"; per unit, median: load {t['load_s'] * 1e3:.0f} ms, generate {t['generate_s'] * 1e3:.0f} ms, "
            f"whole unit {t.get('total_s', 0) * 1e3:.0f} ms")


def export_section(rec: dict[str, Any], crc: dict[str, float] | None) -> str:
    d = rec["data"]
    rows = [[name, f"{gbs:.2f}", f"{gbs / d['gb_per_s'][d['cp']]:.2f}"] for name, gbs in d["gb_per_s"].items()]
    out = [f"`bench_export.py` — a {d['state_dict_bytes'] / 1e6:.0f} MB bf16 state dict (one "
           f"{d['file_bytes'] / 1e6:.0f} MB shard) written to {d['root']}; best of the reps for each.", "",
           table(["method", "GB/s", "vs cp"], rows), ""]
    rows = [[i + 1, f"{e['blocked_s'] * 1e3:.0f}", f"{e['total_s'] * 1e3:.0f}", f"{e['blocked_s'] / e['total_s']:.2f}"]
            for i, e in enumerate(d["async_exports"])]
    out += ["AsyncExporter on the same state dict (what `eval/export_blocked_seconds` and "
            "`eval/export_time_seconds` report per point):", "",
            table(["export", "trainer blocked ms", "whole export ms", "blocked / total"], rows), "",
            "On a CPU-only trainer the \"host copy\" the trainer waits for is a memory-to-memory copy of the whole "
            "state dict into a fresh allocation (first-touch page faults included), so it costs about as much as "
            "writing the file to tmpfs: blocked ≈ half the export. On a GPU trainer it is a device-to-host copy "
            "into reused pinned memory (tens of GB/s) and the write + checksum happen in the background thread."]
    if crc:
        out += ["", f"Checksum speed (in-memory, 256 MB, best of 3): zlib.crc32 {crc['crc32']:.2f} GB/s, "
                    f"sha256 {crc['sha256']:.2f} GB/s — why snapshot markers use CRC-32."]
    return "\n".join(out)


def coord_section(rec: dict[str, Any]) -> str:
    d = rec["data"]
    def row(label: str, c: dict[str, float]) -> list[Any]:
        return [label, f"{c['units_per_s']:.0f}", f"{c['median_ms']:.2f}", f"{c['p95_ms']:.2f}",
                f(c.get("cpu_median_ms")), f(c.get("cpu_p95_ms")), f(c.get("total_cpu_per_unit_ms"))]

    rows = [row(f"lease + result + release, {d['procs']} procs", d["claims"]),
            row(f"result only (baseline), {d['procs']} procs", d["result_only"]),
            row("lease + result + release, 1 proc", d["claims_1proc"])]
    v, p = d["verify"], d["idle_poll"]
    return "\n".join([
        f"`bench_coord.py` — {d['units']} units shared by {d['procs']} processes (no model, trivial scoring) "
        f"on {d['dir']}; per-unit time is claim + result write + release of units a process won "
        f"(duplicates: {d['claims']['duplicates']}).", "",
        table(["loop", "units/s", "per unit wall median ms", "wall p95 ms", "per unit CPU median ms",
               "CPU p95 ms", "all CPU / units ms"], rows), "",
        "Wall = claim + result + release as the process saw it; CPU = the process's own CPU time for the same "
        "calls (no queueing); all CPU / units = every process's CPU seconds (losing claim attempts, results "
        "listings, start-up included) divided by the units.", "",
        f"With {d['procs']} processes on {d['cpus']} cores, each process is runnable about "
        f"{d['cpus'] / d['procs']:.0%} of the time, so a unit's wall time includes waiting for a CPU (often a "
        "whole scheduler slice) between the lease file operations; the 1-process row is the protocol's own "
        f"cost. Contention is kept small: like real workers, each process walks a step's units in its own "
        "order (`order_units(spread=pid)`) and skips units whose result exists before writing a lease; "
        "a claim that still loses costs a few file syscalls.", "",
        coord_verdict(d), "",
        f"Snapshot verification ({v['gb']:.2f} GB, page cache warm): plain read {v['plain_read_gb_s']:.2f} GB/s; "
        f"`fast` {v['fast_ms']:.2f} ms (sizes + headers, independent of size); `full` {v['full_gb_s']:.2f} GB/s "
        "(CRC-32 of every byte).", "",
        f"Idle discovery poll over {p['snapshots']} published snapshots: **{p['fs_syscalls']} filesystem "
        f"syscalls** (strace: open/stat/getdents/close), {p['idle_poll_us']} µs; the first poll (reads every "
        f"marker) {p['first_poll_ms']} ms.",
    ])


def metadata_goals(d: dict[str, Any]) -> list[list[Any]]:
    p, b = d["protocol"]["leased"], d["backfill"]
    base = d["protocol"]["result_only"]
    return [["metadata ops per unit, claim+result+release", f"{p['meta_total']:.1f}",
             f"{base['meta_total']:.1f} (result only)", f"{p['meta_total'] / base['meta_total']:.2f}x", "<= 10",
             met(p["meta_total"] <= 10)],
            ["CPU per unit, claim+result+release, 1 proc", f"{p['cpu_ms']:.2f} ms", f"{base['cpu_ms']:.2f} ms (result only)",
             f"{p['cpu_ms'] / base['cpu_ms']:.2f}x", "<= 1 ms", met(p["cpu_ms"] <= 1)],
            ["metadata ops per unit, whole backfill (marginal)", f"{b['meta_per_unit']:.1f}", "-", "-", "(reported)",
             "-"]]


# bench_metadata.py's numbers before issue 20's changes (commit ffeb06e, 2026-12-01, 4 steps, 64 vs 448 units,
# load average ~8): the reference the section compares against.
METADATA_BEFORE = {"backfill_meta": 38.0, "backfill_cpu_ms": 3.29, "threads": 2.0, "getpid": 49.0,
                   "protocol_meta": 22.0, "protocol_cpu_ms": 1.99,
                   "backfill_by_kind": "newfstatat 14, openat 13, getdents64 4, fsync 3, unlink 2, link 1, mkdir 1"}


def metadata_section(rec: dict[str, Any]) -> str:
    d = rec["data"]
    b, p = d["backfill"], d["protocol"]
    was = METADATA_BEFORE

    def counts(c: dict[str, float]) -> str:
        return ", ".join(f"{k} {v:.1f}" for k, v in c.items()) or "none"

    extra = d["units_large"] - d["units_small"]
    return "\n".join([
        "Syscall counts are deterministic; CPU figures follow the machine's load (the 'before' column was measured "
        "at a load average of ~8; compare the section's load average above).", "",
        f"`bench_metadata.py` — a real `ckpteval backfill --engine fn:bench.bench_metadata:NullBackend` (touches no "
        f"file) under `strace -f -y` on two fresh runs of {d['steps']} snapshots, {d['units_small']} and "
        f"{d['units_large']} units; per unit = the difference / {extra} (start-up cancels out). Metadata ops = "
        "path syscalls, directory reads and fsyncs on the run dir, the snapshot root and the directories above "
        "them (each an MDS round trip on Lustre); `/proc` and the venv are not counted.", "",
        table(["per unit", "backfill (marginal)", "before", "claim + result + release", "before",
               "result only (baseline)"], [
            ["metadata ops", f"{b['meta_per_unit']:.1f}", f"{was['backfill_meta']:.1f}", f"{p['leased']['meta_total']:.1f}",
             f"{was['protocol_meta']:.1f}", f"{p['result_only']['meta_total']:.1f}"],
            ["CPU ms (1 process, no strace)", f"{b['cpu_ms_per_unit']:.2f}" if b.get("cpu_ms_per_unit") is not None
             else "-", was["backfill_cpu_ms"], f"{p['leased']['cpu_ms']:.2f}", was["protocol_cpu_ms"],
             f"{p['result_only']['cpu_ms']:.2f}"],
            ["thread starts", f"{b['threads_per_unit']:.2f}", f"{was['threads']:.1f}", "-", "-", "-"],
            ["getpid", f"{b['all'].get('getpid', 0.0):.1f}", f"{was['getpid']:.1f}", f"{p['leased']['all'].get('getpid', 0.0):.1f}",
             "-", "-"]]), "",
        f"Backfill metadata ops by kind: {counts(b['meta'])} (before: {was['backfill_by_kind']}); by area: "
        f"{counts(b['areas'])}.", "",
        f"Claim + result + release by kind: {counts(p['leased']['meta'])}; by area: {counts(p['leased']['areas'])}.",
        "", "What changed (issue 20): the worker lists `results/` and polls discovery once per `--poll-interval`, not "
        "once per unit; verification runs once per snapshot per process while its `.complete` keeps its identity "
        "(one `stat` per unit); one long-lived unit thread; the attempt count is one `open` (no `fsync`: a lost line "
        "only allows one more attempt); the results directory's `fsync` goes through a kept descriptor; results and "
        "leases live in `step-<N>/` directories (protocol 2). Then the lease itself: `coord/work/lease.py` replaced "
        "filelock's `SoftFileLease` (which resolved the lease path one `lstat` per component, made sure of the "
        "directory with `mkdir` + `stat`, `lstat`ed the marker before creating it and twice before unlinking it, "
        "and started a heartbeat thread per claim) by one `O_CREAT|O_EXCL` create per claim and one `unlink` per "
        "release — its own holder record inside (issue 27), one heartbeat thread per worker; a release within half the "
        "lease duration of the last touch needs no check, as no takeover can have happened. A result is "
        "published by `renameat2(RENAME_NOREPLACE)` (one call instead of `link` + `unlink`), and a worker keeps "
        "the result it published in its index instead of reading it back at the next poll.",
        "", "What is left per unit: the result's temp file (`open`), its `fsync`, its `renameat2`, the directory "
        "`fsync`, the lease's create and unlink, the `.attempts` append, the result `stat` after the claim, and "
        "one `stat` of the snapshot's `.complete` (the backfill's extra op over the protocol loop).",
    ])


def coord_verdict(d: dict[str, Any]) -> str:
    c, one = d["claims"], d["claims_1proc"]
    if "cpu_median_ms" not in c:
        return ""
    wall_ok = c["median_ms"] <= 20 and c["p95_ms"] <= 20
    return (f"**Against the ≤ 20 ms goal:** with {d['procs']} processes the wall time per unit is median "
            f"{c['median_ms']:.1f} / p95 {c['p95_ms']:.1f} ms ({'met' if wall_ok else 'missed'}), while the CPU the "
            f"protocol spends per unit is median {c['cpu_median_ms']:.1f} / p95 {c['cpu_p95_ms']:.1f} ms "
            f"(1 process: wall {one['median_ms']:.1f} / {one['p95_ms']:.1f} ms). The gap between wall and CPU is "
            f"waiting for one of {d['cpus']} cores behind {d['procs'] - 1} peers, not lease work; on a fleet with a "
            "core per worker the per-unit overhead is the CPU figure plus filesystem latency.")


def engine_section(rec: dict[str, Any]) -> str:
    d = rec["data"]
    return "\n".join([
        f"`bench_engine.py` — HFEngine on the reference model (2-layer Llama, hidden 128), {d['prompts']} "
        f"prompts, {d['max_new_tokens']} new tokens, greedy, torch threads {d['torch_threads']}, best of "
        f"{d.get('repeats', '?')}.", "",
        table(["mode", "tokens/s"], [["one batched call", f"{d['batched_tokens_per_s']:,.0f}"],
                                     ["one prompt at a time", f"{d['single_tokens_per_s']:,.0f}"]]), "",
        f"Ratio batched / one at a time: **{d['ratio']:.1f}x** (goal ≥ 4x). With a model this small each forward "
        "pass is dominated by per-call Python/dispatch overhead, which batching amortises over all prompts.",
        *([] if "seeded_ratio" not in d else [
            "",
            table(["sampled batch (temperature 1)", "tokens/s"],
                  [["one seed for the call", f"{d['sampled_tokens_per_s']:,.0f}"],
                   ["one seed per prompt (per-row generators)", f"{d['seeded_tokens_per_s']:,.0f}"]]), "",
            f"Per-sample seeds cost: **{d['seeded_ratio']:.2f}x** the throughput of one seed per call (goal ≥ "
            "0.8x). The batch is kept; only the token draw is per row (one `torch.multinomial` per row and step "
            "with the row's own generator), which on this tiny model is comparable to a forward pass.",
        ]),
    ])


def grader_section(rec: dict[str, Any]) -> str:
    d = rec["data"]
    return "\n".join([
        f"`bench_grader.py` — the `math` scorer (math-verify) on {d['answers']} GSM8K/MATH-like answers "
        f"(boxed, `#### n`, LaTeX fractions, decimals; {d['correct']} correct), best of {d['repeats']}, "
        f"{d['cpus']} cores.", "",
        table(["mode", "answers/s"], [["inline (calling thread, no deadline)", f"{d['inline_per_s']:,.0f}"],
                                      [f"pool of {d['processes']} processes, per-answer deadline",
                                       f"{d['pooled_per_s']:,.0f}"]]), "",
        f"Ratio pooled / inline: **{d['ratio']:.2f}x**; the pool's start (spawn + sympy import, once per worker "
        f"process) took {d['pool_start_s']:.1f} s. The pool pays a pickle round trip per answer and gains the "
        "processes' parallelism; what it buys is the deadline: a pathological answer costs at most "
        "`grader_timeout_s`, where inline it would hang the unit.",
    ])


def sandbox_section(rec: dict[str, Any]) -> str:
    d = rec["data"]
    return "\n".join([
        f"`bench_sandbox.py` — the example code set's reference programs ({d['programs']} runs: solutions with "
        f"their asserts, or one run per stdin case), all passing; best of {d['repeats']}, {d['concurrency']} at "
        f"once, {d['cpus']} cores.", "",
        table(["mode", "programs/s"], [["plain subprocess (`python -I -S -c`, no isolation, no limits)",
                                        f"{d['plain_per_s']:.1f}"],
                                       ["sandboxed (warm runner: namespaces, /proc, capped /tmp, rlimits, "
                                        "memory cgroup, outside deadline per program)", f"{d['sandboxed_per_s']:.1f}"]]),
        "",
        f"Ratio sandboxed / plain: **{d['ratio']:.2f}x** (medians {d.get('median_ratio', d['ratio']):.2f}x; "
        f"{abs(d['overhead_ms_per_program']):.1f} ms {'more' if d['overhead_ms_per_program'] >= 0 else 'less'} per "
        "program). Plain starts an interpreter per program; a "
        "sandboxed program is a fork of its thread's warm runner (already started) into new PID, mount, network, "
        "IPC, UTS and cgroup namespaces (and a user namespace when not root) with its own /proc and capped /tmp, "
        "then the launcher's rlimits, uid or capability drop and readiness pipe: it pays the namespaces and two "
        "forks instead of an interpreter's start-up. The reference programs do milliseconds of work each.",
    ])


def envs_section(rec: dict[str, Any]) -> str:
    o, i = rec["data"]["overhead"], rec["data"].get("injection")
    lines = [
        f"`bench_envs.py` — {o['episodes']:.0f} episodes of {o['turns']:.0f} turns (the tiny model in the real "
        "HFEngine, a minimal environment that never ends them) vs single-turn samples of the same prompts "
        "generating as many new tokens in one call.", "",
        table(["mode", "per s", "generated tokens/s"],
              [["episodes (a batched generate per turn, conversation re-rendered)", f"{o['episodes_per_s']:.2f}",
                f"{o['env_tokens_per_s']:.0f}"],
               ["single-turn samples", f"{o['samples_per_s']:.2f}", f"{o['single_tokens_per_s']:.0f}"]]), "",
        f"Ratio episode tokens/s / single-turn tokens/s: **{o['ratio']:.2f}x**. What an episode pays: one engine "
        "call per turn, the whole conversation re-encoded each turn (no KV cache kept across turns), the "
        "environment's step between turns.",
    ]
    if i is not None:
        lines += ["", f"Infra injection: {i['episodes']:.0f} arithmetic episodes played by a scripted solver, the "
                  f"calculator raising in {i['failure_rate']:.0%} of its calls (in the sandbox): "
                  f"{i['infra_retries']:.0f} episodes re-run, logged reward {i['logged_reward']:.3f}, infra "
                  f"failures in the logged numbers: **{i['infra_in_logged']:.0f}** (goal 0)."]
    return "\n".join(lines)


def reload_section(rec: dict[str, Any]) -> str:
    d = rec["data"]
    if "gb_per_s" not in d:
        return f"Skipped: {d.get('skipped', 'no data')}."
    rows = [[k, f"{d['seconds'][k]:.3f}", f"{v:.2f}"] for k, v in d["gb_per_s"].items()]
    return "\n".join([
        f"`bench_reload.py` — HFEngine in-place reload on {d['device']} of a {d['bytes'] / 1e9:.2f} GB float32 "
        f"snapshot (Llama, hidden {d['hidden']}, {d['layers']} layers) in the page cache, best of {d['repeats']}, "
        f"torch threads {d['torch_threads']}.", "",
        table(["contender", "seconds", "GB/s"], rows), "",
        f"Ratio reload / plain read into resident memory: **{d['ratio_reload_plain']:.2f}x**. The reload reads each "
        "tensor's bytes straight into its parameter (no intermediate state dict); the previous implementation "
        "(`load_file` into a state dict, then `load_state_dict`) is the 'via a state dict' row. `from_pretrained` "
        "on CPU maps the file rather than reading it, so its figure is not a read; the first reload into a freshly "
        "built model pays that mapping's page faults.",
    ])


def workers_section(rec: dict[str, Any]) -> str:
    d = rec["data"]
    rows = [[r["workers"], r["units"], f"{r['steady']:.1f}", f"{r['steady_ratio']:.2f}",
             f"{r.get('window', 0):.1f}", f"{r['e2e']:.1f}", f"{r['e2e_ratio']:.2f}"] for r in d["rows"]]
    return "\n".join([
        f"`bench_workers.py` — {d['steps']} snapshots × {d['n_prompts']} prompts in shards of {d['shard_size']} "
        f"({d['rows'][0]['units']} units), `ckpteval worker --once --engine hf`, {d['threads_per_worker']} thread "
        f"per worker, {d['cpus']} cores. Steady = units/s while every worker was busy; e2e = from launch to "
        "the last exit (Python/torch start-up included).", "",
        table(["workers", "units", "steady units/s", "ratio", "window s", "e2e units/s", "ratio"], rows), "",
        f"Scaling stops at the core count ({d['cpus']}) on an idle machine: beyond it workers only time-share "
        "the CPUs. On a machine that others load (see the load average above), the scheduler shares CPU per "
        "runnable process, so more workers also win a larger share of the cores from the other processes — "
        "ratios above the core count, or uneven steps between 1, 2 and 4 workers, come from that. The e2e column is dominated by each worker's start-up (torch + transformers "
        "import, first model build), which grows with the number of processes started at once on few cores.",
    ])


def judge_section(rec: dict[str, Any]) -> str:
    d = rec["data"]
    rows = [["cold (empty RUN/judge_cache/)", f"{d['cold_per_s']:,.1f}", d["judge_requests"]["cold"]],
            ["warm (every sample cached)", f"{d['warm_per_s']:,.1f}", d["judge_requests"]["warm"]]]
    return "\n".join([
        f"`bench_judge.py` — {d['samples']} distinct samples judged through `JudgeScorer` (the `openai` client, "
        f"{d['concurrency']} requests in flight) by the judge stand-in (`ckpteval serve --judge slow`, a real HTTP "
        f"server process whose {d['delay_ms']:g} ms per request stands in for an LLM judge's latency), twice in "
        "one run dir: cold, then warm with a fresh scorer. Baseline: cold, in the same run.", "",
        table(["cache", "samples/s", "judge requests"], rows), "",
        f"Ratio warm / cold: **{d['ratio']:.1f}x**. Cold is bounded by the judge ({d['concurrency']} in flight / "
        f"{d['delay_ms']:g} ms = {d['concurrency'] * 1000 / d['delay_ms']:.0f}/s at most) plus one fsync per cache "
        "entry (overlapped across the request pool); warm costs a key hash and one small file read per sample, "
        "and the judge is not called (its `/judge_stats` is checked). A backfill or a retried unit pays the judge "
        "only for what was not judged before; with a real LLM judge (seconds per verdict) the ratio is larger still.",
        *judge_trainer_lines(d.get("trainer")),
    ])


def judge_trainer_lines(t: dict[str, Any] | None) -> list[str]:
    if not t:
        return []
    return ["", f"The reference trainer, {t['steps']} steps, a point every {t['eval_interval']} on a judged set (32 "
            "addition prompts, `scorer: judge`, the same stand-in; fleet reuse, one `hf` worker) vs its no-eval "
            "baseline (`--save-hf` at the same interval), `bench_stall.py`'s measurement (steps/s of the training "
            "loop):", "",
            table(["run", "steps/s", "ratio"], [["no-eval + save-hf", f"{t['no_eval_steps_per_s']:.2f}", "1.00"],
                                                ["fleet reuse, judged set", f"{t['judged_steps_per_s']:.2f}",
                                                 f"{t['ratio']:.2f}"]]), "",
            f"{t['points']} points logged, skipped: {t['skipped_points'] or 'none'}. The worker and the judge share "
            "the trainer's two cores here; on a cluster they hold their own GPUs."]


def scale_section(rec: dict[str, Any]) -> str:
    d = rec["data"]
    b, s = d["baseline"], d["scale"]
    ops = [k for k in ("resume_s", "steady_s", "waiting_s", "idle_s", "worker_idle_probe_s",
                       "trainer_waiting_probe_s", "status_s", "plot_s", "status_full_s", "plot_full_s") if k in s]
    rows = [[k.removesuffix("_s").replace("_", " "), f"{b[k]:.3f}", f"{s[k]:.3f}", f"{s[k] / max(b[k], 1e-9):.1f}",
             f"< {d['goal_s']:g}" if k in ("steady_s", "status_s", "plot_s") else "-"] for k in ops]
    calls = [[kind, sum(b["syscalls"][kind].values()), sum(c.values()),
              ", ".join(f"{n} {name}" for name, n in sorted(c.items(), key=lambda x: -x[1]))]
             for kind, c in s["syscalls"].items()]
    return "\n".join([
        f"`bench_scale.py` — a synthetic run of {s['points']} points (steps 100..{s['last_step']}) × {d['datasets']} "
        f"eval sets × {d['shards']} shards = {s['units']:,} result files on {d['root']}, no model: written by "
        f"`ckpteval.coord.results.files.write_result` ({d['procs']} processes, {s['files_per_s']:,.0f} files/s: "
        f"{s['write_s']:.0f} s), every point but the last {d['pending']} ingested by `ckpteval.jobs.ingest.ingest_point` "
        f"(ledger + metrics.jsonl). Baseline: the same shape at {b['points']} points ({b['units']:,} files), same "
        f"run. Load average {load_str(d['load_at_start'])} at start, {load_str(d['load_at_end'])} at end"
        + (f"; when the {s['points']}-point timings started: {load_str(s['load'])}." if "load" in s else "."), "",
        table(["operation", f"s at {b['points']} points", f"s at {s['points']} points", "ratio", "goal s"], rows), "",
        "resume: a fresh `EvalDispatcher` (ledger replay) and its first poll, ingesting the pending points; steady: "
        "one more point's results landed; waiting: one point pending without results; idle: nothing pending; "
        "the probes: the same waiting poll and a worker's idle poll in a fresh process, after one warm-up poll; "
        "status and plot: the CLI as a user runs it (interpreter start-up included), reading the step summaries "
        "ingestion wrote; status full and plot full: the same with every summary hidden (every result file read, "
        "the path without summaries), whose printout and PNG the benchmark checks are the same.", "",
        table(["idle poll", f"syscalls at {b['points']} points", f"at {s['points']} points",
               f"by name at {s['points']} points"], calls), "", scale_notes(d),
    ])


def scale_notes(d: dict[str, Any]) -> str:
    s = d["scale"]
    if "status_full_s" not in s:  # a record from before step summaries
        return ""
    return "\n".join([
        "**Where the time goes.**",
        f"- **status and plot read a summary per step** (`results/step-<N>/step.summary`, `coord/results/summary.py`, written "
        f"by `ingest_point`): one listing per step directory, its result names fingerprinted against the summary's, "
        f"and the summary read — {s['status_s']:.2f} s and {s.get('plot_s', float('nan')):.2f} s, against "
        f"{s['status_full_s']:.1f} s and {s.get('plot_full_s', float('nan')):.1f} s reading every result file "
        "(the path of a step whose summary is missing or stale, e.g. after a retry landed). What is left: the "
        f"{s['points']} listings of {s['units'] // max(s['points'], 1)} names (about a third of a millisecond each on "
        "tmpfs; on Lustre a round trip each), the interpreter and imports, and for plot matplotlib's import, its "
        "1,000 lag bars (one patch each) and the PNG.",
        "- **status's tables**: piped or redirected (no colour), rich draws the title, header and first row of "
        "each table and the other rows are written as the same characters (`jobs/views/tables.py`; rich's "
        "per-cell layout took seconds at 1,000 rows × 21 tables); on a colour terminal rich still draws every "
        "cell.",
        *scale_compare(d),
    ])


def scale_compare(d: dict[str, Any]) -> list[str]:
    """The same benchmark on another tree (``d["other_tree"]``: its label and its bench_scale JSON)."""
    o = d.get("other_tree")
    if not o:
        return []
    s = o["data"]["scale"]
    calls = ", ".join(f"{kind} {sum(c.values())}" for kind, c in s["syscalls"].items())
    return [f"- **Measured on {o['label']}** ({s['points']} points, load {load_str(s['load'])} as its timings "
            f"started): resume {s['resume_s']:.3f} s, steady poll {s['steady_s']:.3f} s, waiting poll "
            f"{s['waiting_s']:.3f} s, worker idle poll {s['worker_idle_probe_s']:.3f} s; syscalls per idle poll: "
            f"{calls} (the same at {o['data']['baseline']['points']} points); `status` {s['status_s']:.1f} s, "
            f"`plot` {s['plot_s']:.1f} s — the polls become O(1), status and plot still read every result."]


def fleet_section(rec: dict[str, Any]) -> str:
    d = rec["data"]
    f, base, pp = d["fleet"], d["baseline"], d["per_point"]
    return "\n".join([
        f"`bench_fleet.py` — {d['workers']} real `ckpteval worker --once --engine fn:…SleepBackend` processes "
        f"({d['requested_workers']} requested; {d['fit']} fit in memory at {d['worker_rss_mb']:.0f} MB RSS each) on "
        f"{d['cpus']} cores, a run of {d['points']} points × {d['units_per_point']} units, the backend sleeping "
        f"{d['sleep_s']:g} s per unit, poll {d['poll_s']:g} s, lease {d['lease_s']:g} s. Baseline: 1 worker on the "
        f"same shape, {base['units_done']} units. Load average {load_str(d['load_at_start'])} at start, "
        f"{load_str(d['load_at_end'])} at end.", "",
        table(["measure", "value"], [
            ["units done / ok", f"{f['units_done']} / {f['units_ok']} of {d['points'] * d['units_per_point']}"
             + (" (bounded: SIGTERM at the bound)" if f["bounded"] else "")],
            ["worker exit codes", f["exit_codes"]],
            ["units evaluated twice", f"{f['duplicates']}: {len(f['by_lease_expiry'])} by lease expiry, "
             f"{len(f['not_explained_by_expiry'])} not explained by expiry"],
            ["claims per unit (`.attempts` lines → units)", f["claims_per_unit"]],
            ["claim attempts (won / lost / unit already done / seen held lately, no syscall)",
             f"{f['claims'].get('won', 0)} / {f['claims'].get('lost', 0)} / {f['claims'].get('done', 0)} / "
             f"{f['claims'].get('skipped', 0)}"],
            ["step directories listed by walks after a lost attempt (units passed over without a syscall)",
             f"{f['claims'].get('listings', 0)} ({f['claims'].get('listings', 0) / max(f['units_done'], 1):.1f} per unit)"],
            ["lost claim attempts per unit", f"{f['lost_claims_per_unit']:.2f}"],
            ["wall per point, fleet (launch → last exit)", f"{pp['fleet_e2e_s']:.2f} s"],
            ["wall per point, fleet steady (first start → last result)", f"{pp['fleet_steady_s']:.2f} s"],
            ["wall per point, 1 worker", f"{pp['one_worker_s']:.1f} s"],
            ["ratio 1 worker / fleet", f"{pp['one_worker_s'] / pp['fleet_e2e_s']:.1f}x (ideal "
             f"{d['workers']}x: {pp['ideal_s']:.2f} s per point)"],
            ["first unit started after launch", f"{f['first_start_s']:.1f} s"],
            ["memory", f"fleet peak {f['peak_rss_mb']:.0f} MB RSS, lowest MemAvailable "
             f"{f['min_mem_available_mb']:.0f} MB"],
            ["units claimed and given back without a result", f.get("dropped") or "none"],
            ["CPU of all workers (per unit written)", f"{f['cpu_s']:.0f} s = {f['cpu_s'] / f['wall_s']:.2f} of a core "
             f"over the run ({f['cpu_s_per_unit'] * 1e3:.0f} ms per unit; 1 worker: "
             f"{base['cpu_s_per_unit'] * 1e3:.0f} ms)"],
        ]), "", fleet_notes(d),
    ])


def fleet_notes(d: dict[str, Any]) -> str:
    f = d["fleet"]
    multi = sum(n for k, n in f["claims_per_unit"].items() if int(k) > 1)
    return "\n".join([
        "**Reading it.**",
        f"- **Evaluated twice**: a second evaluation leaves a `results/duplicates/` copy beside the result (first "
        f"writer wins). {f['duplicates']} here; the goal allows only lease expiry (the second evaluation started "
        "at least a lease duration after the first).",
        f"- **Claims per unit above 1** ({multi} units) are claims that ended without a result: the `.attempts` "
        "file counts every claim that passed the result check. With a bound, the SIGTERM reaches hundreds of "
        "processes on 2 cores one after another: a unit released by a worker that got it is claimed by one that "
        "has not yet, and so on (\"abandoned: stop signal\" above) — no unit was claimed twice while its holder "
        "still held it, or a second result would be in `duplicates/`." if f["bounded"] else
        f"- **Claims per unit above 1** ({multi} units): claims that ended without a result (given back, above).",
        f"- **Contention**: {f['lost_claims_per_unit']:.1f} lost claim attempts per unit written: every worker "
        "walks the open units of the oldest step in its own order (`order_units(spread=pid)`) and tries each "
        "until one claim succeeds; a lost attempt is a failed lease acquisition (the exclusive create of the lease "
        "file, and an `lstat` of it; its record is read once per marker), `done` counts units whose result "
        "appeared since the worker's listing, and a unit a worker found held within the last `heartbeat_s / 2` is "
        "refused without a syscall (`skipped`). After its first lost attempt in a step a walk lists that step's "
        "lease (or result) directory once and passes over the units listed there, except the few it watches "
        "for expiry (`UnitClaimer.claim_next`): 122 lost attempts per unit before that change, same bench.",
        f"- **Throughput**: the workers' own CPU was {f['cpu_s'] / f['wall_s']:.2f} of a core on average, so "
        "what limited the fleet here was not their Python but the machine: hundreds of processes' start-up "
        f"(the first unit started {f['first_start_s']:.0f} s after launch), the scheduler on 2 cores shared with "
        "other engineers and, likely, the fsyncs of every claim and result on the shared disk (not separated "
        "here). On a cluster each worker "
        "has its own node and the filesystem's metadata server is the shared part (issue 20 part 1).",
        *fleet_compare(d),
    ])


def fleet_compare(d: dict[str, Any]) -> list[str]:
    """The same fleet with its run dir on tmpfs (no fsync cost), when a second run was recorded with it."""
    t = d.get("tmpfs_run")
    if not t:
        return []
    f, tf = d["fleet"], t["fleet"]
    return [f"- **The same fleet on tmpfs** (run dir in /dev/shm, so no fsync waits; load "
            f"{load_str(t['load_at_start'])} at start): {tf['units_done']} units in the same bound instead of "
            f"{f['units_done']} ({tf['units_done'] / max(f['units_done'], 1):.1f}x), "
            f"{t['per_point']['fleet_e2e_s']:.2f} s per point ({t['per_point']['one_worker_s'] / t['per_point']['fleet_e2e_s']:.1f}x "
            f"1 worker), workers' CPU {tf['cpu_s'] / tf['wall_s']:.2f} of a core ({tf['cpu_s_per_unit'] * 1e3:.0f} ms per "
            f"unit), {tf['lost_claims_per_unit']:.1f} lost claims per unit, evaluated twice {tf['duplicates']}. "
            "Consistent with fsync waits on the shared disk limiting the ext4 run, though that run also started "
            "at a higher load (the two are not separated). Per unit the fleet spends about 3x one worker's CPU: "
            "the lost claims, a `stat` per unit finished since the worker's listing, and every worker re-reading "
            "every result the others write (each has its own `ResultIndex`), so the fleet's reads grow as "
            "workers × results."]


SECTIONS: dict[str, tuple[str, Callable[..., str]]] = {
    "stall": ("Trainer stall and latency", stall_section),
    "export": ("Export", export_section),
    "coord": ("Coordination at scale", coord_section),
    "metadata": ("Metadata operations per unit (the Lustre MDS budget)", metadata_section),
    "engine": ("Engine batching", engine_section),
    "grader": ("Math grader", grader_section),
    "sandbox": ("Code sandbox", sandbox_section),
    "reload": ("Engine reload", reload_section),
    "reload_cuda": ("Engine reload on CUDA", reload_section),
    "workers": ("Eval workers", workers_section),
    "judge": ("Judge throughput, verdict cache cold vs warm", judge_section),
    "envs": ("Environments (multi-turn episodes)", envs_section),
    "scale": ("Production-sized run dir (1,000 points)", scale_section),
    "fleet": ("Many workers", fleet_section),
}


def report(mach: dict[str, Any], results: dict[str, dict[str, Any]], crc: dict[str, float] | None,
           total_s: float, quick: bool) -> str:
    out = ["# ckpteval benchmark results", "",
           f"Written by `make bench` (`bench/run_all.py`{' --quick' if quick else ''}) on {mach['date']}, "
           f"commit {mach['commit']}{' + uncommitted changes' if mach.get('dirty') else ''}, in {total_s / 60:.1f} min. Every benchmark measures its baseline in the "
           "same run; targets are goals, not assertions.", "",
           "## Machine", "",
           table(["", ""], [
               ["CPU", f"{mach['cpus']} × {mach['cpu_model']}"],
               ["RAM", f"{mach['ram_gib']} GiB"],
               ["/dev/shm", mach["fs_dev_shm"]],
               [f"run dirs ({mach['run_root']})", mach["fs_run_root"]],
               ["kernel / python / torch", f"{mach['kernel']} / {mach['python']} / {mach['torch']}"],
               ["load average at start (1, 5, 15 min)", load_str(mach["load_at_start"])],
               ["load average at end", load_str(mach["load_at_end"])],
           ]), "",
           "The machine is shared with other engineers' test runs; each section's load average at its start is "
           "listed with it. Numbers on a loaded 2-core machine are noisy: read ratios, not absolutes.", "",
           *[f"Re-measured with `--only {m['names']} --merge` on {m['date']}, commit {m['commit']}"
             f"{' + uncommitted changes' if m.get('dirty') else ''} (load average {load_str(m['load_at_start'])} at "
             f"start, {load_str(m['load_at_end'])} at end): those sections; the machine table above is the full "
             "run's.\n" for m in mach.get("merged", [])],
           "## Goals", "",
           table(["measure", "result", "baseline", "ratio", "goal", ""], goals(results))]
    for name, (title, fn) in SECTIONS.items():
        if name not in results:
            continue
        rec = results[name]
        out += ["", f"## {title}", "",
                f"_`{rec['script']} {' '.join(rec['args'])}` — {rec['seconds']:.0f} s, load average at start "
                f"{load_str(rec['load_at_start'])}_", ""]
        if "data" in rec:
            out.append(fn(rec, crc) if name == "export" else fn(rec, mach["cpus"]) if name == "stall" else fn(rec))
        else:
            out.append(f"**Failed:** {rec['error']} (see the `make bench` output).")
    if "stall" in results or "workers" in results:
        out += ["", "Not run: `bench/bench_trainer.py` (one no-eval vs fleet pair with 1 worker) — "
                "`bench_stall.py` measures the same quantity in more configurations."]
    return "\n".join(out) + "\n"


def merged(old: dict[str, Any], new: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """``old`` raw results with ``names`` replaced by ``new``'s; the re-measurement is noted in the machine."""
    out = {**old, "results": {**old["results"], **{n: new["results"][n] for n in names}}}
    if "export" in names:
        out["crc"] = new["crc"]
    m = new["machine"]
    note = {"names": ",".join(names), "date": m["date"], "commit": m["commit"], "dirty": m.get("dirty"),
            "load_at_start": m["load_at_start"], "load_at_end": m["load_at_end"]}
    kept = [n for n in old["machine"].get("merged", []) if n["names"] != note["names"]]
    out["machine"] = {**old["machine"], "merged": [*kept, note]}
    return out


def sections(md: str) -> list[tuple[str, str]]:
    """``md`` cut at its ``## `` headings: (title, text) pairs; the text before the first heading has title ""."""
    parts = re.split(r"(?m)^(?=## )", md)
    return [(part.splitlines()[0][3:].strip() if part.startswith("## ") else "", part) for part in parts if part]


def keep_written(new_md: str, old_md: str, replaced: set[str]) -> str:
    """``new_md`` (a full report) laid over ``old_md``: the header and the ``replaced`` sections (titles) are the
    new ones; every other section of the old file stays as it was, in its place — the hand-written ones
    (a benchmark run by hand, notes) and generated ones not re-measured; new sections go last."""
    fresh = dict(sections(new_md))
    out = [fresh.get("", "")]
    seen = {""}
    for title, text in sections(old_md):
        if title in seen:
            continue
        seen.add(title)
        out.append(fresh[title] if title in fresh and (title in replaced or title in ("Machine", "Goals")) else text)
    out += [text for title, text in sections(new_md) if title not in seen]
    return "".join(part if part.endswith("\n") else part + "\n" for part in out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke test of the pipeline")
    ap.add_argument("--only", help=f"comma list of {','.join(BENCHES)}")
    ap.add_argument("--out", type=Path, default=BENCH / "RESULTS.md")
    ap.add_argument("--run-root", type=Path, default=Path(tempfile.gettempdir()),
                    help="where benchmark run dirs go (local disk; staging always on /dev/shm)")
    ap.add_argument("--merge", action="store_true",
                    help="with --only: replace only those benchmarks' results in the existing RESULTS.json next to "
                         "--out (the others keep theirs) and, in --out, only their sections, the header and the goals "
                         "(every other section, hand-written ones included, stays as it is)")
    ap.add_argument("--render", type=Path, metavar="JSON",
                    help="only rewrite --out from the raw results a previous run saved (RESULTS.json)")
    args = ap.parse_args(argv)
    if args.render:
        raw = json.loads(args.render.read_text())
        args.out.write_text(report(raw["machine"], raw["results"], raw["crc"], raw["total_s"], raw["quick"]))
        print(f"wrote {args.out} from {args.render}")
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    names = list(BENCHES) if not args.only else args.only.split(",")
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        ap.error(f"unknown benchmark(s) {unknown}; choose from {list(BENCHES)}")
    if args.merge and (not args.only or not args.out.with_suffix(".json").is_file()):
        ap.error(f"--merge needs --only and an earlier {args.out.with_suffix('.json')}")
    if shutil.which("strace") is None and {"coord", "metadata"} & set(names):
        print("strace not found (make bench installs it): the idle-poll and metadata counts will fail",
              file=sys.stderr)
    mach = machine(args.run_root)
    print(f"ckpteval bench: {mach['cpus']} cpus, {mach['ram_gib']} GiB, load average "
          f"{load_str(mach['load_at_start'])}; /dev/shm {mach['fs_dev_shm']}; run dirs {mach['fs_run_root']}")
    t0 = time.perf_counter()
    results = {}
    with tempfile.TemporaryDirectory(prefix="ckpteval-bench-json-") as tmp:
        for name in names:
            results[name] = run_bench(name, args.quick, args.run_root, Path(tmp))
    crc = checksum_speeds(32 if args.quick else 256) if "export" in names else None
    mach["load_at_end"] = os.getloadavg()
    total = time.perf_counter() - t0
    raw = {"machine": mach, "results": results, "crc": crc, "total_s": total, "quick": args.quick}
    if args.merge:
        raw = merged(json.loads(args.out.with_suffix(".json").read_text()), raw, names)
        mach, results, crc, total = raw["machine"], raw["results"], raw["crc"], raw["total_s"]
    args.out.with_suffix(".json").write_text(json.dumps(raw, indent=1))
    text = report(mach, results, crc, total, args.quick)
    if args.merge and args.out.is_file():  # the sections not re-measured, hand-written ones included, stay
        text = keep_written(text, args.out.read_text(), {SECTIONS[n][0] for n in names if n in SECTIONS})
    args.out.write_text(text)
    print("\n=== goals")
    for row in goals(results):
        print("  " + " | ".join(f(c) for c in row))
    print(f"\nwrote {args.out} and {args.out.with_suffix('.json')} (raw numbers) in {total / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
