"""The run layer: a federated experiment from a config, as the command line runs it.

Modules, one concern each: `config` (RunConfig: the run's and the chosen algorithm's options), `config_file`
(reading them from JSON/YAML/TOML), `experiment` (building the data, model, algorithm, client store, round and
evaluators), `loop` (the rounds and what they write), `records` (the counters, an evaluation's figures, the
summary), `failures` (how a run ends when it does not complete), `client_metrics` (the clients' figures as
asked for), `compiling` (what the bar says while the first round compiles), `folder` (a run folder's lock and
its files), `checkpoints` and `resume` (whole-run checkpoints for exact resume), `signals` (SIGINT, SIGTERM,
SIGHUP, SIGUSR1/2), `outputs` and `tensorboard` (config, metrics, summary, plot, events), `tracker_options` and
`trackers` (`--logger`: TensorBoard, MLflow, W&B), `federation` (the run's federation options and figures),
`fingerprint` (a run's data, checked on resume), `faults` (test-only fault injection); the command line:
`cli` (`fedjax-sparse`), `run_flags` (the run command's flags and their groups), `parsing`, `sweep` and
`sweep_table` (grids, searches, their tables), `compare` (runs side by side) and `installed` (experiments and
benchmarks from any folder).

    from fedjax_sparse.run import RunConfig, run_experiment
    summary = run_experiment(RunConfig.create(algorithm="fedavg", rounds=5, out="runs/a"))
"""

import importlib

# name -> the module defining it, imported on first use (PEP 562): `fedjax-sparse` imports this package
# before its command line can install the signal handlers, which must come before JAX and the algorithms
_EXPORTS = {"SHARED_OPTIONS": "config", "RunConfig": "config", "Experiment": "experiment",
            "build_experiment": "experiment", "load_run_dataset": "experiment", "Counters": "records",
            "DivergenceError": "failures", "Interrupted": "failures", "RunFailed": "failures", "evaluate": "records",
            "run_experiment": "loop"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
