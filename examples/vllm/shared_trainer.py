"""A vLLM-based trainer in miniature, evaluated by ckpteval's shared posture on its own vLLM rollout server (CPU).

The trainer trains the tiny reference model (untied lm_head: a CPU vLLM reloads it in place) while a rollout client
keeps its vLLM server busy; every ``--eval-interval`` steps ckpteval pauses the server (``/pause?mode=keep``: the
rollouts freeze, none is aborted), loads the step's snapshot from disk, stamps and reads back its version, resumes and
evaluates on it. docs/USER_GUIDE.md "vLLM-based trainers (prime-rl, verl, TRL)". Usage::

    python examples/vllm/shared_trainer.py --run-dir runs/vllm-shared            # launches the rollout server
    python examples/vllm/shared_trainer.py --run-dir runs/vllm-shared --attach http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import json
import os
import threading
from pathlib import Path

import httpx
import torch

from ckpteval.jobs.eval.engines.vllm.engine import VLLMEngine
from ckpteval.jobs.reference.model import (
    ModelConfig,
    batch_for_training,
    build_model,
    build_tokenizer,
    make_addition_examples,
    save_base_model_dir,
    save_hf_checkpoint,
)
from ckpteval.jobs.trainer.config import DispatchConfig
from ckpteval.jobs.trainer.gate import ProducerGate, SharedEval
from ckpteval.jobs.trainer.session import EvalRun, start_eval

VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
CPU_SERVER = {"dtype": "float32", "max_model_len": 64, "enforce_eager": True}  # the reference model on CPU


def rollouts(url: str, model: str, stop: threading.Event, done: list[str]) -> None:
    """The trainer's rollout client: requests one after another, straight to the server (not through ckpteval)."""
    with httpx.Client(base_url=url, timeout=600) as client:
        while not stop.is_set():
            body = {"model": model, "prompt": ["12+34="] * 32, "max_tokens": 40, "temperature": 1.0, "ignore_eos": True}
            done.extend(c["finish_reason"] for c in client.post("/v1/completions", json=body).json()["choices"])


def main(run_dir: Path, attach: str | None, steps: int, eval_interval: int) -> list[dict]:
    work = run_dir.parent / f"{run_dir.name}-files"
    work.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig(tie_word_embeddings=False)
    model, tokenizer = build_model(cfg, seed=0), build_tokenizer()
    base = save_base_model_dir(work / "base-model", cfg)
    rows = make_addition_examples(16, seed=11)
    (work / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (work / "eval.json").write_text(json.dumps({"eval": {"datasets": [
        {"name": "sums", "path": str(work / "sums.jsonl"), "n_prompts": 16, "shard_size": 8, "max_new_tokens": 4}]}}))
    server = None
    if attach is None:  # a trainer launches its rollout server on its initial weights; here ckpteval's launcher does
        server = VLLMEngine(python=str(VLLM_PYTHON), env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}, **CPU_SERVER)
        server.load(str(save_hf_checkpoint(work / "init", 0, model)), "trainer-0")
    url = attach or server.base_url  # type: ignore[union-attr]
    served = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    stop, finished = threading.Event(), []
    client = threading.Thread(target=rollouts, args=(url, served, stop, finished), daemon=True)
    client.start()
    dispatcher = start_eval(EvalRun(run_dir=run_dir, eval_config=work / "eval.json", base_model_dir=base,
                                    dispatch=DispatchConfig(eval_interval=eval_interval)),
                            shared=SharedEval(VLLMEngine(url), ProducerGate()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    train = make_addition_examples(8 * steps, seed=5)
    try:
        dispatcher.maybe_dispatch(0, model)
        for step in range(1, steps + 1):
            model.train()
            loss = model(**batch_for_training(train[8 * (step - 1): 8 * step], tokenizer)).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            model.eval()
            dispatcher.maybe_dispatch(step, model)
        dispatcher.close(steps, model)
    finally:
        stop.set()
        client.join(600)
        if server is not None:
            server.close()
    points = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"eval/step"' in x]
    for p in points:
        print(f"step {p['eval/step']}: eval/sums {p['eval/sums']:.3f}, version mean "
              f"{p['eval/sums/weight_version/mean']}, lag {p['eval/lag_steps']}")
    print(f"rollouts finished meanwhile: {len(finished)}, aborted: {finished.count('abort')}")
    return points


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", type=Path, default=Path("runs/vllm-shared"))
    parser.add_argument("--attach", metavar="URL", help="the trainer's vLLM server (VLLM_SERVER_DEV_MODE=1); default: launch one")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--eval-interval", type=int, default=2)
    args = parser.parse_args()
    main(args.run_dir, args.attach, args.steps, args.eval_interval)
