"""Problems held as in-memory records (read from users' files), split and shuffled per epoch.

Shared by `JsonlTask` and `DatasetFileTask`. Splits: with a separate eval file the main file is
"train"; otherwise records are partitioned by `base.split_of(prompt, eval_fraction)` (a stable
hash of the prompt text, so equal prompts share a split). Index i of a split addresses epoch
i // N, position i % N of a per-epoch permutation seeded by (seed, split, epoch), so a prompt
stream resumes from an integer counter alone.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rlax_pipe.tasks import base


@dataclasses.dataclass(frozen=True)
class Record:
  """One problem as read from a file.

  Attributes:
    prompt: prompt text (non-empty).
    answer: the reference answer, as written in the file.
    solution: a reference completion that earns reward 1.0 (for SFT warm starts).
    difficulty: user-given difficulty (0.0 when absent).
  """

  prompt: str
  answer: str
  solution: str
  difficulty: float = 0.0


def split_records(records: list[Record], eval_fraction: float) -> dict[str, list[Record]]:
  """{"train": [...], "eval": [...]} by prompt hash (`base.split_of`), file order kept."""
  return {s: [r for r in records if base.split_of(r.prompt, eval_fraction) == s]
          for s in base.SPLITS}


class RecordTask:
  """Addressable, per-epoch-shuffled problems over fixed record lists (see the module docstring).

  Subclasses implement `reward` and set `name`.
  """

  name = "records"

  def __init__(self, records: dict[str, list[Record]], *, seed: int, source: str,
               empty_hint: str):
    """Args:
      records: the records of each split ("train" and "eval").
      seed: seed of the per-epoch shuffles.
      source: the file(s) the records came from (for error messages).
      empty_hint: what to do when a split is empty (appended to the error message).
    """
    self._records = records
    self._seed = seed
    self._source = source
    self._empty_hint = empty_hint
    self._perm_cache: dict[tuple[str, int], np.ndarray] = {}

  def num_problems(self, split: str = "train") -> int:
    """Number of records in `split` (may be 0 for a small file and a small eval fraction)."""
    base.check_split(split)
    return len(self._records[split])

  def _permutation(self, split: str, epoch: int) -> np.ndarray:
    key = (split, epoch)
    perm = self._perm_cache.get(key)
    if perm is None:
      rng = np.random.default_rng([self._seed, base.SPLITS.index(split), epoch])
      perm = rng.permutation(len(self._records[split]))
      self._perm_cache = {key: perm}  # Keep one epoch: streams read epochs in order.
    return perm

  def _check_not_empty(self, split: str) -> int:
    size = len(self._records[split])
    if not size:
      raise ValueError(f"Split {split!r} of {self._source} is empty; {self._empty_hint}")
    return size

  def problem(self, index: int, split: str = "train") -> base.Problem:
    """The problem at stream position `index` of `split` (shuffled per epoch).

    Raises:
      ValueError: on a bad index or split, or when `split` holds no problem.
    """
    base.check_index(index)
    base.check_split(split)
    size = self._check_not_empty(split)
    epoch, pos = divmod(int(index), size)
    r = self._records[split][int(self._permutation(split, epoch)[pos])]
    return base.Problem(index=int(index), split=split, prompt=r.prompt, answer=r.answer,
                        solution=r.solution, difficulty=r.difficulty)

  def sample_prompts(self, rng: np.random.Generator, n: int,
                     split: str = "train") -> list[base.Problem]:
    """`n` problems drawn uniformly with replacement from `split` using `rng`."""
    if n < 0:
      raise ValueError(f"n={n} must be >= 0.")
    base.check_split(split)
    size = self._check_not_empty(split)
    return [self.problem(int(i), split) for i in rng.integers(0, size, size=n)]

  def __getstate__(self):
    state = dict(self.__dict__)
    state["_perm_cache"] = {}  # verifier processes get the records, not the cache
    return state
