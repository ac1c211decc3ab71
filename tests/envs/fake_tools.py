"""A test environment whose tools misbehave on purpose. In its own light module (no JAX): the
verifier worker processes import it to unpickle the environment."""

import time

from rlax_pipe.tasks import base as task_base


class FakeEnv:
  """Problem i calls the tool TOOL_OF_PROMPT[i % 6] in every turn (module level: picklable)."""

  name = "fake_env"

  def problem(self, index, split="train"):
    return task_base.Problem(index, split, f"Q: {index}\n", "0", "A: 0")

  def reward(self, problem, completion):
    return 0.0

  def tool_names(self):
    return ("echo", "boom", "hang", "flood", "slow")

  def call_tool(self, problem, call):
    if call.name == "boom":
      raise RuntimeError("tool bug")
    if call.name == "hang":
      time.sleep(60)
    if call.name == "flood":
      return "9" * 500
    if call.name == "slow":
      time.sleep(0.3)
    return "12"


