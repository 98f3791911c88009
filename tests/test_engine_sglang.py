"""SGLangEngine: the launch contract everywhere; a real sglang server where a GPU and sglang exist.

Without sglang installed, the version check reads a fake ``sglang-<version>.dist-info`` put on the launch
interpreter's ``PYTHONPATH``: the same metadata ``importlib.metadata`` reads from a real install.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from ckpteval.jobs.eval.engines.base import (
    EngineError,
    RequestRejected,
    SamplingParams,
    gpu_count,
    launch_timeout,
)
from ckpteval.jobs.eval.engines.sglang.deterministic import launch_flags as determinism_flags
from ckpteval.jobs.eval.engines.sglang.engine import (
    DETERMINISTIC_FLAG,
    SGLangEngine,
    device_flags,
    free_port,
    installed_sglang_version,
    launch_command,
)
from ckpteval.jobs.eval.engines.sglang.version import UnsupportedServer
from ckpteval.jobs.eval.proof.pinning import pin, restart
from ckpteval.jobs.reference.model import (
    ModelConfig,
    build_model,
    generation_config,
    make_addition_examples,
    save_tokenizer,
)
from tests.support import fake_sglang as fake_launcher

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
needs_gpu_and_sglang = pytest.mark.skipif(
    not (HAVE_SGLANG and torch.cuda.is_available()),
    reason=f"needs a CUDA GPU (available: {torch.cuda.is_available()}) and sglang installed (found: {HAVE_SGLANG})",
)
# head_dim 64: a size every sglang attention backend supports.
SGLANG_CFG = ModelConfig(num_heads=2, num_kv_heads=2, initializer_range=0.2)
PROMPTS = [ex["prompt"] for ex in make_addition_examples(8, seed=3)]


def test_module_imports_without_sglang() -> None:
    code = "import sys; sys.modules['sglang'] = None; import ckpteval.jobs.eval.engines.sglang.engine"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


def test_launch_command_uses_sglang_flag_names() -> None:
    cmd = launch_command("/snap", "127.0.0.1", 31000, 2, "40", ["--disable-cuda-graph"], python="py")
    assert cmd == [
        "py", "-m", "sglang.launch_server", "--model-path", "/snap", "--host", "127.0.0.1",
        "--port", "31000", "--tp-size", "2", "--weight-version", "40", "--disable-cuda-graph",
    ]  # fmt: skip
    assert "--weight-version" not in launch_command("/snap", "h", 1, 1, None)


def test_gpu_count_reads_cuda_visible_devices() -> None:
    assert gpu_count({"CUDA_VISIBLE_DEVICES": "0,3,5"}) == 3
    assert gpu_count({"CUDA_VISIBLE_DEVICES": ""}) == 0
    assert gpu_count({"CUDA_VISIBLE_DEVICES": "-1"}) == 0


def test_device_flags() -> None:
    assert device_flags(None) == device_flags("cpu") == device_flags("cuda") == ([], None)
    assert device_flags("cuda:3") == (["--base-gpu-id", "3"], 1)
    with pytest.raises(ValueError):
        device_flags("tpu:0")


def test_attached_engine_cannot_restart() -> None:
    with pytest.raises(ValueError, match="not both"):
        SGLangEngine("/snap", url="http://127.0.0.1:1")
    engine = SGLangEngine(url=f"http://127.0.0.1:{free_port()}", timeout=2)
    assert engine.healthy() is False and engine.pid is None
    with pytest.raises(EngineError, match="did not launch"):
        engine.restart()
    engine.close()


def fake_sglang(root: Path, version: str) -> dict[str, str]:
    """An env whose python sees an ``sglang`` distribution of ``version`` (metadata only, no code)."""
    info = root / f"sglang-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")
    return {"PYTHONPATH": str(root), "CUDA_VISIBLE_DEVICES": "0"}


def test_determinism_flags() -> None:
    assert determinism_flags(True, []) == [DETERMINISTIC_FLAG] == ["--enable-deterministic-inference"]
    assert determinism_flags(True, [DETERMINISTIC_FLAG]) == [] and determinism_flags(False, []) == []


@pytest.mark.parametrize("version", ["0.4.10", "0.5.3", "0.6.1"])
def test_an_sglang_install_outside_the_pin_is_refused_before_launch(tmp_path: Path, version: str) -> None:
    env = fake_sglang(tmp_path, version)
    assert installed_sglang_version(sys.executable, env) == version
    with pytest.raises(UnsupportedServer, match=rf"runs sglang {version}; ckpteval needs sglang>=0\.5\.19,<0\.6"):
        SGLangEngine(env=env)


@pytest.mark.skipif(HAVE_SGLANG, reason="checks the message for a python without sglang")
def test_a_python_without_sglang_is_refused_before_launch() -> None:
    with pytest.raises(UnsupportedServer, match="sglang is not installed"):
        SGLangEngine(env={"CUDA_VISIBLE_DEVICES": "0"})


def test_deterministic_engines_launch_with_the_flag(tmp_path: Path) -> None:
    env = fake_sglang(tmp_path, "0.5.23")
    assert DETERMINISTIC_FLAG in SGLangEngine(env=env, deterministic=True)._launch_settings.extra_args
    assert DETERMINISTIC_FLAG not in SGLangEngine(env=env)._launch_settings.extra_args


def test_the_worker_launches_sglang_deterministic_when_a_dataset_samples(tmp_path: Path) -> None:
    from dataclasses import replace

    from ckpteval.jobs.eval.worker.evaluators import _settings
    from tests.support.workers import make_eval_run

    manifest = make_eval_run(tmp_path).manifest()
    assert _settings(manifest, "sglang")["deterministic"] is True  # greedy sets too (#29)
    sampled = replace(manifest.eval.entries[0], temperature=0.6)
    manifest = replace(manifest, eval=replace(manifest.eval, entries=(sampled,)))
    assert _settings(manifest, "sglang")["deterministic"] is True
    assert "deterministic" not in _settings(manifest, "hf")


def test_lazy_engine_launches_nothing_before_the_first_load(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="at least one GPU"):
        SGLangEngine("/snap", env={"CUDA_VISIBLE_DEVICES": ""})
    engine = SGLangEngine(device="cpu", env=fake_sglang(tmp_path, "0.5.23"))
    assert engine.pid is None and engine.weight_version() is None and engine.healthy() is False
    engine.restart()  # nothing loaded yet: nothing to relaunch
    assert engine.pid is None
    engine.close()
    with pytest.raises(EngineError, match="closed"):
        engine.load("/snap", "1")


def _snapshot(path: Path, seed: int) -> Path:
    build_model(SGLANG_CFG, "llama", seed=seed).save_pretrained(path, safe_serialization=True)
    generation_config().save_pretrained(path)
    save_tokenizer(path)
    return path


@pytest.mark.gpu
@needs_gpu_and_sglang
def test_real_sglang_server_pins_weight_versions(tmp_path: Path) -> None:
    first, second = _snapshot(tmp_path / "s1", 1), _snapshot(tmp_path / "s2", 2)
    engine = SGLangEngine(  # lazy, as the worker's factory builds it: the first load launches
        extra_args=["--disable-cuda-graph", "--mem-fraction-static", "0.2"],
        log_path=str(tmp_path / "sglang.log"),
        startup_timeout=600,
        deterministic=True,
    )
    assert engine.weight_version() is None
    pid = last = None
    try:
        engine.load(str(first), "1")
        pid = engine.pid
        greedy = SamplingParams(max_new_tokens=4)
        assert engine.weight_version() == "1"
        assert {g.weight_version for g in engine.generate(PROMPTS, greedy)} == {"1"}
        engine.load(str(second), "2")
        assert engine.weight_version() == "2"
        gens = engine.generate(PROMPTS, greedy)
        assert {g.weight_version for g in gens} == {"2"} and all(g.n_tokens >= 1 for g in gens)
        info = engine.server_info()  # the version floor passed; the flag reached the server
        assert info["enable_deterministic_inference"] is True
        hot = SamplingParams(max_new_tokens=8, temperature=3.0)
        copies = [PROMPTS[0]] * 4
        same = engine.generate(copies, hot, seeds=[5] * 4)
        drawn = engine.generate(copies, hot, seeds=[1, 2, 3, 4])
        assert len({g.text for g in same}) == 1  # one seed: one sample, whatever the batch
        assert len({g.text for g in drawn}) > 1  # per-sample seeds: independent samples
        assert engine.generate([PROMPTS[0]], hot, seeds=[3])[0].text == drawn[2].text
        with pytest.raises(RequestRejected, match="context length"):  # a 4xx, and the server lives on
            engine.generate(["1+" * 4000], greedy)
        assert engine.healthy()
        engine.restart()  # relaunched with the last loaded snapshot and its version
        assert engine.pid != pid and engine.weight_version() == "2" and engine.healthy()
    finally:
        last = engine.pid
        engine.close()
    for group in {pid, last} - {None}:  # every launched process group is gone
        with pytest.raises(ProcessLookupError):
            os.killpg(group, 0)


def _slow_engine(tmp_path: Path, delay: float) -> tuple[SGLangEngine, Path]:
    """A lazy engine whose launches run the slow fake launcher (tests/support/fake_sglang.py)."""
    delay_file = tmp_path / "delay"
    delay_file.write_text(str(delay))
    env = fake_launcher.install(tmp_path / "py", delay_file)
    engine = SGLangEngine(env=env, startup_timeout=60, stop_grace=5, log_path=str(tmp_path / "sglang.log"))
    return engine, delay_file


def _gone(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return True
    return False


def test_launches_are_bounded_by_the_startup_timeout_not_the_load_timeout(tmp_path: Path) -> None:
    """A real process that starts slower than the worker's load timeout (sglang needs a GPU, so the process
    is the fake launcher): the first load and a restart both complete, as a big model's start-up must."""
    engine, _ = _slow_engine(tmp_path, 0.8)
    try:
        assert engine.launch_pending and launch_timeout(engine, pending_only=True) > 60
        assert pin(engine, str(tmp_path), "1", load_timeout_s=0.2)  # launches: start-up 0.8 s > 0.2 s
        first = engine.pid
        assert not engine.launch_pending and launch_timeout(engine, pending_only=True) == 0
        restart(engine, load_timeout_s=0.2)
        assert engine.pid != first and _gone(first) and engine.weight_version() == "1"
    finally:
        engine.close()


def test_a_restart_cancels_a_launch_still_in_flight_before_launching_again(tmp_path: Path) -> None:
    """A launch whose caller gave up keeps running in its thread; the restart must not launch a second server
    on the same port beside it: it cancels it, waits for its process group to end, then launches."""
    engine, delay_file = _slow_engine(tmp_path, 60)
    errors: list[EngineError] = []

    def first_load() -> None:
        try:
            engine.load(str(tmp_path), "1")
        except EngineError as e:
            errors.append(e)

    thread = threading.Thread(target=first_load, daemon=True)
    thread.start()
    try:
        while engine.pid is None and thread.is_alive():  # launched, still starting (60 s)
            time.sleep(0.05)
        first = engine.pid
        delay_file.write_text("0")
        engine.restart()
        assert _gone(first) and engine.pid != first  # the in-flight server was torn down first
        thread.join(timeout=30)
        assert len(errors) == 1 and "cancelled" in str(errors[0])
        assert engine.healthy() and engine.weight_version() == "1"
    finally:
        last = engine.pid
        engine.close()
    assert last is None or _gone(last)
    with pytest.raises(EngineError, match="closed"):  # a restart arriving after close launches nothing
        engine.restart()
    assert engine.pid is None


# -- deterministic mode's fallback attention backend, per GPU and model (#37) --------------------------------
LLAMA = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 32}
DEEPSEEK_V2_LITE = {"architectures": ["DeepseekV2ForCausalLM"], "kv_lora_rank": 512, "q_lora_rank": None}


@pytest.mark.parametrize("gpu, capability, config, chosen", [
    ("V100", (7, 0), LLAMA, ["--attention-backend", "triton"]),  # fa3 asserts SM>=80
    ("T4", (7, 5), LLAMA, ["--attention-backend", "triton"]),
    ("A100", (8, 0), LLAMA, []),  # sglang's fa3 runs
    ("A100", (8, 0), DEEPSEEK_V2_LITE, ["--attention-backend", "triton"]),  # fa3 refuses MLA below SM90
    ("L40S", (8, 9), {"architectures": ["MiniCPM3ForCausalLM"]}, ["--attention-backend", "triton"]),
    ("H100", (9, 0), DEEPSEEK_V2_LITE, []),
    ("B200", (10, 0), DEEPSEEK_V2_LITE, []),  # sglang itself falls back to triton there
    ("RTX 5090", (12, 0), LLAMA, []),  # ... and to flashinfer
])
def test_deterministic_attention_is_chosen_where_sglangs_fa3_fallback_would_die(
        gpu: str, capability: tuple[int, int], config: dict, chosen: list[str]) -> None:
    """sglang 0.5.23 falls back to fa3 in deterministic mode on everything but SM100/SM120
    (srt/arg_groups/overrides.py ``_deterministic_attention_backend``), and its fa3 asserts unless SM90 or SM8x
    without MLA (srt/layers/attention/attention_registry.py ``create_flashattention_v3_backend``)."""
    from ckpteval.jobs.eval.engines.sglang.deterministic import attention_choice

    assert attention_choice([DETERMINISTIC_FLAG], capability, config) == chosen, gpu
    assert attention_choice([], capability, config) == []  # not deterministic: sglang's usual default
    assert attention_choice([DETERMINISTIC_FLAG, "--attention-backend", "fa3"], capability, config) == []


def test_a_deterministic_launch_on_a_v100_passes_triton(tmp_path: Path) -> None:
    """The launch itself (the fake launcher; ``nvidia-smi`` on the launch's PATH says 7.0) carries
    ``--attention-backend triton``: the old launch let sglang pick fa3, which dies at model init there."""
    delay_file = tmp_path / "delay"
    delay_file.write_text("0")
    env = fake_launcher.install(tmp_path / "py", delay_file)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 7.0\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env["PATH"] = f"{bin_dir}:{os.environ['PATH']}"
    snapshot = tmp_path / "snap"
    snapshot.mkdir()
    (snapshot / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    engine = SGLangEngine(env=env, deterministic=True, startup_timeout=60, stop_grace=5,
                          log_path=str(tmp_path / "sglang.log"))
    try:
        engine.load(str(snapshot), "1")
        argv = Path(f"/proc/{engine.pid}/cmdline").read_bytes().decode().split("\0")
    finally:
        engine.close()
    assert argv[argv.index("--attention-backend") + 1] == "triton" and DETERMINISTIC_FLAG in argv
