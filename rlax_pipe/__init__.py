"""rlax_pipe: asynchronous pipeline RL for language models in JAX.

Data flow (one direction): tasks -> sampler -> rollout queue -> learner -> weight channel -> sampler.
"""

__version__ = "0.1.0"
