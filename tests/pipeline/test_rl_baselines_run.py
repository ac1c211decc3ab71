"""Tiny RL runs with the issue-24 baselines selected through the config: GSPO, a KL reference
(loss mode) and mean@n / pass@k evaluation, end to end in seconds."""

import dataclasses
import json

import pytest

from rlax_pipe.pipeline import run as run_lib


def test_gspo_with_kl_and_sampled_eval(tmp_path, tiny_init, tiny_config):
  """One run for the three features (the reward mode's learner step is tested in
  tests/learner/test_learner_kl.py)."""
  cfg = tiny_config(tmp_path, tiny_init, steps=2)
  cfg = dataclasses.replace(
      cfg,
      objective=dataclasses.replace(cfg.objective, name="gspo", aggregation="sequence_mean",
                                    clip_eps=3e-4, clip_eps_high=4e-4, kl="loss"),
      pipeline=dataclasses.replace(cfg.pipeline, eval_samples=4, eval_pass_k=(1, 2, 4)))
  summary = run_lib.run(cfg)
  rows = [json.loads(l) for l in open(f"{cfg.run_dir}/metrics.jsonl")]
  train = [r for r in rows if r["kind"] == "train"]
  evals = [r for r in rows if r["kind"] == "eval"]
  assert len(train) == 2 and all("kl_ref" in r for r in train)
  assert abs(train[0]["kl_ref"]) < 1e-5   # version 0 is the reference itself
  assert len(evals) == 2
  for r in evals:
    assert r["eval_samples"] == 4
    p1, p2, p4 = (r[f"heldout_pass_at_{k}"] for k in (1, 2, 4))
    assert 0.0 <= p1 <= p2 <= p4 <= 1.0
    assert p1 == pytest.approx(r["heldout_mean_at_4"])   # 0/1 rewards: pass@1 = mean@n
  assert set(summary["final_heldout_sampled"]) == {
      "heldout_mean_at_4", "heldout_pass_at_1", "heldout_pass_at_2", "heldout_pass_at_4"}
