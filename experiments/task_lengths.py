"""Prints reference-completion length statistics (tokens) of a task as one JSON line.

  PYTHONPATH=. python experiments/task_lengths.py --task=arithmetic --n=20000
  PYTHONPATH=. python experiments/task_lengths.py --task=jsonl --jsonl_path=my_problems.jsonl
"""

import dataclasses
import datetime
import json

from absl import app
from absl import flags
import numpy as np

from rlax_pipe import tasks
from rlax_pipe import tokenizer

_TASK = flags.DEFINE_enum("task", "arithmetic", sorted(tasks.TASKS), "Task to measure.")
_JSONL_PATH = flags.DEFINE_string("jsonl_path", None, "Problems file for --task=jsonl.")
_N = flags.DEFINE_integer("n", 20000, "Problems to sample.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the sampling generator.")
_SPLIT = flags.DEFINE_enum("split", "train", list(tasks.SPLITS), "Split to measure.")
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "tokenizer.model / tokenizer.json path or HF "
                                 "directory; default: shipped.")


def main(argv):
  del argv
  if _TASK.value == "jsonl" and not _JSONL_PATH.value:
    raise app.UsageError("--task=jsonl needs --jsonl_path.")
  config = tasks.JsonlConfig(path=_JSONL_PATH.value) if _TASK.value == "jsonl" else None
  task = tasks.make_task(_TASK.value, config)
  tok = tokenizer.load_tokenizer(_TOKENIZER.value)
  stats = tasks.length_stats(task, np.random.default_rng(_SEED.value), _N.value, tok, _SPLIT.value)
  print(json.dumps({"date": datetime.datetime.now().isoformat(timespec="seconds"),
                    "task": _TASK.value, "split": _SPLIT.value, "seed": _SEED.value,
                    "vocab_size": tok.vocab_size, **dataclasses.asdict(stats)}))


if __name__ == "__main__":
  app.run(main)
