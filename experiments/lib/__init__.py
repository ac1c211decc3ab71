"""Code shared by the entry points of experiments/: command-line configs, the pipeline benchmark,
the staleness sweep, the paper ablations and the simulator's validation. Not part of the
`rlax_pipe` library (which never reads flags); tests import it with experiments/ on sys.path."""
