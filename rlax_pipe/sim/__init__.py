"""Systems model of asynchronous RL: closed forms, a discrete-event simulator, calibration.

  (costs         the cost model lives in `rlax_pipe.costs`, shared with the virtual clock);
  formulas      closed-form staleness / lag / step-period / idle models (Applied Compute,
                PipelineRL) and the log-normal extreme-value approximation;
  distributions completion-length distributions (empirical, grouped, replay, log-normal, Pareto);
  rewards       reward models (Beta solve rates, replay) for dynamic sampling's group filter;
  sim_config    what a simulation takes and returns (`SimConfig`, `SimResult`);
  simulator     discrete-event simulator of the sync / async-batch / pipeline drivers that runs
                the real driver rules, `RolloutQueue`, staleness and packing code and the
                engine's refill rule with the shared cost model;
  calibration   the simulator's inputs from a run directory (costs fitted to a threaded run's
                timed operations, lengths) and the numbers it predicts, measured on the run;
  whatif        cluster-scale what-if from the analytic accelerator cost model.
The validation against real runs is an experiment: experiments/lib/sim_validation.py.
"""

from rlax_pipe.sim.calibration import calibrate_run
from rlax_pipe.sim.calibration import measured
from rlax_pipe.sim.calibration import sim_config_for_run
from rlax_pipe.sim.distributions import BodyTail
from rlax_pipe.sim.distributions import Constant
from rlax_pipe.sim.distributions import Empirical
from rlax_pipe.sim.distributions import GroupedEmpirical
from rlax_pipe.sim.distributions import LogNormal
from rlax_pipe.sim.distributions import Pareto
from rlax_pipe.sim.distributions import Replay
from rlax_pipe.sim.formulas import applied_compute_staleness
from rlax_pipe.sim.formulas import expected_max_of_k
from rlax_pipe.sim.formulas import lognormal_expected_max
from rlax_pipe.sim.formulas import lognormal_tailness
from rlax_pipe.sim.formulas import pipeline_max_lag
from rlax_pipe.sim.formulas import split_for_rho
from rlax_pipe.sim.formulas import step_period
from rlax_pipe.sim.formulas import sync_idle_fraction
from rlax_pipe.sim.formulas import tailness
from rlax_pipe.sim.formulas import tailness_from_groups
from rlax_pipe.sim.rewards import RewardReplay
from rlax_pipe.sim.rewards import SolveRate
from rlax_pipe.sim.sim_config import SimConfig
from rlax_pipe.sim.sim_config import SimDeadlock
from rlax_pipe.sim.sim_config import SimResult
from rlax_pipe.sim.simulator import rates
from rlax_pipe.sim.simulator import simulate

__all__ = (
    "BodyTail", "Constant", "Empirical", "GroupedEmpirical", "LogNormal",
    "Pareto", "Replay", "RewardReplay", "SimConfig", "SimDeadlock", "SimResult",
    "applied_compute_staleness", "calibrate_run", "expected_max_of_k",
    "lognormal_expected_max", "lognormal_tailness", "measured", "pipeline_max_lag", "rates",
    "sim_config_for_run", "simulate", "SolveRate", "split_for_rho", "step_period", "sync_idle_fraction",
    "tailness", "tailness_from_groups",
)
