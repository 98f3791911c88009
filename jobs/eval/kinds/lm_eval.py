"""lm-evaluation-harness tasks as work units: the glue between a pinned engine and ``lm_eval``.

One unit per task; the harness's exceptions are user code (a ``crashed`` skip naming the task). Guarantee: offline
when the task's data is local. See docs/USER_GUIDE.md "lm-evaluation-harness tasks".
"""

from __future__ import annotations

import copy
import importlib.metadata
import itertools
import logging
import math
import os
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

from ckpteval.coord.entries.lm_eval import LmEvalEntry
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.work.units import WorkUnit
from ckpteval.jobs.eval.engines.base import ServesLmEval
from ckpteval.jobs.eval.kinds.evaluate import Evaluation, user_code
from ckpteval.jobs.eval.proof.pinning import PinViolation

INSTALL_HINT = "lm_eval datasets need the lm-eval package: pip install 'ckpteval[harness]'"
# datasets pings the Hub ("download count", 3 s timeout) on every load, even of a local JSON file, unless
# told not to; it reads this at import, and this module is imported before lm_eval (and datasets) are.
os.environ.setdefault("HF_UPDATE_DOWNLOAD_COUNTS", "0")


def require_lm_eval() -> None:
    """ValueError (with the install hint) unless ``lm_eval`` is importable."""
    try:
        import lm_eval  # noqa: F401
    except ImportError as e:
        raise ValueError(f"{INSTALL_HINT} ({e})") from None


def include_path(run: RunDir, spec: LmEvalEntry) -> Path | None:
    """The entry's local task configs (relative to the run dir unless absolute)."""
    return None if spec.include_path is None else run.resolve_data_path(spec.include_path)


@lru_cache(maxsize=16)
def _task_manager(path: str | None, include_defaults: bool) -> Any:
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=path, include_defaults=include_defaults)


def task_manager(run: RunDir, spec: LmEvalEntry) -> Any:
    """The harness's task index for this entry (built once per process per include path)."""
    require_lm_eval()
    path = include_path(run, spec)
    if path is not None and not path.exists():
        raise FileNotFoundError(f"lm_eval entry {spec.name!r}: include_path {path} not found")
    return _task_manager(None if path is None else str(path), spec.include_defaults)


def check_harness(run: RunDir, specs: tuple[LmEvalEntry, ...]) -> None:
    """At worker start: lm-eval importable, every entry's tasks known to the harness."""
    for spec in specs:
        tm = task_manager(run, spec)
        unknown = [t for t in spec.tasks if t not in tm.all_tasks]
        if unknown:
            where = f"include_path {include_path(run, spec)}" if spec.include_path else "lm-eval's built-in tasks"
            raise ValueError(f"lm_eval entry {spec.name!r}: unknown task(s) {unknown} (looked in {where})")


def metric_name(key: str) -> str | None:
    """lm-eval's ``"<metric>,<filter>"`` result key as ckpteval's metric name (None: not a metric)."""
    metric, sep, filt = key.partition(",")
    if not sep:
        return None  # alias, name, sample_len, ...
    return metric if filt == "none" else f"{metric}/{filt}"


def flatten_metrics(task_results: dict[str, Any]) -> dict[str, float]:
    """One task's ``results[task]`` block as ``{metric name: float}``; non-numbers and non-finite ones are dropped.
    ``n``: the documents the task scored (lm-eval's ``sample_len``), where it says."""
    out: dict[str, float] = {}
    if isinstance(n := task_results.get("sample_len"), int) and not isinstance(n, bool):
        out["n"] = float(n)
    for key, value in task_results.items():
        name = metric_name(key)
        if name is None or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(float(value)):  # lm-eval's NaN (and an inf) is no number a point can carry
            out[name] = float(value)
    return out


def _quiet() -> None:
    """lm-eval's per-call warnings (e.g. about a model passed as an object) would flood fleet logs."""
    logging.getLogger("lm_eval").setLevel(logging.ERROR)


def hf_lm(model: Any, tokenizer: Any, spec: LmEvalEntry) -> Any:
    """The harness's in-process adapter around a loaded transformers model."""
    from lm_eval.models.huggingface import HFLM

    _quiet()
    # a copy: HFLM sets a missing pad token on the tokenizer it gets, and the engine's must stay as loaded
    return HFLM(pretrained=model, tokenizer=copy.deepcopy(tokenizer), batch_size=spec.batch_size,
                chat_template_args=dict(spec.chat_template_kwargs))


def completions_lm(engine: Any, snapshot_dir: str, spec: LmEvalEntry) -> Any:
    """The harness's ``local-completions`` adapter against the HTTP engine's ``/v1/completions``: the
    model and tokenizer the engine names (:meth:`~ckpteval.jobs.eval.engines.http.engine.HTTPEngine.lm_eval_model`),
    its key in the header (a non-empty header: lm-eval would otherwise send ``OPENAI_API_KEY``)."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    class RenderedChatCompletions(LocalCompletionsAPI):  # type: ignore[misc]
        """``local-completions`` whose chat template is rendered with the snapshot's tokenizer and the
        entry's ``chat_template_kwargs``, as HFLM's ``apply_chat_template`` renders (lm-eval 0.4.13
        ``models/huggingface.py``): lm-eval's own one, with untokenized requests, hands the messages on as
        JSON, which ``/v1/completions`` cannot take, and takes no template kwargs."""

        def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
            return self.tokenizer.apply_chat_template(  # type: ignore[no-any-return]
                chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=not add_generation_prompt, **spec.chat_template_kwargs)

        def model_call(self, messages: Any, *, generate: bool = True, gen_kwargs: dict[str, Any] | None = None,
                       **kwargs: Any) -> Any:
            """A sampled generation is sent one prompt per request, each with its own seed (the entry's seed plus
            a count, so a rerun draws the same): lm-eval sends ``seed`` 1234 on every request, and deterministic
            sglang samples from a hash of seed and position, so a task's repeats would all be one sample."""
            if not generate or float((gen_kwargs or {}).get("temperature", 0) or 0) <= 0:
                return super().model_call(messages, generate=generate, gen_kwargs=gen_kwargs, **kwargs)
            choices = []
            for prompt in messages:
                self._seed = next(seeds)
                out = super().model_call([prompt], generate=generate, gen_kwargs=gen_kwargs, **kwargs)
                if out is None:
                    return None
                choices += [{**choice, "index": len(choices)} for choice in out["choices"][:1]]
            return {"choices": choices}

    seeds = itertools.count(spec.seed * 1_000_003 + 1)  # one per sampled request, in lm-eval's (sorted) order

    _quiet()
    model, tokenizer = engine.lm_eval_model(snapshot_dir)
    header = {"Accept": "application/json", **engine.auth_header("/v1/completions")}
    try:
        return RenderedChatCompletions(
            base_url=f"{engine.base_url.rstrip('/')}/v1/completions",
            model=model,
            tokenizer=tokenizer,
            tokenizer_backend="huggingface",
            tokenized_requests=False,
            batch_size=spec.batch_size,
            max_retries=1,
            header=header,
        )
    except ImportError as e:  # lm-eval's API models need its [api] extra (ckpteval[harness] has it)
        raise RuntimeError(f"{INSTALL_HINT} ({e})") from None


def evaluate_task(lm: Any, run: RunDir, spec: LmEvalEntry, task: str) -> dict[str, float]:
    """Run one task of ``spec`` on ``lm`` with lm-eval's ``simple_evaluate``; its flattened metrics."""
    from lm_eval import simple_evaluate

    _quiet()
    out = simple_evaluate(
        model=lm,
        tasks=[task],
        task_manager=task_manager(run, spec),
        num_fewshot=spec.num_fewshot,
        limit=spec.limit,
        gen_kwargs=spec.gen_kwargs,
        apply_chat_template=spec.apply_chat_template,
        bootstrap_iters=spec.bootstrap_iters,
        log_samples=False,
        random_seed=spec.seed,
        numpy_random_seed=spec.seed,
        torch_random_seed=spec.seed,
        fewshot_random_seed=spec.seed,
        verbosity="ERROR",
    )
    if out is None or task not in out.get("results", {}):
        raise RuntimeError(f"lm-eval returned no results for task {task!r}")
    metrics = flatten_metrics(out["results"][task])
    if not set(metrics) - {"n"}:
        raise RuntimeError(f"lm-eval task {task!r} produced no numeric metric: {out['results'][task]}")
    return metrics


def run_task(engine: Any, run: RunDir, spec: LmEvalEntry, task: str, snapshot_dir: str) -> dict[str, float]:
    """Run ``task`` on ``engine`` (already pinned by the caller) through the matching lm-eval adapter."""
    from ckpteval.jobs.eval.engines.hf.engine import HFEngine
    from ckpteval.jobs.eval.engines.http.engine import HTTPEngine

    if isinstance(engine, HFEngine):
        with engine.held() as (model, tokenizer):
            return evaluate_task(hf_lm(model, tokenizer, spec), run, spec, task)
    if isinstance(engine, HTTPEngine):
        return evaluate_task(completions_lm(engine, snapshot_dir, spec), run, spec, task)
    raise ValueError(
        f"lm_eval entry {spec.name!r}: engine {type(engine).__name__} has no lm-eval adapter "
        "(use one hf, http:URL or sglang engine, no --engines N pool)"
    )


def evaluate_harness(engine: Any, cache: Any, spec: LmEvalEntry, unit: WorkUnit, snapshot: str, want: str) -> Evaluation:
    """The ``lm_eval`` kind (:mod:`ckpteval.jobs.eval.kinds.evaluate`): one task on the pinned engine, the version read back
    before and after it. The library's own failure (an assertion, a task that cannot run on this model)
    is the unit's ``crashed`` skip with lm-eval's message."""
    before = engine.weight_version()
    if isinstance(engine, ServesLmEval):  # a LoRA engine lm-eval cannot address: skipped rejected, one line
        engine.lm_eval_model(snapshot)
    t0 = time.perf_counter()
    task = spec.tasks[unit.shard]
    with user_code(f"lm-eval task {task!r}", "lm_eval"):
        metrics = run_task(engine, cache.run, spec, task, snapshot)
    elapsed = time.perf_counter() - t0
    after = engine.weight_version()
    if before != want or after != want:
        raise PinViolation(f"want version {want}; engine reported {before!r} before the task, {after!r} after")
    return Evaluation([], [before, after], metrics=metrics, generate_s=elapsed, scored={"scorer": identity(spec)})


def identity(spec: LmEvalEntry) -> dict[str, Any]:
    """What scored the unit (the result's ``scorer``): lm-eval's version and the entry's settings that change a
    task's metrics (few-shot, limit, generation overrides, chat template and its arguments, seed, local tasks).
    ``compare`` and ``best`` refuse points whose identities differ (:mod:`ckpteval.jobs.decide.scorers`)."""
    return {"name": "lm_eval", "lm_eval": lm_eval_version(), "num_fewshot": spec.num_fewshot, "limit": spec.limit,
            "gen_kwargs": spec.gen_kwargs, "apply_chat_template": spec.apply_chat_template,
            "chat_template_kwargs": dict(spec.chat_template_kwargs), "seed": spec.seed,
            "include_path": spec.include_path}


@lru_cache(maxsize=1)
def lm_eval_version() -> str:
    try:
        return importlib.metadata.version("lm_eval")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def check_harness_entry(cache: Any, spec: LmEvalEntry) -> None:
    """At start: lm-eval importable and the entry's tasks known (:func:`check_harness`)."""
    check_harness(cache.run, (spec,))
