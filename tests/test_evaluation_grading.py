"""Held-out evaluation grades as training does: cut completions and reasoning blocks."""

import json
import shutil

import numpy as np
import pytest

from rlax_pipe import evaluation
from rlax_pipe import grading
from rlax_pipe import tasks
from rlax_pipe import tokenizer as tokenizer_lib
from rlax_pipe.sampler import SamplerConfig
from rlax_pipe.types import Rollout


class ScriptedEngine:
  """Stands in for SamplerEngine: request k finishes with `script[prompt text]`."""

  def __init__(self, tok, task, script):
    self.cfg = SamplerConfig(max_seq_len=64, max_new_tokens=32)
    self.tok, self.task, self.script, self.requests = tok, task, script, []
    self.has_work = False

  def submit(self, request):
    self.requests.append(request)

  def run_to_completion(self):
    out = []
    for req in self.requests:
      text, reason = self.script[self.task.problem(req.prompt_index, "eval").prompt]
      ids = np.asarray(self.tok.encode(text) + ([self.tok.eos_id] if reason == "eos" else []),
                       np.int32)
      out.append(Rollout(sample_id=req.sample_id, group_id=req.group_id,
                         prompt_tokens=req.prompt_tokens, completion_tokens=ids,
                         behavior_logprobs=np.zeros(ids.shape, np.float32),
                         policy_versions=np.zeros(ids.shape, np.int32), finish_reason=reason,
                         prompt_index=req.prompt_index))
    self.requests = []
    return out


@pytest.mark.parametrize("policy,accuracy", [("zero", 0.5), ("mask", 0.5), ("keep", 1.0)])
def test_cut_and_reasoning_in_evaluation(tmp_path, policy, accuracy):
  shutil.copy(tokenizer_lib.default_tokenizer_path(), tmp_path / "tokenizer.model")
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": (
      "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
      "{% if add_generation_prompt %}<assistant>{% endif %}{# <think> ... </think> #}")}))
  tok = tokenizer_lib.load_tokenizer(tmp_path, prompt_format=tokenizer_lib.PromptFormat("chat"))
  path = tmp_path / "p.jsonl"
  path.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n"
                          for p in ("Q: a\n", "Q: b\n")))
  task = tasks.JsonlTask(tasks.JsonlConfig(path=path, eval_fraction=1.0))
  script = {"Q: a\n": ("<think>\nA: 2\n</think>\nA: 1", "eos"),   # right after the block
            "Q: b\n": ("<think>\nx\n</think>\nA: 1\nand on", "length")}  # right, but cut
  engine = ScriptedEngine(tok, task, script)
  problems = evaluation.eval_problems(task, 2)
  res = evaluation.evaluate(engine, task, tok, problems,
                            grading=grading.GradingConfig(overlong_policy=policy))
  assert res.num_problems == 2 and res.accuracy == accuracy
