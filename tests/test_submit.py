"""``ckpteval submit`` rendering, ``ckpteval.jobs.launch.slurm_env``, and the batch scripts' supervision logic.

No SLURM needed: the rendered scripts are checked for their ``#SBATCH`` lines and parsed with
``bash -n``; then they are *run* by bash with stand-ins for ``srun`` (drops its options, forwards
USR1 like srun does), ``scontrol`` (records the requeue) and the ckpteval programs (a script that
behaves like the worker/trainer: exit codes 0/3/4 and 0/75, USR1 handling). That exercises
sbatch/common.sh's real code paths: worker placement and GPU slices, restart on 4, the trainer's
failure ending the fleet, USR1 -> stop -> requeue. The real thing runs under tests/slurm/.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckpteval.jobs.launch import slurm_env, submit, submit_checks
from tests.support.workers import finish

REPO = Path(__file__).resolve().parents[1]
SBATCH = REPO / "sbatch"


def sbatch_lines(script: str) -> list[str]:
    return [line[len("#SBATCH ") :] for line in script.splitlines() if line.startswith("#SBATCH ")]


def bash_n(text: str, tmp_path: Path) -> None:
    path = tmp_path / "script.sh"
    path.write_text(text)
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# ------------------------------------------------------------------------------------ slurm_env
@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("n1", ["n1"]),
        ("n[1-3,5]", ["n1", "n2", "n3", "n5"]),
        ("gpu[08-11]", ["gpu08", "gpu09", "gpu10", "gpu11"]),
        ("a[1-2]b[3-4]", ["a1b3", "a1b4", "a2b3", "a2b4"]),
        ("n[1-2],login,m[7]", ["n1", "n2", "login", "m7"]),
        ("rack1-[1,3]-ib", ["rack1-1-ib", "rack1-3-ib"]),
        ("n1,n1,n[1-2]", ["n1", "n2"]),
        ("", []),
    ],
)
def test_expand_hostlist(text: str, hosts: list[str]) -> None:
    assert slurm_env.expand_hostlist(text) == hosts


@pytest.mark.parametrize("bad", ["n[1-3", "n1-3]", "n[3-1]", "n[a-b]"])
def test_expand_hostlist_rejects_malformed(bad: str) -> None:
    with pytest.raises(ValueError, match="host list"):
        slurm_env.expand_hostlist(bad)


def test_read_job_heterogeneous_and_dispatch_nodes() -> None:
    env = {
        "SLURM_JOB_ID": "50",
        "SLURM_HET_SIZE": "2",
        "SLURM_JOB_ID_HET_GROUP_0": "50",
        "SLURM_JOB_ID_HET_GROUP_1": "51",
        "SLURM_JOB_NODELIST_HET_GROUP_0": "n1",
        "SLURM_JOB_NODELIST_HET_GROUP_1": "n[2-3]",
    }
    job = slurm_env.read_job(env)
    assert job is not None and job.heterogeneous
    assert job.component(1) == slurm_env.Component(1, "51", ("n2", "n3"))
    assert slurm_env.dispatch_nodes(env) == (("n1",), ("n2", "n3"))
    # the batch script's explicit lists win
    env["CKPTEVAL_FLEET_NODES"] = "n1"
    assert slurm_env.dispatch_nodes(env) == (("n1",), ("n1",))


def test_read_job_plain_and_outside_slurm() -> None:
    assert slurm_env.read_job({}) is None
    assert slurm_env.dispatch_nodes({}) == (None, None)
    job = slurm_env.read_job({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]"})
    assert job is not None and not job.heterogeneous and job.components[0].nodes == ("n1", "n2")
    assert slurm_env.dispatch_nodes({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1"}) == (("n1",), None)
    with pytest.raises(ValueError, match="HET_GROUP_1"):
        slurm_env.read_job({"SLURM_JOB_ID": "7", "SLURM_HET_SIZE": "2", "SLURM_JOB_NODELIST_HET_GROUP_0": "n1"})


def test_gpu_slice() -> None:
    assert slurm_env.gpu_slice("0,1,2,3", 1, 2) == "2,3"
    assert slurm_env.gpu_slice("4,5", 1, 1) == "5"
    assert slurm_env.gpu_slice("6", 3, 1) == "6"  # already bound per task by SLURM
    assert slurm_env.gpu_slice(None, 0, 1) is None
    assert slurm_env.gpu_slice("0,1", 0, 0) is None
    with pytest.raises(ValueError, match="more GPUs or fewer workers"):
        slurm_env.gpu_slice("0,1", 2, 1)


def test_slurm_env_exec_slices_and_execs() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0,1,2,3", "PYTHONPATH": str(REPO)}
    code = "import os; print(os.environ['CUDA_VISIBLE_DEVICES'], os.environ['CKPTEVAL_WORKER_SLOT'])"
    out = subprocess.run(
        [sys.executable, "-m", "ckpteval.jobs.launch.slurm_env", "exec", "--slot", "1", "--gpus", "2", "--", sys.executable, "-c", code],
        capture_output=True, text=True, env=env, cwd=REPO, check=True,
    )
    assert out.stdout.split() == ["2,3", "1"]
    cpu = subprocess.run(
        [sys.executable, "-m", "ckpteval.jobs.launch.slurm_env", "exec", "--slot", "0", "--gpus", "0", "--", sys.executable, "-c", code],
        capture_output=True, text=True, env=env, cwd=REPO, check=True,
    )
    assert cpu.stdout.split() == ["0"]  # CUDA_VISIBLE_DEVICES emptied for a CPU worker


# ------------------------------------------------------------------------------------- rendering
def test_train_eval_dry_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    argv = ["train-eval", "--run-dir", str(run), "--partition", "gpu", "--account", "proj", "--time", "4:00:00",
            "--trainer-cpus", "16", "--fleet-partition", "eval", "--fleet-nodes", "2", "--workers", "4",
            "--gpus-per-worker", "2", "--cpus", "32", "--engine", "sglang", "--signal-before", "600",
            "--env", "HF_HOME=/scratch/hf", "--worker-arg=--verify=full", "--dry-run",
            "--", "--steps", "1000", "--eval-interval", "100"]
    assert submit.main(argv) == 0
    script = capsys.readouterr().out
    lines = sbatch_lines(script)
    hetjob = lines.index("hetjob")
    trainer, fleet = lines[:hetjob], lines[hetjob + 1 :]
    for must in ("--requeue", "--open-mode=append", "--signal=B:USR1@600", f"--output={run}/slurm/%x-%j.out"):
        assert must in trainer
    assert {"--partition=gpu", "--account=proj", "--time=4:00:00", "--cpus-per-task=16", "--nodes=1"} <= set(trainer)
    assert not any(x.startswith("--gpus") for x in trainer)
    # 4 workers x 2 GPUs over 2 nodes = 4 GPUs per node
    assert {"--partition=eval", "--account=proj", "--nodes=2", "--gpus-per-node=4", "--cpus-per-task=32"} <= set(fleet)
    assert f"export CKPTEVAL_RUN_DIR={run}" in script
    assert "CKPTEVAL_TRAIN_ARGV=(--steps 1000 --eval-interval 100)" in script
    assert "CKPTEVAL_WORKER_ARGV=(--verify=full)" in script
    assert "export CKPTEVAL_ENGINE=sglang" in script and "export HF_HOME=/scratch/hf" in script
    assert f"export CKPTEVAL_SBATCH_DIR={SBATCH}" in script
    bash_n(script, tmp_path)
    assert not run.exists()  # a dry run touches nothing


def test_default_engine_is_auto_and_help_says_what_it_resolves_to(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.json").write_text("{}")  # backfill scores an existing run
    assert submit.main(["backfill", "--run-dir", str(tmp_path / "run"), "--dry-run"]) == 0
    assert "export CKPTEVAL_ENGINE=auto" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        submit.main(["backfill", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default: auto" in text and "sglang where it is importable and the worker has GPUs allocated" in text


def test_auto_engine_follows_the_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """sglang is not installed here: an empty package named ``sglang`` on sys.path stands in for an
    importable one (only its presence is looked up; nothing is launched)."""
    from ckpteval.jobs.eval.engines.factory import resolve_auto, resolve_specs

    gpus, no_gpus = {"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": ""}
    assert resolve_auto("cpu", gpus) == "hf"
    assert resolve_auto("cuda", gpus) == "hf"  # sglang not importable
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_auto("cuda", gpus) == "sglang" and resolve_auto("cuda:1", gpus) == "sglang"
    assert resolve_auto("cuda", no_gpus) == "hf" and resolve_auto("cpu", gpus) == "hf"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert resolve_specs(("auto", "http:http://x"), "cuda") == ["sglang", "http:http://x"]


def test_backfill_dry_run_array(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a b", tmp_path / "b"
    for run in (a, b):  # backfill scores existing runs: submit checks their run.json is there
        run.mkdir()
        (run / "run.json").write_text("{}")
    argv = ["backfill", "--run-dir", str(b), "--run-dir", str(a), "--tasks", "8", "--parallelism", "3",
            "--gpus-per-worker", "1", "--time", "30", "--dry-run"]
    assert submit.main(argv) == 0
    script = capsys.readouterr().out
    lines = sbatch_lines(script)
    assert "--array=0-7%3" in lines and "--gpus-per-node=1" in lines and "--time=30" in lines
    assert f"--output={b}/slurm/%x-%A_%a.out" in lines
    assert "--signal=B:USR1@120" in lines and "--requeue" in lines and "--open-mode=append" in lines
    assert f"CKPTEVAL_RUN_DIRS=({b} '{a}')" in script
    assert "hetjob" not in lines
    bash_n(script, tmp_path)


def test_service_dry_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "ckpts").mkdir()  # a --watch dir must exist (a typo is refused at submit)
    (tmp_path / "qa.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (tmp_path / "eval.json").write_text(json.dumps({"eval": {"datasets": [
        {"name": "qa", "path": "qa.jsonl", "n_prompts": 1}]}}))
    argv = ["service", "--run-dir", str(tmp_path / "svc"), "--watch", str(tmp_path / "ckpts"),
            "--eval-config", str(tmp_path / "eval.json"), "--gpus-per-worker", "0", "--time", "1-00:00:00",
            "--dry-run", "--", "--quiescence", "60"]
    assert submit.main(argv) == 0
    script = capsys.readouterr().out
    lines = sbatch_lines(script)
    assert "--time=1-00:00:00" in lines and "--signal=B:USR1@300" in lines
    assert not any(x.startswith("--gpus") for x in lines)
    assert f"CKPTEVAL_WATCH_DIRS=({tmp_path / 'ckpts'})" in script
    assert f"export CKPTEVAL_EVAL_CONFIG={tmp_path / 'eval.json'}" in script
    assert "CKPTEVAL_WORKER_ARGV=(--quiescence 60)" in script
    bash_n(script, tmp_path)


def test_submit_rejects_nonsense(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert submit.main(["train-eval", "--run-dir", str(tmp_path), "--workers", "1", "--fleet-nodes", "2",
                        "--dry-run"]) == 2
    assert "node would idle" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        submit.main(["backfill", "--run-dir", str(tmp_path), "--tasks", "0"])
    with pytest.raises(SystemExit):
        submit.main(["service", "--run-dir", str(tmp_path)])  # --watch is required


def test_run_dir_with_spaces_is_refused_for_sbatch_lines_and_the_printed_command_pastes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """sbatch splits ``#SBATCH --output=/x/my run/...`` at the space: such a log path is refused in one line
    naming the flag to change; with ``--output`` elsewhere the run dir may have spaces, and the printed
    sbatch command is shell-quoted (it pastes as one argument)."""
    run = tmp_path / "my run"
    assert submit.main(["train-eval", "--run-dir", str(run), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--run-dir" in err and "splits at whitespace" in err and "--output" in err
    assert submit.main(["train-eval", "--run-dir", str(run), "--output", str(tmp_path / "my logs" / "%j.out"),
                        "--dry-run"]) == 2
    assert "--output" in capsys.readouterr().err
    assert submit.main(["train-eval", "--run-dir", str(tmp_path / "run"), "--job-name", "my job", "--dry-run"]) == 2
    assert "--job-name" in capsys.readouterr().err
    logs = tmp_path / "logs"
    assert submit.main(["train-eval", "--run-dir", str(run), "--output", f"{logs}/%x-%j.out", "--dry-run"]) == 0
    out = capsys.readouterr()
    assert f"export CKPTEVAL_RUN_DIR='{run}'" in out.out
    assert all(" " not in line for line in sbatch_lines(out.out) if line != "hetjob")
    command = shlex.split(out.err.strip().split(" and run: ", 1)[1])
    assert command[:2] == ["sbatch", "--parsable"] and Path(command[2]).parent == run / "slurm"
    assert not run.exists()


@pytest.mark.parametrize(("text", "seconds"), [("30", 1800), ("4:00:00", 14400), ("00:04:00", 240), ("5:30", 330),
                                               ("1-12", 129600), ("2-0:30", 174600), ("1-00:00:10", 86410)])
def test_time_limit_syntax(text: str, seconds: int) -> None:
    assert submit_checks.time_seconds(text) == seconds


def test_time_limit_is_checked_and_must_outlast_the_signal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        submit.main(["train-eval", "--run-dir", str(run), "--time", "banana", "--dry-run"])
    assert e.value.code == 2 and "invalid time limit 'banana'" in capsys.readouterr().err
    assert submit.main(["train-eval", "--run-dir", str(run), "--time", "00:04:00", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "--time 00:04:00 (240 s) is not longer than --signal-before 300" in err and err.count("\n") == 1
    assert submit.main(["train-eval", "--run-dir", str(run), "--time", "00:04:00", "--signal-before", "60",
                        "--dry-run"]) == 0
    assert "--time=00:04:00" in sbatch_lines(capsys.readouterr().out)


def test_backfill_of_a_finished_run_with_nothing_left_submits_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ckpteval.coord.results.files import write_point_skip
    from tests.support.workers import make_eval_run

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text('#!/bin/bash\ntouch "$(dirname "$0")/called"\necho 1\n')
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    done = make_eval_run(tmp_path, name="done")
    write_point_skip(done.results, done.manifest(), 10, "busy")
    (done.ledger_path).write_text(json.dumps({"event": "dispatched", "step": 10}) + "\n")
    done.mark_training_done(10)
    assert submit.main(["backfill", "--run-dir", str(done.path), "--gpus-per-worker", "0"]) == 0
    out = capsys.readouterr()
    assert out.out == "" and "nothing to do" in out.err and "nothing submitted" in out.err
    assert not (bin_dir / "called").exists() and not (done.path / "slurm").exists()
    running = make_eval_run(tmp_path, name="running")  # no TRAINING_DONE: snapshots may still come
    assert submit.main(["backfill", "--run-dir", str(done.path), "--run-dir", str(running.path),
                        "--gpus-per-worker", "0", "--dry-run"]) == 0
    out = capsys.readouterr()
    assert f"CKPTEVAL_RUN_DIRS=({running.path})" in out.out and "left out of the array" in out.err


def test_templates_parse_and_carry_the_contract(tmp_path: Path) -> None:
    for name in submit.TEMPLATES.values():
        text = (SBATCH / name).read_text()
        proc = subprocess.run(["bash", "-n", str(SBATCH / name)], capture_output=True, text=True)
        assert proc.returncode == 0, (name, proc.stderr)
        lines = sbatch_lines(text)
        assert "--requeue" in lines and "--open-mode=append" in lines, name
        assert any(x.startswith("--signal=B:USR1@") for x in lines), name
        assert "/work/" not in text and "--partition" not in text.split("# <<< ckpteval sbatch options")[0].split(
            "# >>> ckpteval sbatch options")[1], name  # no hard-coded paths or partitions
    assert subprocess.run(["bash", "-n", str(SBATCH / "common.sh")]).returncode == 0


def test_parse_job_id() -> None:
    assert submit.parse_job_id("123\n") == "123"
    assert submit.parse_job_id("77;cluster\n") == "77"
    with pytest.raises(RuntimeError):
        submit.parse_job_id("sbatch: error: nope")


def test_submit_calls_sbatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text('#!/bin/bash\necho "$@" > "$(dirname "$0")/args"\necho "4242;c1"\n')
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text("{}")  # the service joins an existing run (no --eval-config)
    assert submit.main(["service", "--run-dir", str(run), "--watch", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == "4242"
    assert "squeue -j 4242" in out.err and f"ckpteval status {run}" in out.err
    args = (bin_dir / "args").read_text().split()
    assert args[0] == "--parsable" and Path(args[-1]).parent == run / "slurm"
    assert "#SBATCH --requeue" in Path(args[-1]).read_text()


def test_submit_in_a_terminal_says_what_the_id_is_and_how_to_follow_it(tmp_path: Path) -> None:
    """A person at a terminal gets no bare number: the id with what it is, squeue and status to follow it (a
    captured stdout still gets the id alone: test_submit_calls_sbatch)."""
    import pty

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text('#!/bin/bash\necho "4242;c1"\n')
    (bin_dir / "sbatch").chmod(0o755)
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text("{}")
    env = {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}"}
    main_fd, term_fd = pty.openpty()
    proc = subprocess.run(["ckpteval", "submit", "service", "--run-dir", str(run), "--watch", str(tmp_path)],
                          stdout=term_fd, stderr=subprocess.PIPE, env=env, timeout=120)
    os.close(term_fd)
    out = os.read(main_fd, 65536).decode()
    os.close(main_fd)
    assert proc.returncode == 0, proc.stderr
    lines = out.splitlines()
    assert "4242" not in [line.strip() for line in lines], out
    assert lines[0] == "ckpteval submit: submitted service as SLURM job 4242; to follow it:", out
    assert "squeue -j 4242" in out and f"ckpteval status {run}" in out


# ------------------------------------------------------------- the scripts, run with stand-ins
FAKE_SRUN = r"""#!/bin/bash
# srun stand-in: drop the options, run the command; forward USR1 (srun does), SIGKILL on TERM (srun does)
while [[ $# -gt 0 && $1 == -* ]]; do shift; done
child=""
trap '[[ -n $child ]] && kill -USR1 $child 2>/dev/null' USR1
trap '[[ -n $child ]] && kill -KILL $child 2>/dev/null' TERM
"$@" &
child=$!
while :; do
    wait $child; rc=$?
    kill -0 $child 2>/dev/null || break
done
exit $rc
"""

FAKE_SCONTROL = r"""#!/bin/bash
echo "scontrol $*" >> "$FAKE_LOG"
"""

# The programs: `-P -m ckpteval.jobs.launch.slurm_env` is the real one; `-P -m ckpteval.jobs.cli worker|backfill|train`
# behave by env. Every call must carry -P (never import from the submit dir): one without it fails the job.
FAKE_PYTHON = r"""#!/bin/bash
if [[ $1 != -P ]]; then echo "python without -P: $*" >> "$FAKE_LOG"; exit 97; fi
shift
if [[ $2 == ckpteval.jobs.launch.slurm_env ]]; then exec "$REAL_PYTHON" -P "$@"; fi
sub=$3
shift 3
echo "$sub argv: $*" >> "$FAKE_LOG"
id=""; run=""
while [[ $# -gt 0 ]]; do
    case $1 in --worker-id) id=$2; shift ;; --run-dir) run=$2; shift ;; esac
    shift
done
# handlers before the "started" line the tests wait for, so a signal sent after it is never fatal
if [[ $sub == train ]]; then trap 'echo "train USR1" >> "$FAKE_LOG"; exit 75' USR1
else trap 'echo "$sub $id USR1" >> "$FAKE_LOG"; exit 3' USR1; fi
n=$(ls "$FAKE_DIR" | grep -c "^start-$sub")
touch "$FAKE_DIR/start-$sub-$id-$n"
echo "$sub id=$id n=$n cvd=${CUDA_VISIBLE_DEVICES-unset}" >> "$FAKE_LOG"
if [[ $sub == train ]]; then
    touch "$run/run.json"
    for ((i = 0; i < ${FAKE_TRAIN_TICKS:-10}; i++)); do sleep 0.1 & wait $!; done
    [[ ${FAKE_TRAIN_RC:-0} == 0 ]] && touch "$run/TRAINING_DONE"
    exit "${FAKE_TRAIN_RC:-0}"
fi
rcs=(${FAKE_WORKER_RCS:-0})
rc=${rcs[n]:-${rcs[-1]}}
for ((i = 0; i < ${FAKE_WORKER_TICKS:-5}; i++)); do sleep 0.1 & wait $!; done
if [[ $rc == wait ]]; then while :; do sleep 0.1 & wait $!; done; fi
exit "$rc"
"""


class Harness:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.bin = tmp / "bin"
        self.fake = tmp / "fake"
        self.log = tmp / "fake.log"
        self.bin.mkdir()
        self.fake.mkdir()
        for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("python", FAKE_PYTHON)):
            (self.bin / name).write_text(text)
            (self.bin / name).chmod(0o755)
        self.run_dir = tmp / "run"

    def render(self, argv: list[str]) -> Path:
        ours = ["--python", str(self.bin / "python"), "--grace", "5"]
        cut = argv.index("--") if "--" in argv else len(argv)
        prepared = submit.prepare([*argv[:cut], *ours, *argv[cut:]])
        path = self.tmp / f"{prepared.kind}.sbatch"
        path.write_text(prepared.script)
        return path

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CKPTEVAL_"))}
        env.update(
            PATH=f"{self.bin}:{env['PATH']}", REAL_PYTHON=sys.executable, PYTHONPATH=str(REPO),
            FAKE_LOG=str(self.log), FAKE_DIR=str(self.fake), SLURM_JOB_ID="900", SLURMD_NODENAME="n1",
            SLURM_SUBMIT_DIR=str(self.tmp), CUDA_VISIBLE_DEVICES="0,1,2,3", CKPTEVAL_RESTART_PAUSE_S="0",
        )
        env.update(extra)
        return env

    def start(self, script: Path, **env: str) -> subprocess.Popen[str]:
        return subprocess.Popen(["bash", str(script)], cwd=self.tmp, env=self.env(**env), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def wait_for(self, text: str, proc: subprocess.Popen[str], timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines()):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no {text!r} in {self.lines()}; script: {proc.communicate()[0]}")
            time.sleep(0.05)


def _finish(proc: subprocess.Popen[str], timeout: float = 30) -> tuple[int, str]:
    return finish(proc, timeout)


HET_ENV = {"SLURM_HET_SIZE": "2", "SLURM_JOB_NODELIST_HET_GROUP_0": "n1", "SLURM_JOB_NODELIST_HET_GROUP_1": "n[2-3]"}

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def test_train_eval_script_places_workers_and_drains(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    script = h.render(["train-eval", "--run-dir", str(h.run_dir), "--workers", "4", "--fleet-nodes", "2",
                       "--gpus-per-worker", "1", "--", "--steps", "5"])
    rc, out = _finish(h.start(script, **HET_ENV))
    assert rc == 0, out
    lines = h.lines()
    train_argv = next(line for line in lines if line.startswith("train argv:"))
    assert f"--run-dir {h.run_dir} --trainer-nodes n1 --fleet-nodes n2,n3 --steps 5" in train_argv
    assert "--resume" not in train_argv
    # 4 workers over n2,n3: two per node, GPU slots 0 and 1 of the step's devices
    workers = sorted((w.split()[1], w.split()[-1]) for w in lines if w.startswith("worker id="))
    assert workers == [(f"id=j900-w{i}", f"cvd={i % 2}") for i in range(4)]
    assert "fleet of 4 worker(s) on n2,n3" in out
    assert "worker j900-w0: node n2 slot 0" in out and "worker j900-w3: node n3 slot 1" in out
    assert not any(line.startswith("scontrol") for line in lines)


def test_trainer_failure_ends_the_fleet(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    script = h.render(["train-eval", "--run-dir", str(h.run_dir), "--workers", "2", "--gpus-per-worker", "1"])
    rc, out = _finish(h.start(script, FAKE_TRAIN_RC="7", FAKE_WORKER_RCS="wait", **HET_ENV))
    assert rc == 7, out
    lines = h.lines()
    assert "worker j900-w0 USR1" in lines and "worker j900-w1 USR1" in lines, lines  # leases released
    assert "trainer FAILED with exit code 7" in out
    assert not any(line.startswith("scontrol") for line in lines)


def test_usr1_stops_everything_and_requeues(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    script = h.render(["train-eval", "--run-dir", str(h.run_dir), "--workers", "2"])
    proc = h.start(script, FAKE_TRAIN_TICKS="1000", FAKE_WORKER_RCS="wait", **HET_ENV)
    for worker in ("j900-w0", "j900-w1"):  # both started (they are launched concurrently): both must get USR1
        h.wait_for(f"worker id={worker}", proc)
    proc.send_signal(signal.SIGUSR1)
    rc, out = _finish(proc)
    assert rc == 0, out
    lines = h.lines()
    assert "train USR1" in lines and "worker j900-w0 USR1" in lines and "worker j900-w1 USR1" in lines
    assert lines[-1] == "scontrol requeue 900", lines


def test_restart_after_training_done_runs_the_fleet_only(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.run_dir.mkdir()
    (h.run_dir / "run.json").write_text("{}")
    (h.run_dir / "TRAINING_DONE").write_text("{}")
    script = h.render(["train-eval", "--run-dir", str(h.run_dir), "--workers", "1"])
    rc, out = _finish(h.start(script, SLURM_RESTART_COUNT="1", **HET_ENV))
    assert rc == 0, out
    assert not any(line.startswith("train") for line in h.lines())
    assert "training already done" in out


def test_unhealthy_worker_restarts_in_place_then_job_requeues(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.run_dir.mkdir()
    (h.run_dir / "run.json").write_text("{}")
    # first run: exit 4, restarted, then 0 -> done
    script = h.render(["backfill", "--run-dir", str(h.run_dir), "--gpus-per-worker", "0"])
    rc, out = _finish(h.start(script, FAKE_WORKER_RCS="4 0", SLURM_ARRAY_JOB_ID="900", SLURM_ARRAY_TASK_ID="0"))
    assert rc == 0, out
    starts = [line for line in h.lines() if line.startswith("backfill id=")]
    assert [line.split()[1:3] for line in starts] == [["id=j900_0-w0", "n=0"], ["id=j900_0-w0", "n=1"]]
    assert starts[0].endswith("cvd=")  # CPU worker: no GPUs
    # the default engine is auto: the worker resolves it on its node (hf for a CPU worker, see below)
    assert "--once" not in h.lines()[0]
    assert f"--run-dir {h.run_dir} --wait-for-run 600 --engine auto --device cpu" in h.lines()[0]
    # always unhealthy: 1 + 2 restarts, then the task requeues itself
    h.log.unlink()
    for f in h.fake.iterdir():
        f.unlink()
    rc, out = _finish(h.start(script, FAKE_WORKER_RCS="4"))
    assert rc == 0, out
    lines = h.lines()
    assert len([x for x in lines if x.startswith("backfill id=")]) == 3
    assert lines[-1] == "scontrol requeue 900"


def test_term_stops_without_requeue(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.run_dir.mkdir()
    (h.run_dir / "run.json").write_text("{}")
    script = h.render(["service", "--run-dir", str(h.run_dir), "--watch", str(tmp_path), "--workers", "2"])
    proc = h.start(script, FAKE_WORKER_RCS="wait")
    for worker in ("j900-w0", "j900-w1"):  # both started (they are launched concurrently)
        h.wait_for(f"worker id={worker}", proc)
    proc.send_signal(signal.SIGTERM)
    rc, out = _finish(proc)
    assert rc == 143, out
    assert not any(line.startswith("scontrol") for line in h.lines())
