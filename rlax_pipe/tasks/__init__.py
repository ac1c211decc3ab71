"""Tasks: prompts and verifiers (pure Python, no JAX).

`Task` is the protocol. Built in: `ArithmeticTask` (long-tailed trace lengths); users' data:
`JsonlTask` and `DatasetFileTask` (JSONL / JSON / Parquet / CSV); procedural reasoning:
`ReasoningGymTask` (optional extra "gym"). `answers` reads and compares final answers;
`VerifierPool` runs verifiers in worker processes with a hard time limit.
"""

from rlax_pipe.tasks.answers import ANSWER_FORMATS
from rlax_pipe.tasks.answers import answers_match
from rlax_pipe.tasks.answers import extract_answer as extract_final_answer
from rlax_pipe.tasks.answers import format_answer
from rlax_pipe.tasks.answers import GRADERS
from rlax_pipe.tasks.answers import parse_number
from rlax_pipe.tasks.answers import strip_math_delimiters
from rlax_pipe.tasks.answers import text_after_reasoning
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
from rlax_pipe.tasks.dataset_file import DatasetFileConfig
from rlax_pipe.tasks.dataset_file import DatasetFileError
from rlax_pipe.tasks.dataset_file import DatasetFileTask
from rlax_pipe.tasks.dataset_file import read_rows
from rlax_pipe.tasks.gym import ReasoningGymConfig
from rlax_pipe.tasks.gym import ReasoningGymTask
from rlax_pipe.tasks.jsonl import extract_answer
from rlax_pipe.tasks.jsonl import JsonlConfig
from rlax_pipe.tasks.jsonl import JsonlFormatError
from rlax_pipe.tasks.jsonl import JsonlTask
from rlax_pipe.tasks.jsonl import normalize_answer
from rlax_pipe.tasks.jsonl import read_jsonl_problems
from rlax_pipe.tasks.lengths import length_stats
from rlax_pipe.tasks.lengths import LengthStats
from rlax_pipe.tasks.records import Record
from rlax_pipe.tasks.registry import make_task
from rlax_pipe.tasks.registry import TASKS
from rlax_pipe.tasks.safe_reward import grade_inline
from rlax_pipe.tasks.safe_reward import OUTCOMES
from rlax_pipe.tasks.safe_reward import RewardCounts
from rlax_pipe.tasks.safe_reward import RewardStats
from rlax_pipe.tasks.safe_reward import Verdict
from rlax_pipe.tasks.verifier_pool import VerifierPool

__all__ = [
    "ANSWER_FORMATS", "ANSWER_MARKER", "ArithmeticConfig", "ArithmeticTask", "DatasetFileConfig",
    "DatasetFileError", "DatasetFileTask", "GRADERS", "JsonlConfig", "JsonlFormatError",
    "JsonlTask", "LengthStats", "OUTCOMES", "Problem", "ReasoningGymConfig", "ReasoningGymTask",
    "Record", "RewardCounts", "RewardStats", "SPLITS", "TASKS", "Task", "Verdict", "VerifierPool",
    "answers_match", "draw_num_terms", "extract_answer", "extract_final_answer",
    "extract_marked_answer", "format_answer", "grade_inline", "length_stats", "make_task",
    "normalize_answer", "parse_number", "read_jsonl_problems", "read_rows", "render",
    "split_of", "strip_math_delimiters", "take_problems", "text_after_reasoning",
]
