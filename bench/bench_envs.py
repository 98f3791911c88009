"""Episodes of the ``env`` kind: the loop's overhead, and what injected tool failures leave in the numbers.

1. **Overhead** (real engine): the reference trainer's tiny model in the real :class:`HFEngine`, a
   minimal environment (an addition prompt, then ``+`` after each reply, never done: every episode runs
   its ``--turns`` turns of ``--tokens`` new tokens; the model's context is 64 tokens, so 2 turns), vs single-turn samples of the same prompts generating as many
   tokens in one call (``turns * tokens``), in the same run. Reported: episodes/s, samples/s and
   generated tokens/s of each; the ratio is episode tokens/s over single-turn tokens/s (what the loop
   costs: a re-rendered, re-encoded conversation per turn, no KV cache kept across turns, the
   environment's step). The same conversations are then played by the environment itself through the
   pinned engine's loopback OpenAI endpoint (what a ``verifiers`` environment does): reported as
   episodes/s and its speed relative to the lockstep loop (one generate per turn, not one per batch).
2. **Infra injection**: the ``arithmetic`` task with a calculator that raises in ``--failure-rate`` of its
   calls (random, inside the sandbox), played by a scripted policy that always calls the tool and then
   answers with its result (a small in-process engine implementing the Engine interface). Every
   episode the model finishes is right, so any logged reward below 1 would be an infra failure that
   reached the numbers: reported as ``infra_in_logged`` (must be 0), with the retries it took.

The load average is printed first: on a shared machine, read the ratio, not the absolutes.

    .venv/bin/python bench/bench_envs.py [--episodes 32] [--turns 2] [--tokens 8] [--json OUT] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from ckpteval.coord.entries.env import EnvEntry
from ckpteval.coord.run.manifest import EvalSpec, RunManifest
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.work.units import WorkUnit
from ckpteval.jobs.eval.engines.base import Generation, SamplingParams
from ckpteval.jobs.eval.kinds.env import Tool
from ckpteval.jobs.eval.kinds.env.examples import CALCULATOR, ArithmeticEnv, arithmetic_rows
from ckpteval.jobs.eval.kinds.env.runner import Episode, render_transcript, run_unit
from ckpteval.jobs.eval.kinds.generate.evalsets import write_jsonl
from ckpteval.jobs.eval.kinds.generate.scoring import DatasetCache
from ckpteval.jobs.eval.sandbox.core import probe_bwrap

EXPR = re.compile(r"What is (.+?)\? You may")


class FlakyCalculatorEnv(ArithmeticEnv):
    """The arithmetic task whose calculator raises in ``rate`` of its calls (an unreliable tool service)."""

    def __init__(self, rate: float = 0.1) -> None:
        super().__init__()
        self.rate = rate

    def start(self, row: dict[str, Any]) -> tuple[list[dict[str, str]], list[Tool]]:
        messages, _ = super().start(row)
        flaky = CALCULATOR.source + (f"\nimport random as _r\n_calc = calculator\ndef calculator(expression):\n"
                                     f"    if _r.random() < {self.rate}:\n        raise ConnectionError('tool service down')\n"
                                     f"    return _calc(expression)\n")
        return messages, [Tool(CALCULATOR.name, CALCULATOR.description, CALCULATOR.parameters, flaky)]


class EchoEnv:
    """A minimal conversation for the overhead measurement (the tiny model's context is 64 tokens): the
    row's question, then ``+`` after every reply, never done."""

    def start(self, row: dict[str, Any]) -> tuple[list[dict[str, str]], list[Tool]]:
        return [{"role": "user", "content": row["prompt"]}], []

    def step(self, reply: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": "+"}]


class DrivenEchoEnv:
    """EchoEnv's conversation played by the environment itself through the pinned engine's loopback
    OpenAI endpoint (``DRIVES_MODEL``, as the verifiers adapter plays; 8 episodes at a time)."""

    DRIVES_MODEL = True

    def play(self, episodes: list[Episode], endpoint: Any, spec: EnvEntry) -> None:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda ep: self.one(ep, endpoint.base_url(ep.index, ep.sample), spec.max_turns), episodes))

    @staticmethod
    def one(ep: Episode, base_url: str, turns: int) -> None:
        messages: list[dict[str, Any]] = [{"role": "user", "content": ep.row["prompt"]}]
        with httpx.Client(timeout=300) as client:
            for _ in range(turns):
                reply = client.post(f"{base_url}/chat/completions", json={"model": "m", "messages": messages})
                reply.raise_for_status()
                messages += [reply.json()["choices"][0]["message"], {"role": "user", "content": "+"}]
        ep.end("out_of_turns", "never done")


class SolverEngine:
    """An in-process Engine (the real interface) whose replies are a scripted solver's: call the
    calculator on the question's expression, then answer with the tool's result."""

    def __init__(self) -> None:
        self.version: str | None = None

    def load(self, snapshot_dir: str, weight_version: str) -> None:
        self.version = weight_version

    def weight_version(self) -> str | None:
        return self.version

    def generate(self, prompts: list[str], params: SamplingParams, seeds: list[int] | None = None) -> list[Generation]:
        return [Generation(self.reply(p), self.version, 8) for p in prompts]

    @staticmethod
    def reply(text: str) -> str:
        last = text.split("\n")[-2]
        if last.startswith("tool: "):
            return f"ANSWER: {last[len('tool: '):]}"
        expression = EXPR.search(text).group(1)  # type: ignore[union-attr]
        return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'

    def healthy(self) -> bool:
        return True

    def restart(self) -> None:
        pass

    def close(self) -> None:
        pass


def env_cache(tmp: Path, name: str, rows: list[dict[str, Any]], **kw: Any) -> tuple[DatasetCache, EnvEntry]:
    run = RunDir.create(tmp / name)
    write_jsonl(run.data / f"{name}.jsonl", rows)
    spec = EnvEntry(name=name, path=f"data/{name}.jsonl", n_prompts=len(rows), shard_size=len(rows), **kw)
    run = RunDir.create(run.path, RunManifest(run_id=name, eval=EvalSpec(entries=(spec,)), snapshot_roots=()))
    return DatasetCache(run, run.manifest()), spec


def overhead(tmp: Path, episodes: int, turns: int, tokens: int) -> dict[str, float]:
    from ckpteval.jobs.eval.engines.hf.engine import HFEngine
    from ckpteval.jobs.reference.model import (
        ModelConfig,
        build_model,
        make_addition_examples,
        save_base_model_dir,
    )

    model = tmp / "model"
    save_base_model_dir(model, ModelConfig(), "llama", model=build_model(seed=0))
    engine = HFEngine(device="cpu")
    engine.load(str(model), "v")
    rows = [{"prompt": ex["prompt"]} for ex in make_addition_examples(episodes, seed=0)]
    cache, spec = env_cache(tmp, "echo", rows, env=f"{__name__}:{EchoEnv.__name__}", max_turns=turns,
                            max_new_tokens=tokens)
    first = [render_transcript(EchoEnv().start(r)[0], []) for r in rows]
    engine.generate(first[:2], SamplingParams(max_new_tokens=2))  # warm-up
    t0 = time.perf_counter()
    played, _, _ = run_unit(engine, cache, spec, WorkUnit(0, "echo", 0), None, "v")
    env_s = time.perf_counter() - t0
    env_tokens = sum(ep.tokens for ep in played)
    t0 = time.perf_counter()
    single = engine.generate(first, SamplingParams(max_new_tokens=turns * tokens))
    single_s = time.perf_counter() - t0
    single_tokens = sum(g.n_tokens for g in single)
    cache, spec = env_cache(tmp, "driven", rows, env=f"{__name__}:{DrivenEchoEnv.__name__}", max_turns=turns,
                            max_new_tokens=tokens)
    t0 = time.perf_counter()
    driven, _, _ = run_unit(engine, cache, spec, WorkUnit(0, "driven", 0), None, "v")
    driven_s = time.perf_counter() - t0
    engine.close()
    return {"episodes": episodes, "turns": sum(ep.turns for ep in played) / episodes, "env_s": env_s,
            "env_tokens": env_tokens, "episodes_per_s": episodes / env_s, "env_tokens_per_s": env_tokens / env_s,
            "single_s": single_s, "single_tokens": single_tokens, "samples_per_s": episodes / single_s,
            "single_tokens_per_s": single_tokens / single_s,
            "ratio": (env_tokens / env_s) / (single_tokens / single_s),
            "endpoint_s": driven_s, "endpoint_episodes_per_s": episodes / driven_s,
            "endpoint_turns": sum(ep.turns for ep in driven) / episodes, "endpoint_vs_lockstep": env_s / driven_s}


def infra_injection(tmp: Path, episodes: int, rate: float) -> dict[str, float]:
    cache, spec = env_cache(tmp, "arith", arithmetic_rows(episodes, seed=3), env=f"{__name__}:{FlakyCalculatorEnv.__name__}",
                            env_options={"rate": rate}, max_turns=3, infra_retries=4, tool_timeout_s=10.0)
    engine = SolverEngine()
    engine.load("", "v")
    played: list[Episode]
    played, _, _ = run_unit(engine, cache, spec, WorkUnit(0, "arith", 0), None, "v")
    rewards = [ep.reward for ep in played]
    return {"episodes": episodes, "failure_rate": rate, "infra_retries": sum(ep.retries for ep in played),
            "logged_reward": sum(rewards) / len(rewards), "infra_in_logged": sum(r != 1.0 for r in rewards)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=32, help="episodes (and single-turn samples)")
    parser.add_argument("--turns", type=int, default=2, help="turns per episode (the tiny model holds 64 tokens)")
    parser.add_argument("--tokens", type=int, default=8, help="new tokens per turn")
    parser.add_argument("--failure-rate", type=float, default=0.1, help="share of tool calls that raise")
    parser.add_argument("--smoke", action="store_true", help="8 episodes, 16 for the injection (seconds)")
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    args = parser.parse_args(argv)
    if args.smoke:
        args.episodes = 8
    print(f"load average {os.getloadavg()}, {os.cpu_count()} cpus")
    with tempfile.TemporaryDirectory() as tmp:
        out: dict[str, Any] = {"overhead": overhead(Path(tmp), args.episodes, args.turns, args.tokens)}
        why = probe_bwrap()
        if why is None:
            out["injection"] = infra_injection(Path(tmp), 16 if args.smoke else 4 * args.episodes, args.failure_rate)
        else:
            print(f"infra injection not run: {why}")
    o = out["overhead"]
    print(f"episodes: {o['episodes_per_s']:.2f}/s ({o['env_tokens_per_s']:.0f} tok/s, {o['turns']:.1f} turns); "
          f"single-turn samples: {o['samples_per_s']:.2f}/s ({o['single_tokens_per_s']:.0f} tok/s); "
          f"ratio (tokens/s) {o['ratio']:.2f}x")
    print(f"through the loopback OpenAI endpoint (env-driven, one generate per turn): {o['endpoint_episodes_per_s']:.2f} "
          f"episodes/s ({o['endpoint_turns']:.1f} turns), {o['endpoint_vs_lockstep']:.2f}x the lockstep loop's speed")
    if "injection" in out:
        i = out["injection"]
        print(f"injection: {i['episodes']} episodes at {i['failure_rate']:.0%} tool failures -> {i['infra_retries']} "
              f"infra retries, logged reward {i['logged_reward']:.3f}, infra failures in logged numbers "
              f"{i['infra_in_logged']}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
