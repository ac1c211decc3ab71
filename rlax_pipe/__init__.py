"""rlax_pipe: asynchronous pipeline RL for language models in JAX.

Data flow (one direction): tasks -> sampler -> rollout queue -> learner -> weight channel -> sampler.

Layers (lowest first; a module imports only lower layers, checked by tests/test_import_layers.py):
  0  types (messages), config / config_dict (configs), sharding (logical axes, rules, meshes),
     tokenizer, logprobs, advantages, offpolicy, kl_penalty (KL to a reference), timeline,
     run_dir, plots, platform_setup, param_checksum (exact checksums of weights), cluster (processes of a multi-process job),
     host_rules (refill and micro-batch rules shared by sampler, learner and simulator),
     hlo_costs / hlo_collectives (reading compiled programs)
  1  model (the `Model` interface, built-in transformer, NNX adapter), objectives, tasks,
     costs (the cost model: measured fits, named chips, analytic accelerator model)
  2  sampler (paged-KV engine), learner (sharded train step) -- both receive a `Model`; grading;
     model_dir (HF model directories: weights + tokenizer + generation config, exported)
  3  evaluation
  4  pipeline (weight channel, staleness, queue, drivers, the RL job)
  5  sft, sim (systems model)
Experiment code (ablations, sweeps, benches, the simulator's validation) lives in experiments/.
"""

__version__ = "0.1.0"
