"""The experiment modules' quick versions run and tabulate every compared algorithm."""

import csv
from pathlib import Path

import pytest

from experiments import baselines_cifar10, baselines_digits
from experiments.common import cifar10_folder, main


def _rows(path):
    with path.open() as f:
        return list(csv.DictReader(f))


def test_baselines_digits_quick(tmp_path):
    assert main(baselines_digits.SETTINGS, "experiments.baselines_digits",
                ["--quick", "--out", str(tmp_path), "--no-progress"]) == 0
    out = tmp_path / "baselines_digits"
    rows = _rows(out / "results.csv")
    assert [r["algorithm"] for r in rows] == ["fedavg", "fedprox", "scaffold", "fednova"]
    mb = {r["algorithm"]: float(r["mb_per_client_round"]) for r in rows}
    assert mb["scaffold"] == pytest.approx(2 * mb["fedavg"])  # model and control variate both ways
    assert mb["fedavg"] == pytest.approx(2 * 85002 * 4 / 1e6)
    assert all(float(r["final_accuracy"]) > 0.5 for r in rows)
    assert "| fedavg |" in (out / "results.md").read_text()
    assert (out / "comparison.png").stat().st_size > 1000


@pytest.mark.skipif(not Path(cifar10_folder()).is_dir(), reason="needs the CIFAR-10 image folder in ../shared")
def test_baselines_cifar10_quick(tmp_path, monkeypatch):
    """The CIFAR-10 image folder through ResNet-20, shrunk to one round of 200 examples and the two
    arms whose bytes differ (the quick setting itself runs 2 rounds of 1,000 and all four)."""
    import dataclasses
    setting = baselines_cifar10.SETTINGS["baselines_cifar10"]
    tiny = dataclasses.replace(setting, arms=tuple(a for a in setting.arms if a.label in ("fedavg", "scaffold")),
                               quick={**setting.quick, "rounds": 1, "max_train_examples": 200,
                                      "max_test_examples": 100})
    monkeypatch.setitem(baselines_cifar10.SETTINGS, "baselines_cifar10", tiny)
    assert main(baselines_cifar10.SETTINGS, "experiments.baselines_cifar10",
                ["--quick", "--out", str(tmp_path), "--no-progress"]) == 0
    rows = _rows(tmp_path / "baselines_cifar10" / "results.csv")
    mb = {r["algorithm"]: float(r["mb_per_client_round"]) for r in rows}
    # ResNet-20: 269,722 weights + 1,376 BatchNorm statistics, both ways, 4 bytes each.
    assert mb["fedavg"] == pytest.approx(2 * (269722 + 1376) * 4 / 1e6)
    assert mb["scaffold"] == pytest.approx(2 * (2 * 269722 + 1376) * 4 / 1e6)
    assert {r["paper: MB per client-round"] for r in rows} == {"2.1", "4.3"}
