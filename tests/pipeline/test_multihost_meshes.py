"""Mesh shapes of a multi-process job are chosen or checked against the topology before any
process waits on another (`with_meshes`)."""

import dataclasses

import pytest

from rlax_pipe.cluster import Topology
from rlax_pipe.config_dict import ConfigError
from rlax_pipe.pipeline.config import RunConfig
from rlax_pipe.pipeline.multihost import job as mp_job

TOPO = Topology(process_id=0, num_processes=3, num_learner_processes=1, devices_per_process=2)


def test_meshes_that_do_not_fit_the_processes_are_named_before_the_job_starts():
  cfg = RunConfig(sampler_mesh_axes=(("tp", 1),))
  cfg = dataclasses.replace(cfg, learner=dataclasses.replace(
      cfg.learner, mesh_axes=(("fsdp", 2), ("tp", 1))))
  with pytest.raises(ConfigError, match=r"--config.sampler_mesh_axes=.* 1 devices.* with 2"):
    mp_job.with_meshes(cfg, TOPO)
  cfg = dataclasses.replace(cfg, sampler_mesh_axes=(("tp", 2),), learner=dataclasses.replace(
      cfg.learner, mesh_axes=(("fsdp", 4), ("tp", 1))))
  with pytest.raises(ConfigError, match=r"--config.learner.mesh_axes=.* 4 devices.* hold 2"):
    mp_job.with_meshes(cfg, TOPO)


def test_empty_meshes_are_chosen_for_the_topology_and_fit():
  cfg = mp_job.with_meshes(RunConfig(), TOPO)  # chosen, then checked (no ConfigError)
  assert cfg.num_sampler_devices == 2 and cfg.num_learner_devices == 2
