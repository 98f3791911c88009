"""Reasoning-model evaluation: the reasoning strip, finish reasons, truncated / no-answer / length metrics,
pass^k, and chat_template_kwargs reaching the template.

Real parts: the tiny model does not think, so reasoning traces come from
:class:`tests.support.canned_engine.CannedEngine` (a real HTTP server speaking sglang's ``/generate``,
``finish_reason`` ``stop`` or ``length``) through the real :class:`HTTPEngine`, the real ``generate`` kind,
the real math-verify grader, real result files pooled into a point by the real derivation; the chat
template is a real tokenizer's (the reference tokenizer saved with a template that branches on
``enable_thinking``, as Qwen3's does).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from ckpteval.coord.entries.env import EnvEntry
from ckpteval.coord.entries.generate import GenerateEntry
from ckpteval.coord.results.files import ResultIndex
from ckpteval.coord.results.points import derive_point, pass_at_k, pass_hat_k, point_metrics
from ckpteval.coord.run.identity import run_key, weight_version
from ckpteval.coord.run.manifest import EvalSpec, LeaseSettings, RunManifest, parse_manifest
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.work.units import units_for_step
from ckpteval.jobs.eval.engines.base import Generation
from ckpteval.jobs.eval.engines.fn import parse_output
from ckpteval.jobs.eval.engines.hf.decode import Completion
from ckpteval.jobs.eval.engines.http.engine import HTTPEngine
from ckpteval.jobs.eval.engines.http.generate import parse_generation
from ckpteval.jobs.eval.kinds.env.runner import Episode, Renderer
from ckpteval.jobs.eval.kinds.evaluate import evaluate_pinned, unit_result
from ckpteval.jobs.eval.kinds.generate.answering import resolve_reasoning
from ckpteval.jobs.eval.kinds.generate.evalsets import write_jsonl
from ckpteval.jobs.eval.kinds.generate.prompts import render_prompts
from ckpteval.jobs.eval.kinds.generate.reasoning import ReasoningSetting, split_reasoning
from ckpteval.jobs.eval.kinds.generate.scoring import DatasetCache
from ckpteval.jobs.reference.model import save_tokenizer
from ckpteval.jobs.views.plot import plot_series
from ckpteval.jobs.views.status.main import collect_status, points_table
from tests.support.canned_engine import CannedEngine

THINK = ReasoningSetting(end="</think>", start="<think>")


# -- the strip itself ---------------------------------------------------------------------------------
def test_the_answer_is_after_the_first_end_and_a_trace_that_never_ends_has_none() -> None:
    wrong_then_right = split_reasoning("<think>is it 41?</think> 42", THINK)
    assert wrong_then_right == ("is it 41?", " 42")
    right_then_wrong = split_reasoning("<think>42</think>41 </think> 42", THINK)  # a second end is answer text
    assert right_then_wrong.answer == "41 </think> 42"
    assert split_reasoning("<think>42 ... 42 ... 42", THINK).answer is None  # cut off: never scored
    assert split_reasoning("42", THINK) == ("", "42")  # did not think (enable_thinking false): all answer
    assert split_reasoning("41 then <think>42", THINK).answer is None  # opened later, never closed
    # the prompt opened the block (a template whose generation prompt ends in <think>): no tag in the text
    assert split_reasoning("42", THINK, prompt="<|assistant|><think>\n").answer is None
    assert split_reasoning("41</think>42", THINK, prompt="<|assistant|><think>\n") == ("41", "42")
    # no start known (deepseek-r1 style): every completion begins in reasoning
    assert split_reasoning("41</think>42", ReasoningSetting("</think>")) == ("41", "42")
    assert split_reasoning("42", ReasoningSetting("</think>")).answer is None
    assert split_reasoning("41</think>42", None) == ("", "41</think>42")


def test_pass_hat_k_is_the_chance_that_k_drawn_samples_are_all_right() -> None:
    assert pass_hat_k(4, 4, 4) == 1.0 and pass_hat_k(4, 3, 4) == 0.0
    assert pass_hat_k(4, 2, 2) == pytest.approx(1 / 6)  # C(2,2)/C(4,2)
    assert pass_hat_k(5, 3, 1) == pass_at_k(5, 3, 1) == pytest.approx(0.6)
    with pytest.raises(ValueError, match="pass\\^k"):
        pass_hat_k(4, 5, 2)


def test_run_json_refuses_malformed_reasoning_and_template_kwargs() -> None:
    base = {"name": "d", "path": "d.jsonl", "n_prompts": 1}
    for bad, why in (({"reasoning": {"end": ""}}, "non-empty"), ({"reasoning": {"end": "</think>", "stop": 1}}, "keys"),
                     ({"reasoning": {"end": "</think>", "always": "yes"}}, "always"),
                     ({"chat_template_kwargs": {"enable_thinking": False}}, "prompt_format 'chat'"),
                     ({"prompt_format": "chat", "chat_template_kwargs": {"tools": []}}, "rendering sets")):
        obj = {"run_id": "r", "eval": {"datasets": [{**base, **bad}]}, "snapshot_roots": ["/s"]}
        with pytest.raises(ValueError, match=why):
            parse_manifest(obj, Path("run.json"))


# -- a scripted reasoning run, end to end through the http engine ------------------------------------------
ANSWER = "42"
CUT = ("<think>" + "let me see 42 " * 6, "length")  # cut at the length limit inside its reasoning
TRACES: dict[str, list] = {
    "q0": ["<think>maybe \\boxed{41}?</think> so \\boxed{42}"] * 4,  # wrong in thoughts, right in answer
    "q1": ["<think>\\boxed{42}</think>The answer is 41.",  # right in thoughts, wrong in answer
           "<think>hm</think>The answer is 42.", CUT, "42"],  # ... the last did not think at all
    "q2": [CUT] * 4,
    "q3": ["<think>ok</think>"] * 4,  # ended its reasoning, then said nothing
}


def reasoning_run(tmp: Path) -> tuple[RunDir, RunManifest]:
    sampled = dict(n_prompts=4, shard_size=2, n_samples=4, temperature=1.0, pass_k=(1, 2, 4), scorer="math",
                   max_new_tokens=64)
    specs = (GenerateEntry("think", "data/q.jsonl", reasoning={"end": "</think>", "start": "<think>"},
                         samples_per_unit=2, **sampled),
             GenerateEntry("plain", "data/q.jsonl", **sampled))  # the same completions, scored whole
    manifest = RunManifest(run_id="think", eval=EvalSpec(entries=specs), created=1.0,
                           snapshot_roots=(str(tmp / "run" / "snapshots"),), lease=LeaseSettings(30.0, 5.0))
    run = RunDir.create(tmp / "run", manifest)
    write_jsonl(run.data / "q.jsonl", [{"prompt": q, "answer": ANSWER} for q in TRACES])
    return run, manifest


def test_scripted_reasoning_traces_score_their_answers_only(tmp_path: Path) -> None:
    """Every unit of a step through the real http engine and generate kind, published and pooled: the
    reasoning set scores answers only (a right number in the thoughts never counts), a cut-off trace is
    truncated and has no answer, and the point's pass@k / pass^k / shares are the hand-computed ones."""
    run, manifest = reasoning_run(tmp_path)
    cache = DatasetCache(run, manifest)
    want = weight_version(run_key(manifest), 5)
    index = ResultIndex(run.results)
    with CannedEngine(TRACES) as url:
        engine = HTTPEngine(url)
        engine.load("/nowhere", want)
        for unit in units_for_step(manifest, 5):  # in order: each prompt's 4 canned traces, per dataset
            assert index.publish(unit_result(unit, evaluate_pinned(engine, cache, unit, "/nowhere", want)))
        engine.close()
    results = index.refresh()
    point = derive_point(manifest, 5, results)
    think, plain = point.datasets["think"], point.datasets["plain"]
    # per prompt right: q0 4, q1 2 (the answer 42 and the one that did not think), q2 0 (cut), q3 0 (empty)
    assert think.score == 6 / 16
    assert think.derived["pass@2"] == pytest.approx((1 + 5 / 6) / 4)
    assert think.derived["pass^2"] == pytest.approx((1 + 1 / 6) / 4)
    assert think.derived["pass@4"] == 0.5 and think.derived["pass^4"] == 0.25
    assert "pass^1" not in think.derived  # it is pass@1
    assert think.extras["truncated"] == 5 / 16  # one cut trace in q1, four in q2
    assert think.extras["no_answer"] == 9 / 16  # the cut ones (never ended) and q3's empty answers
    tokens = [max(1, len((t if isinstance(t, str) else t[0]).split())) for q in TRACES.values() for t in q]
    assert think.extras["completion_tokens"] == sum(tokens) / 16
    # the same completions scored whole: the right number in q1's thoughts scores, the cut traces score
    assert plain.score == 12 / 16  # q0 4, q1 4, q2 4 (cut traces full of 42), q3 0
    first_q1 = next(r for u, r in results.items() if u.dataset == "think" and u.shard == 0 and u.sample_start == 0)
    assert first_q1.scores[2:] == (0.0, 1.0) and first_q1.answers[2] == "41"
    assert think.extras["truncated"] == plain.extras["truncated"]  # the engine's verdict, not the scorer's
    metrics = point_metrics(point)
    for name in ("pass^4", "truncated", "no_answer", "completion_tokens"):
        assert f"eval/think/{name}" in metrics
    # the strip is in the units' scoring identity: a unit scored otherwise would not pool with these
    ids = {json.dumps(r.scorer, sort_keys=True) for u, r in results.items() if u.dataset == "think"}
    assert len(ids) == 1 and json.loads(ids.pop())["reasoning"] == {"end": "</think>", "start": "<think>", "always": False}
    assert "reasoning" not in next(r for u, r in results.items() if u.dataset == "plain").scorer
    other = {u: replace(r, scorer={**r.scorer, "reasoning": {**r.scorer["reasoning"], "end": "</answer>"}})
             if u == first_q1.unit else r for u, r in results.items()}
    assert derive_point(manifest, 5, other).mixed_scorers == ("think",)  # one unit stripped otherwise: not pooled
    # status shows them in the "<ds> length" column, the plot in its length panel
    status = collect_status(run.path)
    table = points_table(status)
    headers = [c.header for c in table.columns]
    assert table.rows[0][headers.index("think length")].startswith("trunc=0.31 noans=0.56 tok=")
    assert table.rows[0][headers.index("pass^4")] == "0.250"  # the first pass^4 column is think's
    assert plot_series(status)["lengths"]["think truncated"] == ([5], [5 / 16])


# -- chat_template_kwargs ------------------------------------------------------------------------------
THINKING_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)


def save_thinking_tokenizer(snap: Path) -> None:
    """The reference tokenizer saved at ``snap`` with :data:`THINKING_TEMPLATE` as its chat template."""
    save_tokenizer(snap, chat=True)
    config = json.loads((snap / "tokenizer_config.json").read_text())
    (snap / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": THINKING_TEMPLATE}))
    (snap / "chat_template.jinja").unlink(missing_ok=True)
    (snap / "chat_template.jinja").write_text(THINKING_TEMPLATE)


def test_chat_template_kwargs_reach_the_template_and_decide_where_reasoning_starts(tmp_path: Path) -> None:
    """A Qwen3-style template: thinking on opens ``<think>`` in the prompt (an answer without ``</think>``
    is then unterminated reasoning: no answer); ``enable_thinking: false`` closes it there (all answer)."""
    snap = tmp_path / "snap"
    save_thinking_tokenizer(snap)
    rows = [{"prompt": "q", "answer": "42"}]
    on = GenerateEntry("on", "d.jsonl", 1, prompt_format="chat")
    off = GenerateEntry("off", "d.jsonl", 1, prompt_format="chat", chat_template_kwargs={"enable_thinking": False})
    (prompt_on,), (prompt_off,) = render_prompts(on, rows, str(snap)), render_prompts(off, rows, str(snap))
    assert prompt_on.endswith("<|assistant|><think>\n") and prompt_off.endswith("</think>\n\n")
    assert split_reasoning("42", THINK, prompt_on).answer is None
    assert split_reasoning("42", THINK, prompt_off).answer == "42"
    assert split_reasoning("41</think>42", THINK, prompt_on).answer == "42"
    # the multi-turn path (env episodes, and the pinned OpenAI endpoint, which renders through the same Renderer)
    env = EnvEntry(name="e", path="e.jsonl", n_prompts=1, env="arithmetic", prompt_format="chat",
                  chat_template_kwargs={"enable_thinking": False})
    episode = Episode(0, 0, {}, messages=[{"role": "user", "content": "q"}], tools=[])
    assert Renderer(env, str(snap))(episode) == prompt_off


# -- finish reasons from every engine ------------------------------------------------------------------
def test_every_engine_reports_how_a_generation_stopped() -> None:
    """sglang's ``meta_info.finish_reason`` (http), the hf engine's completion, an fn backend's output."""
    meta = {"completion_tokens": 3, "prompt_tokens": 2, "weight_version": "r@1"}
    for kind, want in (({"type": "length", "length": 3}, "length"), ({"type": "stop", "matched": 2}, "stop"),
                       ({"type": "stop", "matched": "</s>"}, "stop")):
        assert parse_generation({"text": "x", "meta_info": {**meta, "finish_reason": kind}}).generation.finish_reason == want
    cut = Completion("x", [5, 6], {"type": "length", "length": 2}, 3, "r@1").generation()
    assert cut.finish_reason == "length" and Generation("x", None, 1).finish_reason is None
    out = parse_output({"scores": [1.0, 0.0, 0.0], "finish_reasons": ["stop", "length", None]}, 3, "1")
    assert out.extras() == {"truncated": {"sum": 1.0, "n": 2}}  # the unknown one is not counted
    assert parse_output({"scores": [1.0]}, 1, "1").extras() == {}
    with pytest.raises(ValueError, match="finish_reasons"):
        parse_output({"scores": [1.0], "finish_reasons": ["eos"]}, 1, "1")


def test_reasoning_end_tokenizer_reads_the_snapshot_tokenizers_own_pair(tmp_path: Path) -> None:
    """``{"end": "tokenizer"}``: the pair in the tokenizer's vocabulary; none, or an end that decoding drops
    (a special token), is a clear error naming the dataset and snapshot, never a silent no-strip."""
    spec = GenerateEntry("d", "d.jsonl", 1, reasoning={"end": "tokenizer"})
    plain, thinking, special = tmp_path / "plain", tmp_path / "thinking", tmp_path / "special"
    for path in (plain, thinking, special):
        save_tokenizer(path)
    with pytest.raises(RuntimeError, match="none of the known pairs"):
        resolve_reasoning(spec, str(plain))
    tok = AutoTokenizer.from_pretrained(thinking)
    tok.add_tokens(["<think>", "</think>"])
    tok.save_pretrained(thinking)
    assert resolve_reasoning(spec, str(thinking)).setting == ReasoningSetting("</think>", "<think>")
    tok = AutoTokenizer.from_pretrained(special)
    tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    tok.save_pretrained(special)
    with pytest.raises(RuntimeError, match="special token"):
        resolve_reasoning(spec, str(special))


# -- sglang's named reasoning parsers (#37) ---------------------------------------------------------------
@pytest.mark.parametrize("parser, text, split", [
    # DeepSeekR1Detector: force_reasoning, no opening tag needed
    ("deepseek-r1", "thinking</think>42", ("thinking", "42")),
    ("deepseek-r1", "thinking, never ended", ("thinking, never ended", None)),
    # Qwen3/GLM-4.5/Kimi-K2: an unclosed block ends at the tool-call tag, kept in the answer
    ("qwen3", "<think>plan<tool_call>{\"name\": \"f\"}</tool_call>", ("plan", "<tool_call>{\"name\": \"f\"}</tool_call>")),
    ("glm45", "<think>plan<tool_call>f", ("plan", "<tool_call>f")),
    ("kimi_k2", "<think>plan<|tool_calls_section_begin|>x", ("plan", "<|tool_calls_section_begin|>x")),
    ("qwen3", "<think>a</think>b<tool_call>c", ("a", "b<tool_call>c")),  # closed: the end decides
    ("qwen3", "no reasoning <tool_call>c", ("", "no reasoning <tool_call>c")),  # qwen3 does not force
])
def test_named_parsers_split_as_sglangs_detectors(parser: str, text: str, split: tuple[str, str | None]) -> None:
    """srt/parser/reasoning_parser.py (0.5.23) ``_detect_and_parse_impl`` with each DetectorMap entry's
    ``force_reasoning`` and ``tool_start_token``; the old split took an unclosed block with a tool call as no
    answer, and had no way to say deepseek-r1 forces reasoning with its ``<think>`` known."""
    from ckpteval.coord.run.chat_settings import check_reasoning
    from ckpteval.jobs.eval.kinds.generate.reasoning import parse_setting

    check_reasoning({"parser": parser})
    assert tuple(split_reasoning(text, parse_setting({"parser": parser}))) == split
