"""Verifiers of the verifier-pool benchmark, in an importable module: the verifier processes
rebuild a task from its module and never import the calling script (`tasks.verifier_pool`)."""


class SpinTask:
  """Scores "A: 2"; spins forever on "hang" (a verifier stuck in a loop)."""

  name = "spin"

  def reward(self, problem, completion):
    while completion == "hang":
      pass
    return 1.0 if completion == "A: 2" else 0.0
