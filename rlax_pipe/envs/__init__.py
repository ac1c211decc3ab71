"""Multi-turn, tool-calling episodes: the environment protocol, tool-call protocols, the tool
pool, the episode runner on the sampler engine, the calculator environment and the sandboxed
Python tool (`EnvConfig.tool="python"` adds it to any task).

Token-in, token-out: the tokens trained are exactly the tokens the sampler drew plus the
environment's tokens, rendered once and appended by a prefill continuation; environment tokens
have loss mask 0 (`Rollout.loss_mask`).
"""

from rlax_pipe.envs.base import ADDED_TOOLS
from rlax_pipe.envs.base import add_tool
from rlax_pipe.envs.base import EnvConfig
from rlax_pipe.envs.base import Environment
from rlax_pipe.envs.base import is_environment
from rlax_pipe.envs.base import TOOL_FAILURE_POLICIES
from rlax_pipe.envs.base import TOOL_OUTCOMES
from rlax_pipe.envs.base import ToolResult
from rlax_pipe.envs.protocols import CALCULATOR_PROTOCOL
from rlax_pipe.envs.protocols import ChatToolProtocol
from rlax_pipe.envs.protocols import CodeBlockProtocol
from rlax_pipe.envs.protocols import declare_tools
from rlax_pipe.envs.protocols import PlainTextProtocol
from rlax_pipe.envs.protocols import protocol_for
from rlax_pipe.envs.runner import EPISODE_COUNTS
from rlax_pipe.envs.runner import EpisodeEngine
from rlax_pipe.envs.runner import evaluation_engine
from rlax_pipe.envs.tool_pool import ToolPool
from rlax_pipe.tasks.calculator import CalculatorArithmeticTask
from rlax_pipe.tasks.calculator import evaluate
from rlax_pipe.tasks.python_tool import PythonToolTask
from rlax_pipe.tasks.python_tool import run_python
from rlax_pipe.tasks.python_tool import SandboxConfig
from rlax_pipe.tasks.tools import ToolCall
from rlax_pipe.tasks.tools import ToolError
