"""Installed plug-in packages, simulated: a folder of dist-info directories and modules that
`importlib.metadata` reads as it reads installed packages, once the folder is on the path (tests/test_faults_plugins.py
in-process, benchmarks/fault_probes.py through PYTHONPATH in real processes)."""

from __future__ import annotations

from pathlib import Path

from fedjax_sparse.algorithms.registry import ENTRY_POINT_GROUP


def install_plugins(site: Path, plugins: dict) -> Path:
    """Writes each distribution of `plugins` (name -> ({module file: text}, {entry point name: value})) into
    `site`: its modules and a dist-info folder (METADATA, entry_points.txt in fedjax-sparse's group). Returns `site`."""
    for dist, (files, entries) in plugins.items():
        info = site / f"{dist.replace('-', '_')}-1.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n" + "".join(
            f"{name} = {value}\n" for name, value in entries.items()))
        for file, text in files.items():
            (site / file).write_text(text)
    return site
