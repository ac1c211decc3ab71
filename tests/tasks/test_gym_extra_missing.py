"""Without the gym extra, the reasoning-gym task says how to install it (runs either way)."""

import sys

import pytest

from rlax_pipe import tasks


def test_missing_extra_names_the_install_command(monkeypatch):
  monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import fails as if not installed
  with pytest.raises(ImportError, match=r'pip install -e "\.\[gym\]"'):
    tasks.make_task("reasoning_gym")
