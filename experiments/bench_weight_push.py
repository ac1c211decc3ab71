r"""Weight push in seconds per GB (issue #28 item 6): one JSON line per (mode, model).

Random bf16 weights at a preset's full shape (Qwen3-0.6B, Llama-3.2-1B) are pushed from the
learner mesh to the sampler mesh and timed until the sampler holds the complete version:

- mode "single": the single-process `WeightChannel` (push + take, arrays ready; the push also
  starts the learner-side checksums, as in a run) from an fsdp mesh on the first half of the
  virtual CPU devices to a tp mesh on the other half;
- mode "multi": two processes of a `jax.distributed` job on this machine (learner process 0,
  sampler replica process 1, `--devices_per_process` CPU devices each), the multi-process
  sender's path: the learner's re-layout into the staging layout
  (`TransferLayout.staging_sharding`), then the cross-process `jax.device_put`
  (`multihost.weights.transfer`), timed on the receiver from a coordination barrier to its
  arrays being ready.

Warm: --warmup untimed pushes (compiles), then the median of --repeats timed ones; the machine's
load average is printed with each line. On CPU this is host memory bandwidth and (multi) a
local socket, NOT the accelerator goal (<= 0.12 s/GB on GPU/TPU interconnect); the 8B figure
is a prediction from the measured rate (labelled "predicted").

  python3 experiments/bench_weight_push.py --mode=single --models=qwen3-0.6b,llama-3.2-1b
  python3 experiments/bench_weight_push.py --mode=multi --models=qwen3-0.6b
  python3 experiments/bench_weight_push.py --accelerator   # on a GPU/TPU host's own devices
"""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

from absl import app, flags

_MODE = flags.DEFINE_enum("mode", "single", ["single", "multi"], "Channel to time.")
_MODELS = flags.DEFINE_list("models", ["qwen3-0.6b", "llama-3.2-1b"], "Presets (full shapes).")
_DEVICES = flags.DEFINE_integer("devices_per_side", 4,
                                "single: learner and sampler devices (each; 2x virtual CPUs).")
_ACCEL = flags.DEFINE_bool("accelerator", False,
                            "single: push on the machine's own devices (GPU/TPU) instead of "
                            "virtual CPU devices; with one device, learner and sampler share it.")
_PER_PROC = flags.DEFINE_integer("devices_per_process", 2, "multi: CPU devices per process.")
_WARMUP = flags.DEFINE_integer("warmup", 1, "Untimed pushes first.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed pushes (median reported).")
_PROCESS = flags.DEFINE_integer("process_id", -1, "Internal: the multi mode's child process.")
_COORD = flags.DEFINE_string("coordinator", "", "Internal: coordinator host:port (multi).")

GB = 1e9


def _model_cfg(name):
  import dataclasses  # pylint: disable=import-outside-toplevel
  from lib import aot_runs  # pylint: disable=import-outside-toplevel
  cfg = aot_runs.MODELS[name]  # "tiny" (a smoke test), the presets, "llama-3.1-8b"
  return dataclasses.replace(cfg, param_dtype="bfloat16", compute_dtype="bfloat16")


def _random_params(model, shardings):
  """Random bf16 params made directly in `shardings` (no host copy)."""
  import jax  # pylint: disable=import-outside-toplevel
  abstract = model.abstract_params()
  leaves, treedef = jax.tree_util.tree_flatten(abstract)
  sh = treedef.flatten_up_to(shardings)

  def make(key):
    keys = jax.random.split(key, len(leaves))
    return [jax.random.normal(k, a.shape, a.dtype) for k, a in zip(keys, leaves)]
  out = jax.jit(make, out_shardings=sh)(jax.random.PRNGKey(0))
  return jax.tree_util.tree_unflatten(treedef, out)


def _nbytes(tree):
  import jax  # pylint: disable=import-outside-toplevel
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def _record(mode, name, nbytes, times, extra):
  times = sorted(times)
  median = times[len(times) // 2]
  return dict(mode=mode, model=name, dtype="bfloat16", gb=nbytes / GB, push_s=times,
              median_s=median, s_per_gb=median / (nbytes / GB),
              predicted_llama_3_1_8b_s=round(median / (nbytes / GB) * 16.06, 2),
              load_avg=os.getloadavg(), **{"machine": _machine(), **extra})


def _machine():
  import jax  # pylint: disable=import-outside-toplevel
  dev = jax.devices()[0]
  if dev.platform == "cpu":
    return "CPU (virtual devices), not an accelerator"
  return f"{len(jax.devices())} x {dev.device_kind}"


def _single(name):
  import jax  # pylint: disable=import-outside-toplevel
  from rlax_pipe import param_checksum  # pylint: disable=import-outside-toplevel
  from rlax_pipe import sharding  # pylint: disable=import-outside-toplevel
  from rlax_pipe.learner import sharding as lsh  # pylint: disable=import-outside-toplevel
  from rlax_pipe.model import as_model  # pylint: disable=import-outside-toplevel
  from rlax_pipe.pipeline.lora_channel import sampler_target  # pylint: disable=import-outside-toplevel
  from rlax_pipe.pipeline.weight_channel import WeightChannel  # pylint: disable=import-outside-toplevel
  from rlax_pipe.types import WeightUpdate  # pylint: disable=import-outside-toplevel
  devs = jax.devices()
  n = max(1, min(_DEVICES.value, len(devs) // 2))
  # One device (a single GPU): both meshes on it, as a run on one device does.
  s_devs = devs[n:2 * n] if len(devs) >= 2 else devs[:1]
  lmesh = sharding.make_mesh(devs[:n], {"fsdp": n}, sharding.LEARNER_RULES)
  smesh = sharding.make_mesh(s_devs, {"tp": n}, sharding.SAMPLER_RULES)
  model = as_model(_model_cfg(name))
  params = _random_params(model, lsh.param_shardings(model, lmesh))
  channel = WeightChannel(sampler_target(model.param_axes(), model.abstract_params(), smesh))
  times = []
  for v in range(_WARMUP.value + _REPEATS.value):
    t0 = time.perf_counter()
    channel.push(WeightUpdate(v, params))
    update = channel.take(timeout=600)
    jax.block_until_ready(update.params)
    dt = time.perf_counter() - t0
    if v >= _WARMUP.value:
      times.append(dt)
    jax.tree.map(lambda x: x.delete(), update.params)
  # Where the time goes, each part alone (warm, median of --repeats): the learner-side
  # checksums the push starts, and the copy itself (hop 1 reshard + device_put [+ hop 3]).
  leaves = jax.tree.leaves(params)
  plans, idx1, hop1, _, _ = channel._plan(leaves)  # pylint: disable=protected-access
  staged = list(leaves)
  if hop1:
    for i, y in zip(idx1, hop1([leaves[i] for i in idx1])):
      staged[i] = y
  parts = {"checksum_s": lambda: param_checksum.checksum(leaves),
           "transfer_s": lambda: channel._transfer(leaves),  # pylint: disable=protected-access
           "learner_reshard_s": lambda: hop1([leaves[i] for i in idx1]) if hop1 else [],
           "device_put_s": lambda: jax.device_put(staged, [p.landing for p in plans],
                                                  may_alias=False)}
  split = {}
  for key, fn in parts.items():
    ts = []
    for _ in range(_REPEATS.value):
      t0 = time.perf_counter()
      out = fn()
      jax.block_until_ready(out)
      ts.append(time.perf_counter() - t0)
      jax.tree.map(lambda x: x.delete() if isinstance(x, jax.Array) else None, out)
    split[key] = sorted(ts)[len(ts) // 2]
  return _record("single", name, _nbytes(params), times,
                 dict(learner_mesh={"fsdp": n}, sampler_mesh={"tp": n},
                      shared_device=len(devs) < 2, **split))


def _child(name):
  """One process of the multi mode (0: learner, 1: sampler replica)."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from rlax_pipe import sharding  # pylint: disable=import-outside-toplevel
  from rlax_pipe.cluster import kv  # pylint: disable=import-outside-toplevel
  from rlax_pipe.cluster import topology as topo_lib  # pylint: disable=import-outside-toplevel
  from rlax_pipe.learner import sharding as lsh  # pylint: disable=import-outside-toplevel
  from rlax_pipe.model import as_model  # pylint: disable=import-outside-toplevel
  from rlax_pipe.pipeline.multihost import weights  # pylint: disable=import-outside-toplevel
  from rlax_pipe.pipeline.multihost.layout import TransferLayout  # pylint: disable=import-outside-toplevel
  topo = topo_lib.initialize(1, coordinator_address=_COORD.value, num_processes=2,
                             process_id=_PROCESS.value)
  d = _PER_PROC.value
  model = as_model(_model_cfg(name))
  layout = TransferLayout(topo, model, {"tp": d})
  entry = {"sender": 0, "replica": 0}
  relayout = None
  if topo.process_id == 0:
    lmesh = sharding.make_mesh(topo.process_devices(0), {"fsdp": d}, sharding.LEARNER_RULES,
                               keep_device_order=True)
    params = jax.tree.leaves(_random_params(model, lsh.param_shardings(model, lmesh)))
    relayout = jax.jit(lambda xs: [jax.numpy.copy(x) for x in xs],
                       out_shardings=layout.staging_sharding())
  times = []
  for i in range(_WARMUP.value + _REPEATS.value):
    kv.barrier(f"push_start_{i}", 600)
    t0 = time.perf_counter()
    if topo.process_id == 0:
      staged = relayout(params)
      out = weights.transfer(layout, entry, layout.local_view(staged, 0))
      jax.block_until_ready(staged)
    else:
      out = weights.transfer(layout, entry, None)
      jax.block_until_ready(out)
    dt = time.perf_counter() - t0
    kv.barrier(f"push_end_{i}", 600)
    if i >= _WARMUP.value:
      times.append(dt)
    if topo.process_id == 0:
      for x in staged:
        x.delete()
    else:
      for x in out:
        x.delete()
  if topo.process_id == 1:
    nbytes = int(sum(int(np.prod(shape)) * dtype.itemsize
                     for shape, dtype in zip(layout.shapes, layout.dtypes)))
    print(json.dumps(_record("multi", name, nbytes, times, dict(
        processes=2, devices_per_process=d, learner_mesh={"fsdp": d},
        sampler_mesh={"tp": d}, timed_on="receiver"))), flush=True)
  kv.barrier("bench_done", 600)


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _multi(name):
  coord = f"127.0.0.1:{_free_port()}"
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={_PER_PROC.value}")
  args = [sys.executable, __file__, "--mode=multi", f"--models={name}",
          f"--devices_per_process={_PER_PROC.value}", f"--warmup={_WARMUP.value}",
          f"--repeats={_REPEATS.value}", f"--coordinator={coord}"]
  logs = [tempfile.NamedTemporaryFile("w+", prefix=f"push_p{p}_", suffix=".log", delete=False)
          for p in range(2)]
  procs = [subprocess.Popen(args + [f"--process_id={p}"], env=env, stdout=subprocess.PIPE,
                            stderr=log, text=True) for p, log in enumerate(logs)]
  outs = [p.communicate(timeout=1800)[0] for p in procs]
  for i, p in enumerate(procs):
    if p.returncode:
      raise RuntimeError(f"multi-process push bench: process {i} failed (rc {p.returncode}); "
                         f"its log: {logs[i].name}")
  lines = [ln for out in outs for ln in out.splitlines() if ln.startswith("{")]
  return json.loads(lines[-1])


def main(argv):
  del argv
  if _PROCESS.value >= 0:
    _child(_MODELS.value[0])
    return
  if _MODE.value == "single" and not _ACCEL.value:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                               f"device_count={2 * _DEVICES.value}").strip()
  for name in _MODELS.value:
    rec = _single(name) if _MODE.value == "single" else _multi(name)
    print(json.dumps(rec), flush=True)


if __name__ == "__main__":
  app.run(main)
