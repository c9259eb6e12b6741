"""The run layer: a federated experiment from a config, as the command line runs it.

Modules, one concern each: `config` (RunConfig: the run's and the chosen algorithm's options),
`config_file` (reading them from JSON/YAML/TOML), `experiment` (building the data, model, algorithm,
client store, round and evaluators), `loop` (the rounds, evaluations and the records they leave),
`folder` (a run folder's lock and its files), `checkpoints` (whole-run checkpoints for exact resume),
`signals` (SIGINT/SIGTERM), `outputs` and `tensorboard` (config, metrics, summary, plot, events),
`faults` (test-only fault injection) and `cli` (`fedjax-sparse run`).

    from fedjax_sparse.run import RunConfig, run_experiment
    summary = run_experiment(RunConfig.create(algorithm="fedavg", rounds=5, out="runs/a"))
"""

from fedjax_sparse.run.config import SHARED_OPTIONS, RunConfig
from fedjax_sparse.run.experiment import Experiment, build_experiment, load_run_dataset
from fedjax_sparse.run.loop import Counters, DivergenceError, Interrupted, RunFailed, evaluate, run_experiment

__all__ = ["Counters", "DivergenceError", "Experiment", "Interrupted", "RunConfig", "RunFailed", "SHARED_OPTIONS",
           "build_experiment", "evaluate", "load_run_dataset", "run_experiment"]
