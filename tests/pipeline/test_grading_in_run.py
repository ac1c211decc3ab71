"""End to end: a JSONL task with a 66-token prompt and max_seq_len 48 runs (issue #14 item 3) and
the per-step metrics carry the grading counts."""

import dataclasses
import json

from rlax_pipe import tasks
from rlax_pipe.pipeline import run as run_lib

LONG_PROMPT = "Q: " + "+".join(["7"] * 31) + "\n"   # 66 tokens with BOS


def test_overlong_prompt_is_filtered_and_the_run_goes_on(tmp_path, tiny_init, tiny_config,
                                                          train_rows):
  rows = [{"prompt": f"Q: {a}+{b}\n", "answer": str(a + b)} for a, b in ((1, 2), (3, 4), (5, 1))]
  rows.insert(1, {"prompt": LONG_PROMPT, "answer": "217"})  # 3 steps need > 1 epoch of 4 rows
  train, evals = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
  train.write_text("".join(json.dumps(r) + "\n" for r in rows))
  evals.write_text(json.dumps({"prompt": LONG_PROMPT, "answer": "217"}) + "\n"
                   + json.dumps({"prompt": "Q: 9+9\n", "answer": "18"}) + "\n")
  cfg = tiny_config(tmp_path, tiny_init, steps=3)
  assert cfg.sampler.max_seq_len == 48
  cfg = dataclasses.replace(cfg, task="jsonl",
                            task_config=tasks.JsonlConfig(path=str(train), eval_path=str(evals)))
  summary = run_lib.run(cfg)
  assert summary["steps"] == 3
  rows = train_rows(cfg.run_dir)
  assert sum(r["filtered_overlong"] for r in rows) >= 1    # the long prompt was skipped
  for r in rows:
    assert 0.0 <= r["frac_length_cut"] <= 1.0 and r["samples_unrewarded"] == 0
    assert r["reward_error"] == r["reward_timeout"] == r["reward_invalid"] == 0
  assert sum(r["reward_ok"] for r in rows) >= 3 * 2 * 2    # steps x groups x group size
  evals = [json.loads(line) for line in open(f"{cfg.run_dir}/metrics.jsonl")]
  evals = [r for r in evals if r["kind"] == "eval"]
  # The eval set cycles over the 2 eval lines, one of them over-long: half is filtered.
  assert evals and all(r["eval_filtered_overlong"] == cfg.pipeline.eval_problems // 2
                       for r in evals)
  assert all(r["eval_failed_rewards"] == 0 for r in evals)
