"""Meshes chosen from the devices present (issue #17 item 8): the rule on device lists, the real
device counts 1, 2 and 8 in subprocesses (XLA_FLAGS), and errors that name the config fields."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import pytest

from rlax_pipe.config_dict import ConfigError
from rlax_pipe.pipeline import devices
from rlax_pipe.pipeline import job
from rlax_pipe.pipeline.config import RunConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class FakeDevice:
  id: int
  platform: str = "gpu"


def _devs(n):
  return [FakeDevice(i) for i in range(n)]


@pytest.mark.parametrize("n, sampler, learner", [
    (1, (("tp", 1),), (("fsdp", 1), ("tp", 1))),
    (2, (("tp", 1),), (("fsdp", 1), ("tp", 1))),
    (3, (("tp", 2),), (("fsdp", 1), ("tp", 1))),
    (4, (("tp", 2),), (("fsdp", 2), ("tp", 1))),
    (8, (("tp", 4),), (("fsdp", 2), ("tp", 2))),    # the default run's layout of before
    (16, (("tp", 8),), (("fsdp", 4), ("tp", 2))),
    (32, (("data", 2), ("tp", 8)), (("fsdp", 4), ("tp", 4))),
])
def test_auto_split(n, sampler, learner):
  plan = devices.plan_devices((), (), _devs(n))
  assert (plan.sampler_mesh_axes, plan.learner_mesh_axes) == (sampler, learner)
  assert plan.split.shared == (n == 1)
  assert plan.chosen == ("sampler", "learner")
  if n > 1:  # disjoint, learner first
    assert [d.id for d in plan.split.learner] == list(range(devices._size(learner)))
    assert not set(plan.split.learner) & set(plan.split.sampler)


def test_one_side_given_the_other_gets_the_rest():
  plan = devices.plan_devices((("tp", 2),), (), _devs(8))
  assert plan.learner_mesh_axes == (("fsdp", 3), ("tp", 2)) and plan.chosen == ("learner",)
  plan = devices.plan_devices((), (("fsdp", 1),), _devs(1))  # one device: shared
  assert plan.sampler_mesh_axes == (("tp", 1),) and plan.split.shared


def test_issue_input_default_4_plus_4_on_small_hosts_names_the_fields():
  """The old default (4 + 4) on a 1-GPU or 2-device host: the error names both fields, their
  command-line spelling and the automatic choice."""
  for n in (1, 2):
    with pytest.raises(ConfigError) as e:
      devices.plan_devices((("tp", 4),), (("fsdp", 2), ("tp", 2)), _devs(n))
    text = str(e.value)
    assert "RunConfig.learner.mesh_axes=(('fsdp', 2), ('tp', 2)) (4 devices)" in text
    assert "RunConfig.sampler_mesh_axes=(('tp', 4),) (4 devices) need 8 devices" in text
    assert f"{n} device(s) found ({n} gpu)" in text
    assert '--config.learner.mesh_axes="()" --config.sampler_mesh_axes="()"' in text
    assert "XLA_FLAGS" not in text  # only suggested on CPU-only machines
  with pytest.raises(ConfigError, match=r"takes 2 devices and leaves none for "
                     r"RunConfig.sampler_mesh_axes"):
    devices.plan_devices((), (("fsdp", 2),), _devs(2))
  with pytest.raises(ConfigError, match="xla_force_host_platform_device_count=8"):
    devices.plan_devices((("tp", 4),), (("fsdp", 4),), [FakeDevice(i, "cpu") for i in range(2)])


_SCRIPT = """
import json, jax
from rlax_pipe.pipeline import devices
from rlax_pipe.pipeline import job
from rlax_pipe.pipeline.config import RunConfig
plan = devices.plan_devices((), (), jax.devices())
learner_mesh, sampler_mesh = devices.make_meshes(plan)
print(json.dumps({"n": len(jax.devices()), "sampler": plan.sampler_mesh_axes,
                  "learner": plan.learner_mesh_axes, "shared": plan.split.shared,
                  "learner_mesh": dict(learner_mesh.shape),
                  "sampler_mesh": dict(sampler_mesh.shape)}))
"""


@pytest.mark.parametrize("n, sampler, learner", [
    (1, [["tp", 1]], [["fsdp", 1], ["tp", 1]]),
    (2, [["tp", 1]], [["fsdp", 1], ["tp", 1]]),
    (8, [["tp", 4]], [["fsdp", 2], ["tp", 2]]),
])
def test_real_device_counts_in_subprocesses(n, sampler, learner):
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={n}")
  out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True,
                       timeout=300, check=True)
  got = json.loads(out.stdout.strip().splitlines()[-1])
  assert got["n"] == n and got["sampler"] == sampler and got["learner"] == learner
  assert got["shared"] == (n == 1)
  assert got["learner_mesh"] == dict(learner) and got["sampler_mesh"] == dict(sampler)


def test_rules_against_the_chosen_mesh_name_the_fields():
  """micro_batch_rows must split over the chosen learner mesh's data x fsdp: with () meshes this
  is only known once the devices are, and the error says so and names the fields."""
  cfg = RunConfig()
  cfg = dataclasses.replace(cfg, learner=dataclasses.replace(cfg.learner, micro_batch_rows=3))
  plan = devices.plan_devices((), (), _devs(8))  # learner fsdp 2 x tp 2
  with pytest.raises(ConfigError, match=r"RunConfig.learner.micro_batch_rows=3 must be a "
                     r"multiple .*chosen for the devices present.*RunConfig.learner.mesh_axes"):
    job._resolve(cfg, plan, 3)
  assert job._resolve(RunConfig(), plan, 3).learner.mesh_axes == (("fsdp", 2), ("tp", 2))
