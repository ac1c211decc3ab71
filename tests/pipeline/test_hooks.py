"""Progress-line pieces of the job's hooks (issue #17 item 7): the ETA and the clock labels."""

import pytest

from rlax_pipe.pipeline import hooks


def test_eta_ignores_the_compiling_first_step_and_compile_spikes():
  """The issue's input: the first ETA was the first step's time (compiles included) x steps
  left: 2,457 s where ~390 s remained. Now there is no ETA after step 1, and from step 2 on the
  median step (a later compile spike does not multiply into every remaining step)."""
  eta = hooks.Eta()
  wall = 82.0  # step 1: compilation
  eta.step(wall)
  assert eta.seconds_left(steps_left=29, evals_left=3) is None
  for duration in (12.0, 11.0, 60.0, 13.0):  # step 4 compiles a new batch shape
    wall += duration
    eta.step(wall)
  eta.eval_s = 8.0
  assert eta.seconds_left(steps_left=25, evals_left=3) == pytest.approx(12.5 * 25 + 24)


def test_evals_left_counts_periodic_and_final():
  assert hooks._evals_left(5, 30, 10) == 3   # 10, 20 and the final one
  assert hooks._evals_left(29, 30, 10) == 1
  assert hooks._evals_left(3, 3, 100) == 1


@pytest.mark.parametrize("seconds, text", [(None, "--"), (59.4, "59s"), (125.0, "2m05s")])
def test_duration_text(seconds, text):
  assert hooks._duration(seconds) == text
