"""A run directory is a record (issue #14 item 15): resume restores the saved configuration, a
changed setting is refused unless named (then recorded with its step), a resume without a
checkpoint is an error, and no record mixes two attempts (metrics.jsonl, TensorBoard)."""

import dataclasses
import json
import pathlib
import struct
import types

import pytest
from tensorboardX import event_file_writer
from tensorboardX.proto import event_pb2

from rlax_pipe.config_dict import ConfigError
from rlax_pipe.learner import OptimizerConfig
from rlax_pipe.pipeline import run as run_lib
from rlax_pipe.run_dir import RunDir


def tb_steps(run_dir, tag="train/reward_mean"):
  """Steps of every `tag` scalar in run_dir/tb (TFRecord framing read by hand)."""
  steps = []
  for path in sorted(pathlib.Path(run_dir, "tb").glob("events.*")):
    data = path.read_bytes()
    pos = 0
    while pos < len(data):
      (length,) = struct.unpack("<Q", data[pos:pos + 8])
      event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
      pos += 12 + length + 4
      steps += [event.step for v in event.summary.value if v.tag == tag]
  return sorted(steps)


def _lr(cfg, lr):
  return dataclasses.replace(cfg, learner=dataclasses.replace(
      cfg.learner, optimizer=OptimizerConfig(learning_rate=lr, warmup_steps=0)))


def test_resume_without_checkpoint_is_an_error(tmp_path, tiny_init, tiny_config):
  cfg = tiny_config(tmp_path, tiny_init, resume=True, run_name="typo")
  with pytest.raises(ConfigError, match=r"RunConfig.run_dir=.*typo' holds no checkpoint.*"
                                        r"mistyped --config.run_dir"):
    run_lib.run(cfg)


def test_run_dir_that_cannot_be_created_is_named(tmp_path, tiny_init, tiny_config):
  (tmp_path / "a_file").write_text("")
  cfg = dataclasses.replace(tiny_config(tmp_path, tiny_init),
                            run_dir=str(tmp_path / "a_file" / "run"))
  with pytest.raises(ConfigError, match=r"RunConfig.run_dir=.*a_file/run' cannot be created "
                                        r"\(Not a directory\); choose a writable directory"):
    run_lib.run(cfg)


def test_changes_on_resume_refused_unless_named_then_recorded(tmp_path, tiny_init, tiny_config,
                                                            train_rows):
  cfg = tiny_config(tmp_path, tiny_init, steps=2)
  run_lib.run(cfg)
  more = dataclasses.replace(cfg, resume=True,
                             pipeline=dataclasses.replace(cfg.pipeline, num_steps=3))
  # The input: a resume with another learning rate (and more steps), not named.
  with pytest.raises(ConfigError) as e:
    run_lib.run(_lr(more, 5e-4))
  text = str(e.value)
  assert "RunConfig.learner.optimizer.learning_rate: saved 0.001, now 0.0005" in text
  assert "RunConfig.pipeline.num_steps: saved 2, now 3" in text
  assert ("--config.change_on_resume=learner.optimizer.learning_rate,pipeline.num_steps"
          in text)
  assert [r["step"] for r in train_rows(cfg.run_dir)] == [1, 2]  # nothing was touched
  named = dataclasses.replace(_lr(more, 5e-4), change_on_resume=(
      "pipeline.num_steps", "learner.optimizer"))  # a parent path names its fields
  run_lib.run(named)
  changes = RunDir(cfg.run_dir).read_changes()
  assert changes == [
      {"step": 2, "field": "learner.optimizer.learning_rate", "before": 0.001, "after": 0.0005},
      {"step": 2, "field": "pipeline.num_steps", "before": 2, "after": 3}]
  rows = train_rows(cfg.run_dir)
  assert [r["step"] for r in rows] == [1, 2, 3]
  assert rows[0]["learning_rate"] == pytest.approx(1e-3)
  assert rows[-1]["learning_rate"] == pytest.approx(5e-4)
  saved = json.loads((pathlib.Path(cfg.run_dir) / "config.json").read_text())
  assert saved["learner"]["optimizer"]["learning_rate"] == 5e-4  # the config in effect now


def test_no_record_holds_two_attempts(tmp_path, tiny_init, tiny_config, train_rows):
  """A resume from step 2 after an attempt that logged steps 3-4 without checkpointing them
  keeps steps 1-2 of it once; a fresh start where nothing was checkpointed replaces all."""
  cfg = tiny_config(tmp_path, tiny_init, steps=2)
  run_lib.run(cfg)
  rd = RunDir(cfg.run_dir)
  for step in (3, 4):  # what a run killed before its step-3 checkpoint leaves behind
    rd.log({"kind": "train", "step": step, "reward_mean": 9.0}, step)
  rd.close()
  assert tb_steps(cfg.run_dir) == [1, 2, 3, 4]
  run_lib.run(dataclasses.replace(
      cfg, resume=True, pipeline=dataclasses.replace(cfg.pipeline, num_steps=3),
      change_on_resume=("pipeline.num_steps",)))
  rows = train_rows(cfg.run_dir)
  assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["reward_mean"] != 9.0
  assert tb_steps(cfg.run_dir) == [1, 2, 3]
  # A run killed before its first checkpoint, started again: its records are replaced.
  other = tiny_config(tmp_path, tiny_init, steps=1, run_name="fresh")
  rd = RunDir(other.run_dir)
  for step in (1, 2, 3):
    rd.log({"kind": "train", "step": step, "reward_mean": 9.0}, step)
  rd.close()
  run_lib.run(other)
  assert [r["step"] for r in train_rows(other.run_dir)] == [1]
  assert tb_steps(other.run_dir) == [1]


@pytest.mark.parametrize("same_second", [True, False])
def test_writers_opened_in_the_same_second_keep_their_own_events(tmp_path, monkeypatch,
                                                                same_second):
  """Issue #27 item 7: tensorboardX names event files by the second they were opened; two
  writers on one run directory in the same second (a resume, a rebuild, a test) shared a file
  and the second truncated the first's events. Every writer now has a file of its own."""
  if same_second:  # pin tensorboardX's clock: both files get the same timestamp
    monkeypatch.setattr(event_file_writer, "time", types.SimpleNamespace(time=lambda: 1.7e9))
  first, second = RunDir(tmp_path), RunDir(tmp_path)
  for step in (1, 2):
    first.log({"kind": "train", "step": step, "reward_mean": 0.5}, step)
  second.log({"kind": "train", "step": 3, "reward_mean": 0.5}, 3)  # while the first is open
  first.close()
  second.close()
  third = RunDir(tmp_path)  # and one more after both closed
  third.log({"kind": "train", "step": 4, "reward_mean": 0.5}, 4)
  third.close()
  assert tb_steps(tmp_path) == [1, 2, 3, 4]
  assert len(list((tmp_path / "tb").glob("events.*"))) == 3
