r"""Held-out accuracy of model directories with and without the calculator tool, per number of
terms, with Wilson 95% intervals (issue #23; `experiments/lib/tool_eval.py`).

  PYTHONPATH=. python experiments/eval_tools.py --models=runs/a/hf,runs/b/hf --tool=both \
      --problems=256

Prints one JSON line per (model, tool) evaluation, then a markdown table.
"""

from rlax_pipe import platform_setup

platform_setup.request_cpu_devices(1)

# pylint: disable=wrong-import-position
from absl import app
from absl import flags

from lib import tool_eval

_MODELS = flags.DEFINE_list("models", None, "HF model directories to evaluate.", required=True)
_TOOL = flags.DEFINE_enum("tool", "both", ["yes", "no", "both"],
                          "Evaluate with the calculator (episodes), without, or both.")
_PROBLEMS = flags.DEFINE_integer("problems", 256, "Held-out problems (first n of 'eval').")


def main(argv):
  del argv
  modes = {"yes": [True], "no": [False], "both": [True, False]}[_TOOL.value]
  rows = [tool_eval.evaluate_dir(m, _PROBLEMS.value, t) for m in _MODELS.value for t in modes]
  print(tool_eval.dumps(rows))
  print(tool_eval.markdown(rows))


if __name__ == "__main__":
  app.run(main)
