r"""Gradient fidelity of each objective on stale batches (issue 26): table, verdicts, figure.

  python3 experiments/gradient_fidelity.py --preset=stress --out_dir=runs/fidelity
  python3 experiments/gradient_fidelity.py --preset=tiny --out_dir=/tmp/fid    # seconds-scale
  python3 experiments/gradient_fidelity.py --preset=stress --lags=0,4,16 --batches=8

Trains its own short synchronous run of the regime for checkpoints (or reads --checkpoints, an
.npz this script wrote with --save_checkpoints), then compares each objective's gradient on
batches sampled k versions behind with the on-policy gradient (experiments/lib/fidelity_run.py).
Writes fidelity.json (rows, claims, timings), fidelity.md and fidelity.png to --out_dir and
prints the claims as one JSON line; with --pareto_sweep also pareto.json / pareto.png (item 4,
experiments/lib/fidelity_pareto.py), with --pareto_pinned=<pinned.json> pareto_pinned.{json,png}
from the pinned systems run's validated cost model. --from_json re-reports an earlier fidelity.json.
"""

import dataclasses
import json
import pathlib

from absl import app
from absl import flags

from configs import stress
from lib import fidelity_pareto
from lib import fidelity_report
from lib import fidelity_run

_PRESET = flags.DEFINE_enum("preset", "stress", ["stress", "tiny"], "Regime and sizes: the "
                            "stress regime (configs/stress.py) or its tiny test variant.")
_OUT = flags.DEFINE_string("out_dir", "runs/gradient_fidelity", "Output directory.")
_LAGS = flags.DEFINE_list("lags", None, "Fixed lags (steps); default: the preset's.")
_MIXED = flags.DEFINE_list("mixed_lags", None, "Max lags of the in-flight mix case ('' = none).")
_BATCHES = flags.DEFINE_integer("batches", None, "Stale batches per target and case (>= 2).")
_TRUE = flags.DEFINE_integer("true_batches", None, "On-policy batches per target (>= 2).")
_TARGETS = flags.DEFINE_integer("num_targets", None, "Target versions compared (>= 1).")
_STRIDE = flags.DEFINE_integer("target_stride", None, "Steps between target versions.")
_TPV = flags.DEFINE_integer("tokens_per_version", None, "In-flight mix: tokens per version.")
_BF16 = flags.DEFINE_bool("bf16_case", None, "Measure the bf16-sampler case at lag 0.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the run, prompts and sampling.")
_CKPTS = flags.DEFINE_string("checkpoints", None, "Checkpoints .npz to read instead of training.")
_SAVE = flags.DEFINE_string("save_checkpoints", None, "Write the trained checkpoints here.")
_FROM = flags.DEFINE_list("from_json", None, "Re-report fidelity.json files (no new "
                          "measurement); several: their rows merged (fidelity_report.merge).")
_PARETO = flags.DEFINE_string("pareto_sweep", None, "A sweep_staleness.py table.json: also "
                              "write pareto.json / pareto.png (throughput vs fidelity).")
_PINNED = flags.DEFINE_string("pareto_pinned", None, "A pinned_systems_run.py pinned.json: "
                              "pareto.json / pareto.png with the throughput side predicted per "
                              "max lag by its validated cost model (item 4).")

PRESETS = {
    "stress": fidelity_run.InstrumentConfig(),
    "tiny": fidelity_run.InstrumentConfig(lags=(0, 2), mixed_lags=(2,), tokens_per_version=4,
                                          num_targets=1, batches=2, true_batches=2),
}


def _run_config(preset: str):
  run = stress.stress_config(tiny=preset == "tiny")
  if preset == "tiny":  # groups of 4: a group of 2 often has equal rewards (zero advantage)
    run = dataclasses.replace(run, pipeline=dataclasses.replace(run.pipeline, group_size=4))
  return run


def main(argv):
  del argv
  over = {k: v for k, v in dict(
      lags=_LAGS.value and tuple(int(x) for x in _LAGS.value),
      mixed_lags=None if _MIXED.value is None else tuple(int(x) for x in _MIXED.value if x),
      batches=_BATCHES.value, true_batches=_TRUE.value, num_targets=_TARGETS.value,
      target_stride=_STRIDE.value, tokens_per_version=_TPV.value, bf16_case=_BF16.value
  ).items() if v is not None}
  cfg = dataclasses.replace(PRESETS[_PRESET.value], seed=_SEED.value, **over)
  out = pathlib.Path(_OUT.value)
  out.mkdir(parents=True, exist_ok=True)
  if _FROM.value:
    table = fidelity_report.merge([json.loads(pathlib.Path(p).read_text()) for p in _FROM.value])
  else:
    partial = lambda t: (out / "fidelity_partial.json").write_text(json.dumps(t, default=float))
    table = fidelity_run.run_instrument(_run_config(_PRESET.value), cfg, _CKPTS.value,
                                        _SAVE.value, partial=partial)
  verdicts = fidelity_report.claims(table)
  table["claims"] = verdicts
  (out / "fidelity.json").write_text(json.dumps(table, indent=1, default=float))
  (out / "fidelity.md").write_text(fidelity_report.markdown(table, verdicts))
  fidelity_report.plot(table, str(out / "fidelity.png"))
  if _PARETO.value:
    fidelity_pareto.write(table, _PARETO.value, str(out / "pareto"))
  if _PINNED.value:
    lags = sorted({r["lag"] for r in table["rows"] if r["case"] == "lag"})
    sweep = fidelity_pareto.sweep_from_pinned(_PINNED.value, lags, ("no_correction", "tis"))
    fidelity_pareto.write(table, _PINNED.value, str(out / "pareto_pinned"), sweep=sweep)
  print(json.dumps({v["claim"]: v["verdict"] for v in verdicts}))


if __name__ == "__main__":
  app.run(main)
