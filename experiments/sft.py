"""SFT warm start on the built-in arithmetic task (or a JSONL task).

  python experiments/sft.py                       # default: writes runs/sft_warm_start/
  python experiments/sft.py --steps=200 --out_dir=/tmp/sft

Prints one JSON object (the summary, incl. greedy and T=1 held-out accuracy) as its last line.
"""

import json

from rlax_pipe import platform_setup

platform_setup.request_cpu_devices(8)

# pylint: disable=wrong-import-position
from absl import app
from absl import flags

from rlax_pipe import sft
from rlax_pipe import tasks
from rlax_pipe import tokenizer

_OUT = flags.DEFINE_string("out_dir", "runs/sft_warm_start", "Checkpoint directory (created).")
_TASK = flags.DEFINE_enum("task", "arithmetic", sorted(tasks.TASKS), "Task to imitate.")
_JSONL = flags.DEFINE_string("jsonl_path", None, "Problems file for --task=jsonl.")
_STEPS = flags.DEFINE_integer("steps", sft.SFTConfig.steps, "Optimizer steps.")
_ROWS = flags.DEFINE_integer("rows", sft.SFTConfig.rows, "Packed rows per step.")
_SEQ = flags.DEFINE_integer("seq_len", sft.SFTConfig.seq_len, "Tokens per packed row.")
_LR = flags.DEFINE_float("learning_rate", sft.SFTConfig.learning_rate, "Peak AdamW rate.")
_WARMUP = flags.DEFINE_integer("warmup_steps", sft.SFTConfig.warmup_steps,
                               "Linear warmup (optimizer steps; capped at steps - 1).")
_EVAL = flags.DEFINE_integer("eval_problems", sft.SFTConfig.eval_problems, "Held-out problems.")
_SEED = flags.DEFINE_integer("seed", sft.SFTConfig.seed, "Init and sampling seed.")
_DIRECT = flags.DEFINE_float(
    "direct_answer_fraction", sft.SFTConfig.direct_answer_fraction,
    "Share of training problems demonstrated by the bare answer ('A: 17') instead of the worked "
    "trace: a mixture of two demonstrators that RL can choose between (see sft.SFTConfig).")


def main(argv):
  del argv
  task = tasks.make_task(_TASK.value,
                         tasks.JsonlConfig(path=_JSONL.value) if _TASK.value == "jsonl" else None)
  cfg = sft.SFTConfig(steps=_STEPS.value, rows=_ROWS.value, seq_len=_SEQ.value,
                      learning_rate=_LR.value, warmup_steps=_WARMUP.value,
                      eval_problems=_EVAL.value, seed=_SEED.value,
                      direct_answer_fraction=_DIRECT.value)
  summary = sft.run_sft(task, tokenizer.default_tokenizer(), cfg, _OUT.value)
  print(json.dumps(summary))


if __name__ == "__main__":
  app.run(main)
