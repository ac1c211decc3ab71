"""PNG plots of a run from its metrics rows (matplotlib Agg canvas, no pyplot global state).

Every panel has a title and axis labels; a run-time axis says which clock it is on (metrics rows
carry `clock`: "virtual" in reproducible mode, whose durations are modelled by the cost model, or
"measured" wall-clock time in threaded mode).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def _figure(ncols: int = 1, width: float = 6.0):
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  fig = Figure(figsize=(width * ncols, 4.0))
  FigureCanvasAgg(fig)
  return fig


CLOCK_LABELS = {
    "virtual": "virtual clock: modelled device time",
    "measured": "measured wall clock, evaluation excluded",
}


def clock_of(rows: Sequence[dict]) -> str:
  """Which clock the rows' run times are on, in words (from their `clock` field)."""
  clocks = {r.get("clock") for r in rows if r.get("clock")}
  clock = clocks.pop() if len(clocks) == 1 else None
  return CLOCK_LABELS.get(clock, "clock not recorded")


def time_axis_label(rows: Sequence[dict]) -> str:
  """"run time (s, <which clock>)"."""
  return f"run time (s, {clock_of(rows)})"


def sampled_eval_keys(evals: Sequence[dict]) -> list[str]:
  """The mean@n / pass@k fields of eval rows (`heldout_mean_at_<n>`, `heldout_pass_at_<k>`),
  mean@n first, then pass@k by k."""
  keys = {k for r in evals for k in r if k.startswith(("heldout_mean_at_", "heldout_pass_at_"))}
  return sorted(keys, key=lambda k: (k.startswith("heldout_pass"), int(k.rsplit("_", 1)[1])))


def plot_reward_accuracy(rows: Sequence[dict], path: str) -> None:
  """Batch reward and held-out accuracy (greedy; plus mean@n and pass@k when the eval rows
  have them) against run time (seconds) and learner step."""
  train = [r for r in rows if r.get("kind") == "train"]
  evals = [r for r in rows if r.get("kind") == "eval"]
  fig = _figure(2)
  for i, key in enumerate(("time_s", "step")):
    ax = fig.add_subplot(1, 2, i + 1)
    ax.plot([r[key] for r in train], [r["reward_mean"] for r in train], label="batch reward",
            alpha=0.6)
    ax.plot([r[key] for r in evals], [r["heldout_accuracy"] for r in evals], "o-",
            label="held-out accuracy (greedy)")
    for name in sampled_eval_keys(evals):  # mean@n, pass@k of PipelineConfig.eval_samples
      ax.plot([r[key] for r in evals if name in r], [r[name] for r in evals if name in r],
              "s--", label=name.replace("heldout_", "held-out ").replace("_at_", "@"))
    ax.set_xlabel(time_axis_label(rows) if key == "time_s" else "learner step")
    ax.set_ylabel("reward / accuracy")
    ax.set_title("Reward and held-out accuracy vs " + ("run time" if key == "time_s"
                                                        else "learner step"))
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
  fig.tight_layout()
  fig.savefig(path, dpi=90)


def plot_lag_hist(rows: Sequence[dict], path: str) -> None:
  """Per-token lag histogram summed over the run (tokens in gradients with lag 0, 1, ...)."""
  hists = [np.asarray(r["lag_hist"]) for r in rows if r.get("kind") == "train"]
  fig = _figure()
  ax = fig.add_subplot(1, 1, 1)
  if hists:
    total = np.sum(hists, axis=0)
    ax.bar(np.arange(total.shape[0]), total)
    ax.set_xticks(np.arange(total.shape[0]))
    ax.set_xticklabels([str(i) for i in range(total.shape[0] - 1)] + [f">={total.shape[0] - 1}"])
  ax.set_xlabel("token lag (learner version - token's policy version)")
  ax.set_ylabel("tokens trained")
  ax.set_title("Per-token lag of the trained tokens (whole run)")
  fig.tight_layout()
  fig.savefig(path, dpi=90)


def plot_staleness(rows: Sequence[dict], path: str) -> None:
  """Both staleness measures per learner step: per-token (mean lag over the trained tokens) and
  per-sample (mean over the trained samples of their oldest token's lag, Applied Compute's)."""
  train = [r for r in rows if r.get("kind") == "train"]
  fig = _figure()
  ax = fig.add_subplot(1, 1, 1)
  for key, label in (("sample_lag_mean", "per-sample (oldest token), mean"),
                     ("token_lag_mean", "per-token, mean")):
    ax.plot([r["step"] for r in train], [r.get(key, np.nan) for r in train], label=label)
  ax.set_xlabel("learner step")
  ax.set_ylabel("staleness (learner steps)")
  ax.set_title("Staleness of the trained samples: per sample (oldest token) and per token")
  ax.legend(loc="upper left")
  fig.savefig(path, dpi=90)


def plot_idle(rows: Sequence[dict], path: str) -> None:
  """Idle fraction of each mesh over learner steps (cumulative from the run start)."""
  train = [r for r in rows if r.get("kind") == "train"]
  fig = _figure()
  ax = fig.add_subplot(1, 1, 1)
  for key, label in (("idle_sampler", "sampler mesh"), ("idle_learner", "learner mesh")):
    ax.plot([r["step"] for r in train], [r.get(key, np.nan) for r in train], label=label)
  ax.set_ylim(0, 1)
  ax.set_xlabel("learner step")
  ax.set_ylabel("idle fraction (cumulative)")
  ax.set_title(f"Idle fraction of each mesh ({clock_of(train)})")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=90)
