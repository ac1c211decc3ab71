"""The two interfaces of the pipeline floor (`rlax_pipe.types.Sampler`, `WeightSink`): every
implementation has each protocol method with the protocol's parameters (names, kinds, and the
`WeightUpdate` annotation of the hand-over), not only a member of that name."""

import inspect

import pytest

from rlax_pipe import types
from rlax_pipe.envs.runner import EpisodeEngine
from rlax_pipe.pipeline.lora_channel import LoraWeightChannel
from rlax_pipe.pipeline.multihost.remote import RemoteEngines
from rlax_pipe.pipeline.multihost.weights import LearnerSender
from rlax_pipe.pipeline.weight_channel import WeightChannel
from rlax_pipe.sampler import SamplerEngine


def _members(protocol):
  return sorted(n for n, v in vars(protocol).items()
                if inspect.isfunction(v) and not n.startswith("_"))


def _params(fn):
  return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


def _mismatches(cls, protocol) -> list[str]:
  out = []
  for name in _members(protocol):
    impl = getattr(cls, name, None)
    if not callable(impl) or not inspect.isfunction(inspect.unwrap(impl)):
      out.append(f"{cls.__name__}.{name} missing")
      continue
    want, got = _params(getattr(protocol, name)), _params(impl)
    if want != got:
      out.append(f"{cls.__name__}.{name}{got} != {protocol.__name__}.{name}{want}")
      continue
    for p in inspect.signature(getattr(protocol, name)).parameters.values():
      if p.annotation == "WeightUpdate":
        ann = inspect.signature(impl).parameters[p.name].annotation
        if ann != "WeightUpdate":
          out.append(f"{cls.__name__}.{name}({p.name}: {ann}) is not a WeightUpdate")
  return out


@pytest.mark.parametrize("cls", [SamplerEngine, EpisodeEngine, RemoteEngines])
def test_sampler_implementations_match_the_protocol(cls):
  assert _members(types.Sampler) == ["abort", "step", "submit", "unfinished", "update_weights"]
  assert _mismatches(cls, types.Sampler) == []
  assert issubclass(cls, types.Sampler)


@pytest.mark.parametrize("cls", [WeightChannel, LoraWeightChannel, LearnerSender])
def test_weight_sinks_match_the_protocol(cls):
  assert _members(types.WeightSink) == ["push"]
  assert _mismatches(cls, types.WeightSink) == []
  assert issubclass(cls, types.WeightSink)


def test_the_check_sees_a_wrong_signature():
  """The check is not vacuous: the pre-issue-25 `push(params, version)` fails it."""

  class OldChannel:
    def push(self, params, version):
      del params, version

  class Engine:
    def submit(self, request):
      del request

  (problem,) = _mismatches(OldChannel, types.WeightSink)
  assert problem.startswith("OldChannel.push") and "'version'" in problem
  assert "Engine.step missing" in _mismatches(Engine, types.Sampler)
