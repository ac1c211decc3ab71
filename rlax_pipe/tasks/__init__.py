"""Tasks: prompts and verifiers (pure Python, no JAX).

`Task` is the protocol; `ArithmeticTask` is the built-in task with long-tailed trace lengths,
`JsonlTask` reads users' problems. `safe_reward` guards any verifier against errors and hangs.
"""

from rlax_pipe.tasks.arithmetic import ArithmeticConfig
from rlax_pipe.tasks.arithmetic import ArithmeticTask
from rlax_pipe.tasks.arithmetic import draw_num_terms
from rlax_pipe.tasks.arithmetic import render
from rlax_pipe.tasks.base import ANSWER_MARKER
from rlax_pipe.tasks.base import extract_marked_answer
from rlax_pipe.tasks.base import Problem
from rlax_pipe.tasks.base import split_of
from rlax_pipe.tasks.base import SPLITS
from rlax_pipe.tasks.base import take_problems
from rlax_pipe.tasks.base import Task
from rlax_pipe.tasks.jsonl import extract_answer
from rlax_pipe.tasks.jsonl import JsonlConfig
from rlax_pipe.tasks.jsonl import JsonlFormatError
from rlax_pipe.tasks.jsonl import JsonlTask
from rlax_pipe.tasks.jsonl import normalize_answer
from rlax_pipe.tasks.jsonl import read_jsonl_problems
from rlax_pipe.tasks.lengths import length_stats
from rlax_pipe.tasks.lengths import LengthStats
from rlax_pipe.tasks.registry import make_task
from rlax_pipe.tasks.registry import TASKS
from rlax_pipe.tasks.safe_reward import RewardCounts
from rlax_pipe.tasks.safe_reward import RewardStats
from rlax_pipe.tasks.safe_reward import safe_reward

__all__ = [
    "ANSWER_MARKER", "ArithmeticConfig", "ArithmeticTask", "JsonlConfig", "JsonlFormatError",
    "JsonlTask", "LengthStats", "Problem", "RewardCounts", "RewardStats", "SPLITS", "TASKS", "Task",
    "draw_num_terms", "extract_answer", "extract_marked_answer", "length_stats", "make_task",
    "normalize_answer", "read_jsonl_problems", "render", "safe_reward", "split_of",
    "take_problems",
]
