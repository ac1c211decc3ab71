"""Trains the shipped tokenizer on text of the built-in arithmetic task.

  PYTHONPATH=. python experiments/train_tokenizer.py --output_prefix=rlax_pipe/assets/tokenizer

The output is deterministic: rerunning it reproduces the shipped pieces and ids exactly.
"""

from absl import app
from absl import flags

from rlax_pipe import tasks
from rlax_pipe import tokenizer

_OUTPUT_PREFIX = flags.DEFINE_string("output_prefix", "rlax_pipe/assets/tokenizer",
                                     "Writes <prefix>.model and <prefix>.vocab.")
_NUM_PROBLEMS = flags.DEFINE_integer("num_problems", 2000, "Arithmetic problems in the corpus.")
_VOCAB_SIZE = flags.DEFINE_integer("vocab_size", 512, "Upper bound on the number of pieces.")


def main(argv):
  del argv
  # Both operators, so "-" gets a piece of its own even though the default task only adds.
  task = tasks.ArithmeticTask(tasks.ArithmeticConfig(operators="+-"))
  texts = [p.prompt + p.solution for p in tasks.take_problems(task, 0, _NUM_PROBLEMS.value)]
  tok = tokenizer.train_tokenizer(texts, _OUTPUT_PREFIX.value, vocab_size=_VOCAB_SIZE.value)
  print(f"Wrote {tok.path}: vocab_size={tok.vocab_size} pad={tok.pad_id} bos={tok.bos_id} "
        f"eos={tok.eos_id}")


if __name__ == "__main__":
  app.run(main)
