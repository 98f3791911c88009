"""GRPO with TRL's ``GRPOTrainer``, evaluated by ckpteval from the Trainer's own checkpoints.

A TRL trainer is a ``transformers.Trainer``, so ``EvalDispatchCallback`` plugs in as the user guide
shows for a plain ``Trainer`` (reuse mode: each ``checkpoint-N/`` the Trainer saves is the snapshot).
Everything is local: the model is built from a config (the reference tiny model, character tokenizer),
the prompts (``prompts.jsonl``) and the eval set (``eval.json`` -> ``sums.jsonl``) are the files next
to this script. Nothing is downloaded. Known to work with trl 1.16.0 on transformers 5.24.0.

    ckpteval worker --run-dir runs/trl --wait-for-run 120 &
    python examples/trl/grpo.py --run-dir runs/trl --output-dir trl-out

Limits: a few CPU steps of a 1-layer model learn next to nothing; the point is the plumbing (every
checkpoint the Trainer saves becomes a scored point), not the reward curve.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def reward(completions: list[str], answer: list[str], **_: object) -> list[float]:
    """1 for the exact sum, plus 0.1 per leading digit right (a dense signal for a tiny model)."""
    scores = []
    for text, want in zip(completions, answer, strict=True):
        got = text.strip()
        scores.append(float(got == want) + 0.1 * sum(a == b for a, b in zip(got, want, strict=False)))
    return scores


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--run-dir", default="runs/trl", help="the ckpteval run directory (the worker's --run-dir)")
    parser.add_argument("--output-dir", default="trl-out", help="the Trainer's output_dir (its checkpoint-N/)")
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--save-steps", type=int, default=2)
    args = parser.parse_args(argv)

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from ckpteval.jobs.reference.model import ModelConfig, build_model, build_tokenizer, save_base_model_dir
    from ckpteval.jobs.trainer.config import DispatchConfig
    from ckpteval.jobs.trainer.hf_callback import EvalDispatchCallback
    from ckpteval.jobs.trainer.session import EvalRun, start_eval

    shape = ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=64)
    base = save_base_model_dir(Path(args.output_dir).parent / "trl-base-model", shape)  # yours: the model you start from
    tok, model = build_tokenizer(), build_model(shape)
    rows = [json.loads(line) for line in (HERE / "prompts.jsonl").read_text().splitlines() if line.strip()]
    config = GRPOConfig(output_dir=args.output_dir, max_steps=args.max_steps, save_strategy="steps",
                        save_steps=args.save_steps, per_device_train_batch_size=4, num_generations=4,
                        max_completion_length=4, learning_rate=3e-3, use_cpu=True, report_to=[],
                        disable_tqdm=True, logging_steps=1)
    dispatcher = start_eval(EvalRun(run_dir=args.run_dir, eval_config=HERE / "eval.json", base_model_dir=base,
                                    dispatch=DispatchConfig(eval_interval=args.save_steps, save_hf_dir=config.output_dir,
                                                            save_interval=config.save_steps).with_waits(poll_interval_s=0.2)))
    GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=Dataset.from_list(rows),
                processing_class=tok, callbacks=[EvalDispatchCallback(dispatcher)]).train()


if __name__ == "__main__":
    main()
