"""Every bad input is one clear line: a sweep over every subcommand with bad values for every flag.

Each case runs ``ckpteval.jobs.cli`` as ``__main__`` in a real process of its own (a fork of one interpreter warmed
up as ``python -m ckpteval.jobs.cli`` is, :mod:`tests.support.forkcli`: the same output, without the start-up
per case) in its own copy of a sandbox (a valid run,
broken runs, files where dirs belong, malformed eval configs) and must end with exit 2, exactly one
line on stderr (the convention of every ``ckpteval`` parser and check: ``prog: what is wrong``; no
argparse usage block), no traceback anywhere, and the sandbox tree unchanged (nothing created,
written or touched, but a worker's refusal record ``RUN/CONFIG_REFUSED``, which tells the trainer not to wait). Most cases fail in argument parsing, before torch is imported.

Run as a script to count a checkout's behaviour (the figures in bench/CHAOS.md)::

    python -m tests.test_bad_inputs [--repo DIR]

Also here: the manifest's sampling-setting validation, the trust rule for code named by run.json
(a group-writable run.json), files created under a tight umask, an unreadable and a read-only run dir
(run as user nobody: the tests run as root, who reads and writes everything), and a staging dir the
filesystem refuses (``/proc``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shlex
import shutil
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from ckpteval.coord.run.manifest import parse_manifest
from ckpteval.coord.run.rundir import RunDir
from tests.support.forkcli import ForkCli
from tests.support.workers import REPO, make_eval_run, publish_as_trainer

CASE_TIMEOUT_S = 60.0  # generous: a case that runs this long is a silent accept
TRUST_SCORER = "tests.support.workers:digit_overlap"
FN = "fn:tests.support.workers:SumBackend"

# ----------------------------------------------------------------------------------------- sandbox


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj))


def _edit_manifest(run: RunDir, **dataset: object) -> None:
    obj = json.loads(run.manifest_path.read_text())
    obj["eval"]["datasets"][0].update(dataset)
    run.manifest_path.write_text(json.dumps(obj))  # json writes NaN/Infinity literals, as a hand edit would


def build_sandbox(root: Path) -> Path:
    """Everything the cases point at: good and broken runs, files, eval configs."""
    root.mkdir(parents=True, exist_ok=True)
    make_eval_run(root, n_prompts=4, shard_size=2, name="run")
    (root / "empty").mkdir()
    (root / "file.txt").write_text("not a directory\n")
    (root / "torn.json").write_text("{torn")
    _edit_manifest(make_eval_run(root, n_prompts=4, shard_size=2, name="nan_run"), temperature=math.nan)
    _edit_manifest(make_eval_run(root, n_prompts=4, shard_size=2, name="inf_run"), temperature=math.inf)
    _edit_manifest(make_eval_run(root, n_prompts=4, shard_size=2, name="topk0_run"), top_k=0)
    _edit_manifest(make_eval_run(root, n_prompts=4, shard_size=2, name="topp_run"), top_p=1.5)
    _edit_manifest(make_eval_run(root, n_prompts=4, shard_size=2, name="tokens_run"), max_new_tokens=-1)
    _edit_manifest(make_eval_run(root, n_prompts=4, shard_size=2, name="typo_run"), temprature=0.7)  # issue 22 §4
    (make_eval_run(root, n_prompts=4, shard_size=2, name="done_run").done_path).write_text("{torn")
    (make_eval_run(root, n_prompts=4, shard_size=2, name="rows_run").data / "addition.jsonl").write_text("{torn\n")
    trust = make_eval_run(root, n_prompts=4, shard_size=2, name="trust_run", scorer=TRUST_SCORER)
    trust.manifest_path.chmod(trust.manifest_path.stat().st_mode | stat.S_IWGRP)
    (root / "dir_manifest_run").mkdir()
    (root / "dir_manifest_run" / "run.json").mkdir()
    results_file = make_eval_run(root, n_prompts=4, shard_size=2, name="results_file_run")
    shutil.rmtree(results_file.results)
    results_file.results.write_text("not a directory\n")
    metrics = make_eval_run(root, n_prompts=4, shard_size=2, name="metrics_run")
    metrics.metrics_path.write_text('{"step": 1}\n{torn\n{"step": 2}\n')
    # eval configs for --eval-config (worker service and submit service)
    (root / "qa.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                                           for i in range(3)))
    (root / "bad_rows.jsonl").write_text('{"prompt": 1}\n')
    ds = {"name": "qa", "path": "qa.jsonl", "n_prompts": 3}
    _write_json(root / "cfg_ok.json", {"eval": {"datasets": [ds]}})
    _write_json(root / "cfg_no_eval.json", {"datasets": [ds]})
    _write_json(root / "cfg_missing_data.json", {"eval": {"datasets": [{**ds, "path": "nope.jsonl"}]}})
    _write_json(root / "cfg_bad_rows.json", {"eval": {"datasets": [{**ds, "path": "bad_rows.jsonl"}]}})
    _write_json(root / "cfg_count.json", {"eval": {"datasets": [{**ds, "n_prompts": 5}]}})
    (root / "cfg_nan.json").write_text(json.dumps({"eval": {"datasets": [{**ds, "temperature": math.nan}]}}))
    _write_json(root / "cfg_typo.json", {"eval": {"datasets": [{**ds, "max_new_token": 4}]}})  # issue 22 §4
    _write_json(root / "cfg_top_typo.json", {"eval": {"datasets": [ds]}, "leases": {}})
    _write_json(root / "cfg_split.json", {"eval": {"datasets": [{**ds, "n_samples": 4, "samples_per_unit": 3}]}})
    for name, entry in NEWCOMER_CONFIGS.items():  # issue 38: the configuration mistakes a newcomer makes
        lm_eval = entry.get("kind") == "lm_eval"  # takes no path or n_prompts
        _write_json(root / f"cfg_{name}.json", {"eval": {"datasets": [{"name": "qa", **entry} if lm_eval else {**ds, **entry}]}})
    _write_json(root / "cfg_base_missing.json", {"eval": {"base_model": "/no/such/base", "datasets": [ds]}})
    _write_json(root / "cfg_no_datasets.json", {"eval": {"datasets": []}})
    _write_json(root / "cfg_same_name.json", {"eval": {"datasets": [ds, ds]}})
    (root / "ckpts").mkdir()
    (root / "model").mkdir()  # enough for serve to get past its model check to the port and host checks
    (root / "model" / "config.json").write_text("{}")
    (root / "sbatch_empty").mkdir()
    return root


# ------------------------------------------------------------------------------------------- cases
NEWCOMER_CONFIGS: dict[str, dict[str, object]] = {  # one dataset entry's mistake -> cfg_<name>.json
    "scorer_typo": {"scorer": "exct"},
    "scorer_module": {"scorer": "no_such_module_xyz:score"},
    "kind_typo": {"kind": "lm-eval"},
    "task_typo": {"kind": "lm_eval", "tasks": ["hellaswg_xyz"]},  # an entry of its own (below)
    "env_unknown": {"kind": "env", "env": "no_such_env_xyz"},
    "reasoning_typo": {"reasoning": {"ends": "</think>"}},
    "samples_zero": {"n_samples": 0},
    "template_typo": {"chat_template": "yes please"},
}
# (config, what its one line must name): each through every program that reads an eval config
NEWCOMER_MISTAKES = {
    "nope": "nope.json", "torn": "torn.json", "missing_data": "nope.jsonl", "typo": "max_new_token",
    "scorer_typo": "exct", "scorer_module": "no_such_module_xyz", "kind_typo": "lm-eval", "task_typo": "hellaswg_xyz",
    "env_unknown": "no_such_env_xyz", "reasoning_typo": "ends", "samples_zero": "n_samples",
    "template_typo": "chat_template", "base_missing": "/no/such/base", "no_datasets": "datasets",
    "same_name": "qa",
}
NEWCOMER_PROGRAMS = {
    "train": "train --run-dir {S}/new --eval-config {S}/%s.json",
    "worker": "worker --run-dir {S}/new --watch {S}/ckpts --eval-config {S}/%s.json",
    "backfill": "backfill --run-dir {S}/new --watch {S}/ckpts --eval-config {S}/%s.json",
    "submit": "submit service --run-dir {S}/new --watch {S}/ckpts --eval-config {S}/%s.json --dry-run",
}


def newcomer_cases() -> dict[str, str]:
    """Every newcomer configuration mistake through every program: case -> what its line must name."""
    return {program % (f"cfg_{name}" if name not in ("nope", "torn") else name): named
            for name, named in NEWCOMER_MISTAKES.items() for program in NEWCOMER_PROGRAMS.values()}


SHAPES = {  # bad values for each kind of flag value (each hits a different check)
    "int>=1": ["0", "x"],
    "int>=0": ["-1", "1.5"],
    "float>0": ["-1", "nan", "x"],
    "float>=0": ["-5", "inf"],
}


def _flag_cases(prefix: str, flags: dict[str, str]) -> list[str]:
    return [f"{prefix} {flag} {value}" for flag, shape in flags.items() for value in SHAPES[shape]]


def _no_value(prefix: str, *flags: str) -> list[str]:
    """Free-form flags (any string is a valid value; sbatch judges its own): given without a value."""
    return [f"{prefix} {flag}" for flag in flags]


def worker_cases(cmd: str) -> list[str]:
    """``worker`` and ``backfill`` share their flags (backfill fixes --once/--catchup)."""
    base = f"{cmd} --run-dir {{S}}/run"
    cases = [
        f"{cmd}",  # --run-dir missing
        f"{cmd} --run-dir {{S}}/nope",
        f"{cmd} --run-dir {{S}}/file.txt",
        f"{cmd} --run-dir {{S}}/empty",
        f"{cmd} --run-dir {{S}}/dir_manifest_run",
        f"{cmd} --run-dir {{S}}/nan_run",
        f"{cmd} --run-dir {{S}}/inf_run",
        f"{cmd} --run-dir {{S}}/topk0_run",
        f"{cmd} --run-dir {{S}}/topp_run",
        f"{cmd} --run-dir {{S}}/tokens_run",
        f"{cmd} --run-dir {{S}}/typo_run",
        f"{cmd} --run-dir {{S}}/done_run",
        f"{cmd} --run-dir {{S}}/rows_run",
        f"{cmd} --run-dir {{S}}/trust_run --engine {FN}",  # group-writable run.json naming a scorer
        f"{cmd} --run-dir {{S}}/results_file_run --engine {FN}",
        f"{base} --engine bogus",
        f"{base} --engine http:",
        f"{base} --engine http://",  # issue 22 §2: a URL without a host
        f"{base} --engine http:host:port",
        f"{base} --engine fn:",
        f"{base} --engine hf:extra",
        f"{base} --engine fn:no_such_module_xyz:Cls",
        f"{base} --engine {FN} --engines 2",
        f"{base} --device bogus",
        f"{base} --device cuda:x",
        f"{base} --verify bogus",
        f"{base} --watch {{S}}/file.txt",
        f"{base} --eval-config {{S}}/cfg_ok.json",  # without --watch
        f"{cmd} --run-dir {{S}}/new --watch {{S}}/ckpts --eval-config {{S}}/nope.json",
        f"{cmd} --run-dir {{S}}/new --watch {{S}}/ckpts --eval-config {{S}}/torn.json",
        f"{cmd} --run-dir {{S}}/new --watch {{S}}/ckpts --eval-config {{S}}/cfg_no_eval.json",
        f"{cmd} --run-dir {{S}}/new --watch {{S}}/ckpts --eval-config {{S}}/cfg_missing_data.json",
        f"{cmd} --run-dir {{S}}/new --watch {{S}}/ckpts --eval-config {{S}}/cfg_bad_rows.json",
        f"{cmd} --run-dir {{S}}/new --watch {{S}}/ckpts --eval-config {{S}}/cfg_count.json",
        f"{cmd} --run-dir {{S}}/new --watch {{S}}/ckpts --eval-config {{S}}/cfg_nan.json",
        f"{cmd} --run-dir {{S}}/new --watch {{S}}/ckpts --eval-config {{S}}/cfg_typo.json",
        f"{cmd} --run-dir {{S}}/new --watch {{S}}/ckpts --eval-config {{S}}/cfg_top_typo.json",
        f"{cmd} --run-dir {{S}}/new --watch {{S}}/ckpts --eval-config {{S}}/cfg_split.json",  # issue 20 §2
        f"{cmd} --run-dir {{S}}/file.txt --watch {{S}}/ckpts --eval-config {{S}}/cfg_ok.json",
        f"{base} --wandb",  # without --wandb-run-id
        f"{base} --wandb-mode bogus",
        f"{base} --newest-first=yes",
        f"{base} --trust-run-code=yes",
        f"{base} --unsafe-code-rlimits-only=yes",
        f"{base} --no-keep-completions=yes",
        f"{base} --judge-url ftp://judge:8000/v1",
        f"{base} --bogus-flag",
    ]
    cases += _no_value(base, "--worker-id", "--wandb-run-id", "--engine", "--watch", "--eval-config", "--judge-url",
                       "--completion-store")
    if cmd == "worker":
        cases += [f"{base} --catchup bogus", f"{base} --once=yes", f"{base} --retry-infra-skips=yes"]
    else:
        cases += [f"{base} --once", f"{base} --catchup all",  # backfill fixes these: not its flags
                  f"{base} --steps 5",  # --steps without --from-run
                  "backfill --run-dir {S}/new --from-run {S}/nope --eval-config {S}/file.txt",
                  f"{base} --order bogus", f"{base} --until 'eval/addition => 1'",
                  f"{base} --until 'eval/nope >= 1'", f"{base} --until 'eval/addition >= 1' --order descending",
                  f"{base} --until 'eval/addition >= 1' --newest-first", f"{base} --until"]
    cases += [f"{base} --layout bogus", f"{base} --layout"]
    return cases + _flag_cases(base, {
        "--engines": "int>=1", "--max-units": "int>=1", "--quiescence": "float>=0", "--poll-interval": "float>0",
        "--pin-timeout": "float>0", "--load-timeout": "float>0", "--max-unhealthy": "int>=0", "--max-attempts": "int>=1", "--wait-for-run": "float>=0",
        "--sandbox-concurrency": "int>=0",
        "--canary-max-diff": "float>=0", "--retry-backoff": "float>=0",
    })


def train_cases() -> list[str]:
    base = "train --run-dir {S}/new"
    return [
        "train",
        "train --run-dir {S}/file.txt",
        "train --run-dir {S}/file.txt/sub",
        "train --run-dir {S}/run",  # holds a run, no --resume
        "train --run-dir {S}/dir_manifest_run --resume",
        "train --run-dir {S}/nan_run --resume",
        f"{base} --arch bogus",
        f"{base} --lr-schedule bogus",
        f"{base} --run-id 'bad id!'",
        f"{base} --resume=yes",
        f"{base} --no-progress=yes",
        f"{base} --no-eval=yes",
        f"{base} --eval-overflow-policy bogus",
        f"{base} --eval-posture bogus",
        f"{base} --save-hf {{S}}/new/hf",  # without --save-interval
        f"{base} --save-hf {{S}}/file.txt --save-interval 5",
        f"{base} --save-hf {{S}}/new/hf --save-interval 5 --eval-interval 7",
        f"{base} --eval-staging-dir {{S}}/file.txt",
        f"{base} --eval-staging-dir {{S}}/new/snaps --save-hf {{S}}/new/hf --save-interval 5",
        f"{base} --eval-max-in-flight 3 --eval-keep-snapshots 2",
        f"{base} --lease-heartbeat 100",
        f"{base} --eval-config {{S}}/nope.json",
        f"{base} --eval-config {{S}}/cfg_typo.json",  # issue 22 §4: checked before training starts
        f"{base} --eval-samples -1",
        f"{base} --lora-rank 0",
        f"{base} --untied-lm-head=yes",
        f"{base} --lora=yes",
        f"{base} --no-eval-at-start=yes",
        f"{base} --eval-fleet bogus",
        f"{base} --eval-staging-dir /dev/shm/ckpteval-bad-inputs --trainer-nodes a --fleet-nodes b",
        f"{base} --bogus-flag",
        f"{base} --wandb=yes",
        f"{base} --eval-best-metric loss",
        f"{base} --eval-stop-when 'loss < 1'",
        f"{base} --eval-stop-when 'eval/nope >= 1'",
        f"{base} --no-eval --eval-stop-when 'eval/addition >= 1'",
        f"{base} --eval-stop-plateau 'eval/nope over 3'",  # #40: a plateau rule and adaptive evaluation
        f"{base} --eval-stop-plateau 'eval/addition over 0'",
        f"{base} --no-eval --eval-stop-plateau 'eval/addition over 3'",
        f"{base} --eval-adaptive 'eval/nope mde 0.05'",
        f"{base} --eval-adaptive 'eval/addition mde 2'",
        f"{base} --eval-adaptive 'eval/addition budget 0.1'",
        *_no_value(base, "--run-id", "--eval-staging-dir", "--trainer-nodes", "--eval-best-metric",
                   "--eval-stop-when", "--eval-stop-plateau", "--eval-adaptive"),
    ] + _flag_cases(base, {
        "--steps": "int>=1", "--batch-size": "int>=1", "--lr": "float>0", "--warmup-steps": "int>=0",
        "--seed": "int>=0", "--log-interval": "int>=1", "--ckpt-interval": "int>=1", "--threads": "int>=1",
        "--eval-interval": "int>=1", "--save-interval": "int>=1", "--eval-max-in-flight": "int>=1",
        "--eval-keep-snapshots": "int>=1", "--eval-n-prompts": "int>=1", "--eval-shard-size": "int>=1",
        "--eval-poll-interval": "float>=0", "--eval-backpressure-timeout": "float>=0",
        "--eval-drain-timeout": "float>=0", "--lease-duration": "float>0", "--lease-heartbeat": "float>0",
        "--eval-keep-best": "int>=0",
    })


def decide_cases() -> list[str]:
    """``compare`` and ``best`` over runs without (complete) points, and bad flags."""
    best = "best {S}/run --metric eval/addition"
    return [
        "compare", "compare {S}/nope --steps 1 2", "compare {S}/file.txt --steps 1 2", "compare {S}/run --steps 1",
        "compare {S}/run --steps 1 2", "compare {S}/run {S}/run --step x", "compare {S}/run {S}/run --step 1",
        "compare {S}/run {S}/run --best", "compare {S}/run {S}/run --best --metric bogus",
        "compare {S}/run --steps 1 2 --level 2", "compare {S}/run --steps 1 2 --json=yes",
        "compare {S}/run {S}/run {S}/run", "compare {S}/run --steps 1 2 --metric",
        "best", "best {S}/run", "best {S}/nope --metric eval/addition", "best {S}/run --metric eval/nope",
        "best {S}/run --metric eval/addition/pass@3", "best {S}/run --metric eval/addition/pass^1",
        "compare {S}/run {S}/run --best --metric eval/addition/pass^2", best, f"{best} --higher-is-better --lower-is-better",
        f"{best} --level 0", f"{best} --json=yes", f"{best} --wandb-run-id", f"{best} --higher-is-better=yes",
        f"{best} --lower-is-better=yes", f"{best} --power 1", f"{best} --allow-engine-mismatch=yes",
        "compare {S}/run --steps 1 2 --power 0", "compare {S}/run --steps 1 2 --scoring",
        "compare {S}/run --steps 1 2 --allow-engine-mismatch=yes", f"{best} --allow-scorer-mismatch=yes",
        "compare {S}/run --steps 1 2 --allow-scorer-mismatch=yes",
        "compare {S}/run --steps 1 2 --budget x", "compare {S}/run --steps 1 2 --budget 0",
        "compare {S}/run --steps 1 2 --budget 64",
    ]


def view_cases() -> list[str]:
    cases = []
    for cmd in ("status", "plot -o {S}/out.png"):
        cases += [f"{cmd} {{S}}/{name}" for name in (
            "nope", "file.txt", "empty", "dir_manifest_run", "nan_run", "results_file_run", "metrics_run")]
    return cases + [
        "status",
        "status {S}/run --json=yes",
        "status {S}/run --bogus-flag",
        "status {S}/run --scoring",
        "plot {S}/run -o {S}/out.png --scoring",
        "plot {S}/run -o {S}/out.png --wandb-run-id",
        "plot {S}/run -o {S}/nope/out.png",
        "plot {S}/run -o {S}/empty",
        "plot {S}/run --output {S}/out.xyz",
        "plot {S}/run -o {S}/file.txt/out.png",
        "plot",
        "worker {S}/run --run-dir {S}/empty --engine hf",  # two different run dirs
        "backfill {S}/run --run-dir {S}/empty",
        "train {S}/new --run-dir {S}/new2",
        "demo {S}/new --run-dir {S}/new2",
        "status --run-dir {S}/nope",
        "status {S}/run --run-dir {S}/empty",  # two different run dirs
        "status {S}/run {S}/nope",  # several runs, one missing
        "status {S}/run {S}/run --run-dir {S}/run",  # several runs and --run-dir
        "plot {S}/run {S}/file.txt -o {S}/out.png",
        "plot --run-dir {S}/file.txt -o {S}/out.png",
        "plot -o {S}/out.png",  # no run dir either way
        *_no_value("status", "--run-dir"),
        *_no_value("plot -o {S}/out.png", "--run-dir"),
    ] + _flag_cases("status {S}/run", {"--watch": "float>0"})


def serve_cases() -> list[str]:
    base = "serve --model {S}/model"
    return [
        "serve",
        "serve --model {S}/nope",
        "serve --model {S}/file.txt",
        "serve --model {S}/empty",
        f"{base} --engine bogus",
        f"{base} --port -1",
        f"{base} --port 70000",
        f"{base} --port x",
        f"{base} --port {{PORT}}",  # in use
        f"{base} --host no-such-host.invalid --port 0",
        f"{base} --device bogus",
        f"{base} --dtype bogus",
        f"{base} --verbose=yes",
        f"{base} --enable-deterministic-inference=yes",
        f"{base} --bogus-flag",
        "serve --judge bogus",
        "serve --judge exact --judge-delay -1",
        "serve --judge exact --judge-delay x",
        *_no_value(base, "--weight-version", "--host", "--api-key", "--admin-api-key", "--attention-backend"),
        *_no_value("serve --judge exact", "--served-model-name"),
    ] + _flag_cases(base, {"--max-batch-size": "int>=1", "--max-queued-requests": "int>=0",
                           "--max-total-tokens": "int>=1", "--logprob-offset": "float>=0"})


def submit_cases() -> list[str]:
    kinds = {
        "train-eval": "submit train-eval --run-dir {S}/new --dry-run",
        "backfill": "submit backfill --run-dir {S}/run --dry-run",
        "service": "submit service --run-dir {S}/new --watch {S}/ckpts --eval-config {S}/cfg_ok.json --dry-run",
    }
    cases = ["submit", "submit bogus-kind"]
    for base in kinds.values():
        cases += [
            f"{base} --python {{S}}/nope/python",
            f"{base} --python {{S}}/file.txt",
            f"{base} --python no-such-python-xyz",
            f"{base} --engine bogus",
            f"{base} --engine fn:",
            f"{base} --device bogus",
            f"{base} --env NOEQUALS",
            f"{base} --env 1X=2",
            f"{base} --sbatch-arg nodash",
            f"{base} --sbatch-dir {{S}}/sbatch_empty",
            f"{base} --worker-arg=--poll-interval=-1",
            f"{base} --worker-arg=--bogus-flag",
            f"{base} --dry-run=yes",
            f"{base} --judge-url ftp://judge/v1",
            f"{base} --bogus-flag",
            *_no_value(base, "--partition", "--account", "--qos", "--time", "--job-name", "--output", "--mem",
                       "--constraint"),
        ] + _flag_cases(base, {"--workers": "int>=1", "--gpus-per-worker": "int>=0", "--cpus": "int>=1",
                               "--signal-before": "int>=1", "--grace": "int>=1"})
    te, bf, sv = kinds["train-eval"], kinds["backfill"], kinds["service"]
    cases += [
        "submit train-eval --dry-run",
        "submit train-eval --run-dir {S}/run --dry-run",  # holds a run: the trainer would refuse it
        "submit train-eval --run-dir {S}/file.txt --dry-run",
        f"{te} -- --steps 0",
        f"{te} -- --eval-poll-interval -1",
        f"{te} -- --bogus-flag",
        f"{te} --workers 1 --fleet-nodes 2",
        *_no_value(te, "--train-cmd", "--trainer-mem", "--trainer-partition", "--fleet-partition"),
        f"{te} --judge-model /m --judge-cmd 'x --port {{{{port}}}}'",  # two judge servers
        f"{te} --judge-model /m --judge-url http://j:1/v1",  # launch one and attach to another
        f"{te} --judge-cmd 'serve-something'",  # no {port}
        f"{te} --judge-model /m --judge-gpus 0",
        f"{te} --judge-model /m --judge-cpus x",
        *_no_value(te, "--judge-model", "--judge-cmd", "--judge-mem", "--judge-partition", "--judge-url"),
        "submit backfill --run-dir {S}/nope --dry-run",
        "submit backfill --run-dir {S}/empty --dry-run",
        f"{bf} --backfill-cmd bogus",
        f"{bf} --steps 5",  # --steps without --from-run
        f"{bf} --eval-config {{S}}/cfg_ok.json",  # --eval-config without --from-run
        "submit backfill --run-dir {S}/new --from-run {S}/nope --eval-config {S}/cfg_ok.json --dry-run",
        "submit service --run-dir {S}/new --watch {S}/ckpts --dry-run",  # no run.json, no --eval-config
        "submit service --run-dir {S}/new --watch {S}/ckpts --eval-config {S}/nope.json --dry-run",
        "submit service --run-dir {S}/new --watch {S}/ckpts --eval-config {S}/torn.json --dry-run",
        "submit service --run-dir {S}/new --watch {S}/ckpts --eval-config {S}/cfg_missing_data.json --dry-run",
        "submit service --run-dir {S}/new --watch {S}/ckpts --eval-config {S}/cfg_bad_rows.json --dry-run",
        "submit service --run-dir {S}/new --watch {S}/ckpts --eval-config {S}/cfg_nan.json --dry-run",
        "submit service --run-dir {S}/new --watch {S}/file.txt --eval-config {S}/cfg_ok.json --dry-run",
        f"{sv} -- --poll-interval 0",
        f"{sv} --workers 1 --nodes 2",
        "submit train-eval --run-dir '{S}/my run' --dry-run",  # sbatch would split its #SBATCH --output line
        f"{bf} --output '{{S}}/my logs/%j.out'",
        f"{sv} --job-name 'my job'",
        f"{te} --partition 'a b'",
        f"{te} --time banana",
        f"{te} --time 00:04:00",  # not longer than the default --signal-before 300: a requeue loop
        f"{bf} --time 1:00 --signal-before 120",
        "submit service --run-dir {S}/new --watch {S}/ckpts --eval-config {S}/cfg_nan.json",  # no --dry-run
    ]
    cases += _flag_cases(te, {"--trainer-cpus": "int>=1", "--trainer-gpus": "int>=0", "--fleet-nodes": "int>=1"})
    cases += _flag_cases(bf, {"--tasks": "int>=1", "--parallelism": "int>=1"})
    return cases + _flag_cases(sv, {"--nodes": "int>=1"})


def demo_cases() -> list[str]:
    base = "demo --run-dir {S}/new"
    return [
        f"{base} --posture bogus",
        f"{base} --engine bogus",
        f"{base} --posture shared --engine vllm",
        f"{base} --posture fleet-reuse --workers 0",
        f"{base} --staging bogus",
        "demo --run-dir {S}/file.txt",
        "demo --run-dir {S}/run",
        f"{base} --train-arg=--steps=0",
        f"{base} --train-arg=--bogus-flag",
        f"{base} --bogus-flag",
    ] + _flag_cases(base, {"--steps": "int>=1", "--eval-interval": "int>=1", "--workers": "int>=0",
                           "--eval-n-prompts": "int>=1", "--seed": "int>=0", "--eval-samples": "int>=0"})


def all_cases() -> list[str]:
    return [
        "bogus-command",
        *worker_cases("worker"),
        *worker_cases("backfill"),
        *train_cases(),
        *view_cases(),
        *serve_cases(),
        *submit_cases(),
        *demo_cases(),
        *decide_cases(),
    ]


# ------------------------------------------------------------------------------------------ running
@dataclass
class Outcome:
    case: str
    code: int | None  # None: still running after CASE_TIMEOUT_S (killed): a silent accept
    stdout: str
    stderr: str
    changed: list[str]

    @property
    def traceback(self) -> bool:
        return "Traceback" in self.stdout or "Traceback" in self.stderr

    @property
    def silent(self) -> bool:
        return self.code is None or self.code == 0

    @property
    def clean(self) -> bool:
        lines = self.stderr.strip().splitlines()
        return self.code == 2 and len(lines) == 1 and not self.traceback and not self.changed

    def why(self) -> str:
        return f"{self.case!r}: exit {self.code}, changed {self.changed[:3]}, stderr {self.stderr.strip()[-400:]!r}"


def tree(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every path under ``root`` with (mode, size, mtime_ns): what 'nothing changed' compares."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_mode, st.st_size if not stat.S_ISDIR(st.st_mode) else 0,
                                             st.st_mtime_ns)
    return out


def cli_env(repo: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CKPTEVAL_", "SLURM_"))}
    env.update(PYTHONPATH=str(repo), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="offline")
    return env


def cli(argv: list[str], cwd: Path, repo: Path = REPO, prefix: list[str] | None = None) -> tuple[int | None, str, str]:
    """``python -m ckpteval.jobs.cli argv`` in ``cwd`` (behind ``prefix``, e.g. :func:`unprivileged`): (exit code or
    None if killed at the timeout, stdout, stderr)."""
    proc = subprocess.Popen([*(prefix or []), sys.executable, "-m", "ckpteval.jobs.cli", *argv], cwd=cwd, env=cli_env(repo),
                            text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=CASE_TIMEOUT_S)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # its own session: the case and anything it started
        out, err = proc.communicate()
        return None, out, err


def run_case(case: str, template: Path, work: Path, fork: ForkCli, port: int) -> Outcome:
    sandbox = work / f"case-{abs(hash(case)):x}"
    shutil.copytree(template, sandbox, symlinks=True, copy_function=shutil.copy2)
    before = tree(sandbox)
    argv = shlex.split(case.replace("{S}", str(sandbox)).replace("{PORT}", str(port)))
    code, out, err = fork.run(argv, sandbox, CASE_TIMEOUT_S)
    after = tree(sandbox)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    # the one write a refusal makes: RUN/CONFIG_REFUSED, the protocol's word to the trainer (docs/PROTOCOL.md)
    refusals = {k for k in after.keys() - before.keys() if Path(k).name == "CONFIG_REFUSED"}
    changed = [k for k in changed if k not in refusals | {str(Path(k).parent) for k in refusals}]
    shutil.rmtree(sandbox, ignore_errors=True)
    return Outcome(case, code, out, err, changed)


def sweep(work: Path, repo: Path = REPO, cases: list[str] | None = None, jobs: int = 4) -> list[Outcome]:
    template = build_sandbox(work / "template")
    with socket.socket() as busy:  # a port in use, held for the whole sweep
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with ForkCli(cli_env(repo), work / "fork") as fork, ThreadPoolExecutor(jobs) as pool:
            return list(pool.map(lambda c: run_case(c, template, work, fork, port), cases or all_cases()))


def summary(outcomes: list[Outcome]) -> dict[str, int]:
    return {
        "cases": len(outcomes),
        "clean": sum(o.clean for o in outcomes),
        "tracebacks": sum(o.traceback for o in outcomes),
        "silent_accepts": sum(o.silent and not o.traceback for o in outcomes),
        "other_unclean": sum(not (o.clean or o.traceback or o.silent) for o in outcomes),
    }


# -------------------------------------------------------------------------------------------- tests
def test_every_bad_input_is_one_clear_line(tmp_path: Path) -> None:
    outcomes = sweep(tmp_path)
    bad = [o for o in outcomes if not o.clean]
    assert not bad, f"{summary(outcomes)}\n" + "\n".join(o.why() for o in bad)
    assert len(outcomes) >= 250  # the sweep covers every flag of every subcommand


def test_newcomer_configuration_mistakes_are_one_line_naming_the_setting(tmp_path: Path) -> None:
    """Issue 38: each configuration mistake a newcomer makes (typos, missing files, unknown scorers, tasks,
    environments, a base model that is not there) through ``train``, ``worker``, ``backfill`` and ``submit``:
    exit 2 (never 4, which the batch scripts requeue), one line naming the file or setting, nothing created.
    ``NEWCOMER_TABLE=path`` also writes the (exit code, line) table there."""
    cases = newcomer_cases()
    outcomes = sweep(tmp_path, cases=list(cases), jobs=2)
    if table := os.environ.get("NEWCOMER_TABLE"):
        Path(table).write_text(newcomer_table(outcomes, tmp_path))
    bad = [o for o in outcomes if not o.clean or cases[o.case] not in o.stderr]
    assert not bad, "\n".join(o.why() for o in bad)


def newcomer_table(outcomes: list[Outcome], work: Path) -> str:
    rows = ["| program | config | exit | line |", "|---|---|---|---|"]
    for o in outcomes:
        program = o.case.split(" --")[0]
        config = re.search(r"/([\w.]+\.json)", o.case)
        line = re.sub(r"/\S*/case-[0-9a-f]+/", "", o.stderr.strip().replace("|", "\\|"))
        rows.append(f"| {program} | {config.group(1) if config else ''} | {o.code} | {line} |")
    return "\n".join(rows) + "\n"


def test_cases_cover_every_flag_of_every_subcommand() -> None:
    """Each flag a subcommand's parser declares appears in at least one of its bad cases."""
    from ckpteval.jobs.cli import SUBCOMMAND_HELP_EXTRA, _help_text

    cases = all_cases()
    for name in ("worker", "backfill", "train", "status", "plot", "serve", "submit", "demo", "compare", "best"):
        for extra in [[], *SUBCOMMAND_HELP_EXTRA.get(name, [])]:
            mine = [c for c in cases if shlex.split(c)[: 1 + len(extra)] == [name, *extra]]
            flags = set(re.findall(r"^  (?:-\w, )?(--[\w-]+)", _help_text(name, extra), re.M)) - {"--help"}
            missing = sorted(f for f in flags if not any(re.search(re.escape(f) + r"(?![\w-])", c) for c in mine))
            assert not missing, f"ckpteval {name} {' '.join(extra)}: no bad case for {missing}"


def test_every_flag_says_what_it_does() -> None:
    """Each option line of every ``--help`` carries a description (on its line or the next)."""
    from ckpteval.jobs.cli import flag_reference

    lines = flag_reference().splitlines()
    blank = []
    for i, line in enumerate(lines):
        m = re.match(r"^  (-\S.*?)(\s{2,}\S.*)?$", line)
        if m and not m.group(2) and not re.match(r"^\s{20,}\S", lines[i + 1] if i + 1 < len(lines) else ""):
            blank.append(line.strip())
    assert not blank, f"flags without help: {blank}"


def test_every_run_command_takes_the_run_dir_positionally_or_as_a_flag(tmp_path: Path) -> None:
    """``ckpteval status RUN`` and ``ckpteval worker --run-dir RUN`` both work: so do the other forms."""
    from ckpteval.jobs.eval.worker import backfill
    from ckpteval.jobs.eval.worker import main as worker
    from ckpteval.jobs.flags import Parser, run_dir_from_args
    from ckpteval.jobs.reference import demo
    from ckpteval.jobs.reference.train import config as train_config

    run = tmp_path / "run"
    for module in (worker, backfill):
        parser = Parser(prog="p")
        from ckpteval.jobs.eval.worker.options import add_worker_flags

        add_worker_flags(parser, pass_flags=module is worker)
        for argv in ([str(run)], ["--run-dir", str(run)]):
            args = parser.parse_args(argv)
            assert run_dir_from_args(parser, args) == run and args.run_dir == run
    assert train_config.parse_args([str(run)]).run_dir == run == train_config.parse_args(["--run-dir", str(run)]).run_dir
    assert demo.parse_args([str(run), "--steps", "5"]).run_dir == run
    assert demo.parse_args(["--steps", "5"]).run_dir is None  # the demo's run dir stays optional


def test_help_texts_read_as_help_for_users() -> None:
    """No ``--help`` refers to a table or text that is not there, quotes reStructuredText, describes the
    code instead of the command, or files its wandb flags under a posture the command is not."""
    from ckpteval.jobs.cli import flag_reference

    text = "\n".join(line for line in flag_reference().splitlines() if not line.startswith("```"))
    for phrase in ("table above", "see above", "``", "importable without", "options and their validation"):
        assert phrase not in text, phrase
    backfill = text.split("## `ckpteval backfill`")[1].split("## ")[0]
    assert "service ingestion" not in backfill and "external-service posture" not in backfill


@pytest.mark.parametrize(("field", "value", "why"), [
    ("temperature", math.nan, "finite"), ("temperature", math.inf, "finite"), ("temperature", -0.5, ">= 0"),
    ("top_p", 0.0, "(0, 1]"), ("top_p", 1.5, "(0, 1]"), ("top_p", math.nan, "finite"),
    ("top_k", 0, "-1 for off"), ("top_k", -2, "-1 for off"), ("max_new_tokens", -1, ">= 1"),
    ("max_new_tokens", 0, ">= 1"), ("n_samples", 0, ">= 1"),
])
def test_manifest_rejects_bad_sampling_settings(field: str, value: object, why: str) -> None:
    obj = {"run_id": "r", "snapshot_roots": ["/snaps"],
           "eval": {"datasets": [{"name": "a", "path": "a.jsonl", "n_prompts": 1, field: value}]}}
    with pytest.raises(ValueError) as err:
        parse_manifest(json.loads(json.dumps(obj)), Path("/runs/r/run.json"))
    assert f"/runs/r/run.json: field eval.datasets[0].{field} " in str(err.value) and why in str(err.value)


def test_group_writable_run_json_refuses_run_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run.json naming a ``module:function`` scorer, writable by the group: the worker refuses to
    import it (exit 2, one line) and writes nothing; ``--trust-run-code`` lets it proceed; a private
    run.json with the same scorer needs no opt-in; built-in scorers never need one."""
    from ckpteval.jobs.eval.worker.main import EXIT_DONE, EXIT_USAGE, run_worker
    from ckpteval.jobs.eval.worker.options import WorkerOptions

    run = make_eval_run(tmp_path, n_prompts=4, shard_size=2, scorer=TRUST_SCORER)
    run.manifest_path.chmod(0o664)
    before = tree(run.path)
    opts = dict(run_dir=run.path, engines=(FN,), once=True, poll_interval_s=0.05)
    assert run_worker(WorkerOptions(**opts)) == EXIT_USAGE
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "writable by group" in err and "--trust-run-code" in err
    assert tree(run.path) == before
    assert run_worker(WorkerOptions(**opts, trust_run_code=True)) == EXIT_DONE
    run.manifest_path.chmod(0o644)
    run.path.chmod(0o775)
    assert run_worker(WorkerOptions(**opts)) == EXIT_USAGE  # the run dir (rename over run.json) counts too
    assert "writable by group" in capsys.readouterr().err
    run.path.chmod(0o755)
    assert run_worker(WorkerOptions(**opts)) == EXIT_DONE
    plain = make_eval_run(tmp_path, n_prompts=4, shard_size=2, name="plain")
    plain.manifest_path.chmod(0o666)
    assert run_worker(WorkerOptions(**{**opts, "run_dir": plain.path})) == EXIT_DONE


@contextlib.contextmanager
def _umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _loose(root: Path) -> list[str]:
    return [f"{p} {stat.filemode(p.stat().st_mode)}" for p in [root, *root.rglob("*")]
            if p.stat().st_mode & 0o077]


def test_files_ckpteval_creates_follow_a_tight_umask(tmp_path: Path) -> None:
    """Under umask 077 nothing ckpteval writes (run layout, run.json, results, ledger lines, leases,
    snapshots, a submitted batch script) is readable or writable by anyone but the user."""
    from ckpteval.coord.atomic import append_line
    from ckpteval.coord.results.files import skip_result, write_result
    from ckpteval.coord.work.claims import UnitClaimer
    from ckpteval.coord.work.units import units_for_step
    from ckpteval.jobs.launch import submit

    with _umask(0o077):
        run = make_eval_run(tmp_path, n_prompts=2, shard_size=2)
        append_line(run.ledger_path, b'{"event": "test"}\n')
        publish_as_trainer(run.snapshots, 1, lambda d: (d / "w.bin").write_bytes(b"x") and None)
        manifest = run.manifest()
        unit = units_for_step(manifest, 1)[0]
        claimer = UnitClaimer(run.leases, manifest.lease, results_dir=run.results)
        claim = claimer.try_claim(unit)
        assert claim is not None
        write_result(run.results, skip_result(unit, "test", "umask check"))
        claim.release()
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        (bin_dir / "sbatch").write_text("#!/bin/sh\necho 7\n")
        (bin_dir / "sbatch").chmod(0o700)
        prepared = submit.prepare(["backfill", "--run-dir", str(run.path), "--gpus-per-worker", "0"])
        submit.submit_prepared(prepared, sbatch=str(bin_dir / "sbatch"))
    assert _loose(run.path) == []


NOBODY = 65534
# In a private mount namespace: the first directory on the interpreter's path that others may not enter
# (/root, where pyenv lives) is covered by a world-enterable tmpfs holding the one subdir on the path, bound
# back from the original; then the command runs as nobody. The host's directories are never changed.
_UNPRIVILEGED_SH = (
    'set -e; keep=$(mktemp -d); mount --bind "$1/$2" "$keep"; mount -t tmpfs -o mode=755 tmpfs "$1"; '
    'mkdir "$1/$2"; mount --bind "$keep" "$1/$2"; shift 2; '
    f'exec setpriv --reuid={NOBODY} --regid={NOBODY} --clear-groups env HOME=/nonexistent "$@"'
)


def _closed_ancestor(path: Path) -> tuple[Path, str] | None:
    """(the first ancestor of ``path`` others may not enter, its child on the way), or None if all are open."""
    path = path.resolve()
    for parent in reversed(path.parents):
        if parent != path and not parent.stat().st_mode & stat.S_IXOTH:
            return parent, path.relative_to(parent).parts[0]
    return None


def unprivileged() -> list[str]:
    """A command prefix that runs a ``ckpteval`` process as user nobody (uid 65534), or ``pytest.skip``
    with the reason. As a non-root user: no prefix (the test already is unprivileged)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None or shutil.which("unshare") is None:
        pytest.skip("needs setpriv and unshare (util-linux) to run a case as an unprivileged user")
    blocked = [c for c in (_closed_ancestor(Path(sys.base_prefix)), _closed_ancestor(REPO)) if c is not None]
    if len({c[0] for c in blocked}) > 1 or any(c[0] == REPO or c[0] == Path(sys.base_prefix) for c in blocked):
        pytest.skip(f"the interpreter or checkout is not readable by others ({blocked}): cannot run as nobody")
    if not blocked:
        return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "env", "HOME=/nonexistent"]
    top, child = blocked[0]
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare --mount is not permitted here: {probe.stderr.decode().strip()}")
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", _UNPRIVILEGED_SH, "sh", str(top), child]


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A scratch dir others may enter (pytest's tmp dirs are private to root), removed afterwards."""
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="ckpteval-bad-inputs-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_unreadable_run_dir_is_one_line(open_tmp: Path) -> None:
    """As an unprivileged user (root reads everything): a run dir, results/ or run.json it cannot read."""
    prefix = unprivileged()
    run = make_eval_run(open_tmp, n_prompts=2, shard_size=2)
    cases = [["status", str(run.path)], ["plot", str(run.path), "-o", "x.png"],
             ["worker", "--run-dir", str(run.path)], ["backfill", "--run-dir", str(run.path)]]
    for mode, target in ((0, run.path), (0, run.results), (0, run.manifest_path)):
        target.chmod(mode)
        try:
            for argv in cases:
                code, out, err = cli(argv, open_tmp, prefix=prefix)
                assert code == 2 and "Traceback" not in out + err and len(err.strip().splitlines()) == 1, (argv, err)
        finally:
            target.chmod(0o755 if target.is_dir() else 0o644)


def test_worker_on_a_run_dir_it_cannot_write_is_one_line(open_tmp: Path) -> None:
    """A run dir the user may read but not write (root's 0755 dirs, 0644 files; a snapshot waiting): the
    worker and backfill stop at start with one line naming the dir — before, a PermissionError traceback
    on the first lease file — and nothing in the run changes."""
    from tests.support.workers import publish_model

    prefix = unprivileged()
    run = make_eval_run(open_tmp, n_prompts=2, shard_size=2)
    publish_model(open_tmp, run.snapshots, 10)
    for p in [run.path, *run.path.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    before = tree(run.path)
    for argv in (["worker", "--run-dir", str(run.path), "--engine", FN, "--once"],
                 ["backfill", "--run-dir", str(run.path), "--engine", FN]):
        code, out, err = cli(argv, open_tmp, prefix=prefix)
        assert code == 2 and "Traceback" not in out + err and len(err.strip().splitlines()) == 1, (argv, out, err)
        assert "not writable by this user" in err and str(run.path) in err, err
    assert tree(run.path) == before


def test_staging_dir_the_filesystem_refuses_is_one_line_and_leaves_no_run(tmp_path: Path) -> None:
    """``--eval-staging-dir /proc/...``: access() lets root write anywhere, the kernel refuses the mkdir.
    One line naming the flag, and no run dir at all, so the corrected command starts the run."""
    run_dir = tmp_path / "run"
    argv = ["train", "--run-dir", str(run_dir), "--steps", "2", "--eval-staging-dir", "/proc/ckpteval-staging"]
    code, out, err = cli(argv, tmp_path)
    assert code == 2 and "Traceback" not in out + err and len(err.strip().splitlines()) == 1, (out, err)
    assert "--eval-staging-dir /proc/ckpteval-staging" in err, err
    assert not run_dir.exists() and not Path("/proc/ckpteval-staging").exists()


def main(argv: list[str]) -> int:
    global CASE_TIMEOUT_S
    ap = argparse.ArgumentParser(description="count how a checkout answers the bad-input sweep")
    ap.add_argument("--repo", type=Path, default=REPO, help="checkout to test (default: this one)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/ckpteval-bad-inputs"), help="scratch dir")
    ap.add_argument("--show", action="store_true", help="print every case that is not clean")
    ap.add_argument("--timeout", type=float, default=CASE_TIMEOUT_S, help="seconds before a case counts as accepted")
    args = ap.parse_args(argv)
    CASE_TIMEOUT_S = args.timeout
    shutil.rmtree(args.work, ignore_errors=True)
    outcomes = sweep(args.work, args.repo)
    if args.show:
        for o in outcomes:
            if not o.clean:
                print(("TRACEBACK " if o.traceback else "SILENT " if o.silent else "UNCLEAN ") + o.why())
    print(json.dumps(summary(outcomes)))
    shutil.rmtree(args.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
