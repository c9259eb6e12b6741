"""The experiment modules' table code on real runs: every arm runs and is tabulated and plotted, and the
modules' own columns read what a real run writes. (Each module's own columns and reports are checked on
recorded runs in its algorithm's tests: tests/test_spafl.py, test_fedldf.py, test_submodels.py; SPATL's
transfer on a real run in tests/test_spatl.py.)"""

import csv
import json
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

    # the modules' own columns on FedAvg's real run: SpaFL's convention counts the dense MLP's 84,480
    # kernel weights both ways at 32 bits and FedAvg's counted FLOPs; FedLDF's uplink curve ends at the total
    from experiments.fedldf import cumulative_uplink
    from experiments.spafl import spafl_columns
    setting = baselines_digits.SETTINGS["baselines_digits"]
    config = setting.arm_config(setting.arms[0], out, quick=True)
    history = [json.loads(line) for line in (out / "fedavg" / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "fedavg" / "summary.json").read_text())
    columns = spafl_columns(config, history, summary)
    participations = config.rounds * config.clients_per_round
    assert columns["comm_gbit_spafl"] == pytest.approx(participations * 2 * 84480 * 32 / 1e9)
    assert columns["flops_spafl"] == columns["flops_counted"] == summary["train_flops_total"] / config.num_clients > 0
    assert cumulative_uplink(history)[-1] == summary["total_uplink_bytes"]


def cifar10_sample(root, train_per_class, test_per_class):
    """A CIFAR-10 image folder of the first images of each class of the real one (the test's run reads 200
    images; the whole folder would be decoded and hashed, 60,000 of them, into the session's fresh cache)."""
    import shutil
    for split, count in (("train", train_per_class), ("test", test_per_class)):
        for label in sorted(p.name for p in (Path(cifar10_folder()) / split).iterdir()):
            (root / split / label).mkdir(parents=True)
            for image in sorted((Path(cifar10_folder()) / split / label).iterdir())[:count]:
                shutil.copy(image, root / split / label / image.name)
    return root


@pytest.mark.skipif(not Path(cifar10_folder()).is_dir(), reason="needs the CIFAR-10 image folder in ../shared")
def test_baselines_cifar10_quick(tmp_path, monkeypatch):
    """CIFAR-10's images through ResNet-20, shrunk to one round of 200 examples (of a folder of 30 images a
    class, copied from the real one) and SCAFFOLD's arm, whose bytes hold the model's weights twice (the
    control variate) and its BatchNorm statistics once (the quick setting itself runs 2 rounds of 1,000 and
    all four arms; FedAvg's bytes are the model both ways, test_baselines_digits_quick's)."""
    import dataclasses
    setting = baselines_cifar10.SETTINGS["baselines_cifar10"]
    assert setting.config.dataset == f"imagefolder:{cifar10_folder()}"
    sample = cifar10_sample(tmp_path / "cifar10", 30, 10)
    tiny = dataclasses.replace(setting, config=setting.config.replace(dataset=f"imagefolder:{sample}"),
                               arms=tuple(a for a in setting.arms if a.label == "scaffold"),
                               quick={**setting.quick, "rounds": 1, "max_train_examples": 200,
                                      "max_test_examples": 100})
    monkeypatch.setitem(baselines_cifar10.SETTINGS, "baselines_cifar10", tiny)
    assert main(baselines_cifar10.SETTINGS, "experiments.baselines_cifar10",
                ["--quick", "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    rows = _rows(tmp_path / "out" / "baselines_cifar10" / "results.csv")
    [row] = rows
    # ResNet-20: 269,722 weights twice + 1,376 BatchNorm statistics, both ways, 4 bytes each.
    assert float(row["mb_per_client_round"]) == pytest.approx(2 * (2 * 269722 + 1376) * 4 / 1e6)
    assert row["paper: MB per client-round"] == "4.3"
