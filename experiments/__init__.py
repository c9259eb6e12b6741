"""Paper settings as runnable modules: `python -m experiments.NAME [--quick]`."""
