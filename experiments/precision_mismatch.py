r"""Claim (c) on a large vocabulary: bf16-sampler vs fp32-learner log-prob mismatch per token.

  python3 experiments/precision_mismatch.py                       # reduced-depth Qwen3 shape
  python3 experiments/precision_mismatch.py --n_layers=2 --positions=64 --target_entropy=1.0

Random-initialised Qwen3-0.6B shape (vocab 151,936) with `--n_layers` layers, logit scale set for
a trained-like fp32 entropy; see experiments/lib/precision_mismatch.py. Prints one JSON object.
"""

import json

from absl import app
from absl import flags

from lib import precision_mismatch

_LAYERS = flags.DEFINE_integer("n_layers", 1, "Transformer layers of the Qwen3 shape.")
_ROWS = flags.DEFINE_integer("rows", 2, "Context rows.")
_POS = flags.DEFINE_integer("positions", 32, "Positions (tokens) per row.")
_ENT = flags.DEFINE_float("target_entropy", 2.0, "fp32 next-token entropy to calibrate (nats).")
_TEMP = flags.DEFINE_float("temperature", 1.0, "Sampling temperature.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed.")


def main(argv):
  del argv
  cfg = precision_mismatch.qwen3_reduced(_LAYERS.value, max_seq_len=max(_POS.value, 16))
  print(json.dumps(precision_mismatch.measure(cfg, _ROWS.value, _POS.value, _TEMP.value,
                                              _ENT.value, _SEED.value)))


if __name__ == "__main__":
  app.run(main)
