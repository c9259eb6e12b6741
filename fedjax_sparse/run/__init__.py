"""The run layer: a federated experiment from a config, as the command line runs it.

Modules, one concern each: `config` (RunConfig: the run's and the chosen algorithm's options),
`config_file` (reading them from JSON/YAML/TOML), `experiment` (building the data, model, algorithm,
client store, round and evaluators), `loop` (the rounds, evaluations and the records they leave),
`folder` (a run folder's lock and its files), `checkpoints` (whole-run checkpoints for exact resume),
`signals` (SIGINT/SIGTERM), `outputs` and `tensorboard` (config, metrics, summary, plot, events),
`trackers` (`--logger`: TensorBoard, MLflow, W&B), `faults` (test-only fault injection) and `cli`
(`fedjax-sparse run`).

    from fedjax_sparse.run import RunConfig, run_experiment
    summary = run_experiment(RunConfig.create(algorithm="fedavg", rounds=5, out="runs/a"))
"""

import importlib

# name -> the module defining it, imported on first use (PEP 562): `fedjax-sparse` imports this package
# before its command line can install the signal handlers, which must come before JAX and the algorithms
_EXPORTS = {"SHARED_OPTIONS": "config", "RunConfig": "config", "Experiment": "experiment",
            "build_experiment": "experiment", "load_run_dataset": "experiment", "Counters": "loop",
            "DivergenceError": "loop", "Interrupted": "loop", "RunFailed": "loop", "evaluate": "loop",
            "run_experiment": "loop"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
