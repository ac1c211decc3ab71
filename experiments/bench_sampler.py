"""Benchmark: paged continuous-batching sampler vs static dense-KV batches, long-tailed lengths.

Prints one JSON object (the metrics of `rlax_pipe.sampler.benchmark.run`) as its last line.

  python3 experiments/bench_sampler.py --num_requests=512 --num_slots=32
"""

import json

from absl import app
from absl import flags

from rlax_pipe.config import ModelConfig
from rlax_pipe.sampler import SamplerConfig, benchmark

_N = flags.DEFINE_integer("num_requests", 512, "Requests in the workload.")
_SLOTS = flags.DEFINE_integer("num_slots", 32, "Decode slots (= static batch size).")
_PAGES = flags.DEFINE_integer("num_pages", 192, "KV pages in the paged pool.")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Tokens per page.")
_MAX_LEN = flags.DEFINE_integer("max_seq_len", 352, "Prompt + completion tokens, at most.")
_LONG_FRAC = flags.DEFINE_float("long_frac", 0.02, "Fraction of long requests.")
_LONG = flags.DEFINE_list("long_range", ["256", "320"], "Budget range of long requests.")
_SHORT = flags.DEFINE_list("short_range", ["8", "32"], "Budget range of other requests.")
_SEED = flags.DEFINE_integer("seed", 0, "Workload seed.")
_D_MODEL = flags.DEFINE_integer("d_model", 64, "Model width.")
_LAYERS = flags.DEFINE_integer("n_layers", 2, "Transformer blocks.")
_HEADS = flags.DEFINE_list("heads", ["4", "1", "16"], "Query heads, kv heads, head dim.")


def main(argv):
  del argv
  n_heads, n_kv_heads, head_dim = map(int, _HEADS.value)
  model_cfg = ModelConfig(vocab_size=256, d_model=_D_MODEL.value, n_layers=_LAYERS.value,
                          n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                          d_ff=3 * _D_MODEL.value, max_seq_len=_MAX_LEN.value)
  sampler_cfg = SamplerConfig(num_slots=_SLOTS.value, page_size=_PAGE_SIZE.value,
                              num_pages=_PAGES.value, max_seq_len=_MAX_LEN.value,
                              min_prefill_bucket=32, prefill_rows=4)
  workload = benchmark.WorkloadConfig(
      num_requests=_N.value, long_frac=_LONG_FRAC.value, long_min=int(_LONG.value[0]),
      long_max=int(_LONG.value[1]), short_min=int(_SHORT.value[0]),
      short_max=int(_SHORT.value[1]), seed=_SEED.value)
  print(json.dumps(benchmark.run(model_cfg, sampler_cfg, workload)))


if __name__ == "__main__":
  app.run(main)
