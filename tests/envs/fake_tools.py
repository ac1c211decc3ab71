"""A test environment whose tools misbehave on purpose. In its own light module (no JAX): the
verifier worker processes import it to unpickle the environment."""

import time

from rlax_pipe.tasks import base as task_base
from rlax_pipe.tasks.arithmetic import ArithmeticTask


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




class EchoArithmetic(ArithmeticTask):
  """The arithmetic task whose every turn calls "echo" (any non-empty last line), answered
  "12": an environment for pipeline tests with a random-weight model."""

  name = "echo_arithmetic"
  call_pattern = r"(?P<arguments>.*\S.*)"

  def tool_names(self):
    return ("echo",)

  def call_tool(self, problem, call):
    return "12"
