"""The experiment modules' table code on real runs: every arm runs and is tabulated and plotted, and the
modules' own columns read what a real run writes. (Each module's own columns and reports are checked on
recorded runs in its algorithm's tests: tests/test_spafl.py, test_fedldf.py, test_submodels.py; SPATL's
transfer on a real run in tests/test_spatl.py.)"""

import csv
import dataclasses
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


def _recorded(accuracy):
    """record_runs' figures: every run two evaluated rounds at `accuracy(config)` and 1,000 bytes a round."""
    def figures(config):
        records = [{"round": r, "test_accuracy": accuracy(config), "uplink_bytes": 400,
                    "cumulative_uplink_bytes": 400 * r, "cumulative_bytes": 1000 * r}
                   for r in range(1, config.rounds + 1)]
        return records, {"cumulative_bytes": 1000 * config.rounds, "total_uplink_bytes": 400 * config.rounds,
                         "rounds_done": config.rounds}
    return figures


def test_arms_runs_the_settings_arms_and_any_registered_algorithm_in_the_settings_config(monkeypatch, tmp_path):
    """`--arms` picks the setting's arms by label and adds registered algorithms that are none of them, in
    the order given; an added algorithm runs with the setting's run options (not an arm's own: FedAvg's
    lr here), the setting's algorithm options that it declares too (FedProx's mu, which the twin declares
    identically) and the rest at its defaults; the setting's per-arm accounting columns and the paper's
    figures are its own arms' alone; `--rounds` sets every arm's rounds; a relative target whose arm was
    left out is left out (it was an error)."""
    from conftest import record_runs
    from experiments.common import Arm, Setting
    from fedjax_sparse.algorithms import register, registry
    from fedjax_sparse.algorithms.fedprox import SPEC as FEDPROX
    from fedjax_sparse.run import RunConfig

    twin = dataclasses.replace(FEDPROX, name="prox_twin")  # an outside algorithm, FedProx under another name
    monkeypatch.setitem(registry.ALGORITHMS, "prox_twin", twin)  # taken out again after the test
    register(twin)  # (checked as a script's algorithm is)
    record_runs(monkeypatch, _recorded(lambda config: {"fedavg": 0.8, "prox_twin": 0.6}[config.algorithm]))
    config = RunConfig.create(dataset="digits", model="mlp", num_clients=6, clients_per_round=3, rounds=5,
                              lr=0.1, mu=0.05)
    setting = Setting("tiny", "A setting.", config, target_accuracy=0.7, relative_target=("fedavg", 0.9),
                      arms=(Arm("fedavg", {"algorithm": "fedavg", "lr": 0.05, "aggregation_weights": "uniform"},
                                {"accuracy %": 61.3}),
                            Arm("fedprox", {"algorithm": "fedprox"})),
                      run_columns=lambda config, history, summary: {"paper_count": 7})
    assert main({"tiny": setting}, "experiments.tiny", ["--arms", "prox_twin,fedavg", "--rounds", "2",
                                                         "--out", str(tmp_path), "--no-progress"]) == 0
    out = tmp_path / "tiny"
    rows = _rows(out / "results.csv")
    assert [r["algorithm"] for r in rows] == ["prox_twin", "fedavg"] and not (out / "fedprox").exists()
    saved = {r["algorithm"]: json.loads((out / r["algorithm"] / "config.json").read_text()) for r in rows}
    assert (saved["prox_twin"]["algorithm"], saved["prox_twin"]["lr"], saved["prox_twin"]["mu"]) == ("prox_twin", 0.1,
                                                                                                      0.05)
    assert saved["prox_twin"]["server_optimizer"] == FEDPROX.options().server_optimizer  # its default
    assert (saved["fedavg"]["lr"], saved["fedavg"]["aggregation_weights"]) == (0.05, "uniform")
    assert saved["prox_twin"]["rounds"] == saved["fedavg"]["rounds"] == 2 and saved["fedavg"]["num_clients"] == 6
    twin_row, fedavg_row = rows
    assert (fedavg_row["paper_count"], fedavg_row["paper: accuracy %"]) == ("7", "61.3")
    assert twin_row["paper_count"] == twin_row["paper: accuracy %"] == ""
    assert float(twin_row["target_0.9x_fedavg"]) == pytest.approx(0.72) and twin_row["rounds_to_0.9x_fedavg"] == ""
    assert "Command: `python -m experiments.tiny --arms prox_twin,fedavg" in (out / "results.md").read_text()

    assert main({"tiny": setting}, "experiments.tiny", ["--arms", "prox_twin", "--out", str(tmp_path / "alone"),
                                                         "--no-progress"]) == 0
    [row] = _rows(tmp_path / "alone" / "tiny" / "results.csv")
    assert row["algorithm"] == "prox_twin" and not any(k.startswith("target_") for k in row)


def test_an_arm_that_is_neither_the_settings_nor_registered_is_refused_before_any_run(monkeypatch, tmp_path,
                                                                                       capsys):
    """One line naming the bad name, the setting's arms and the registered algorithms; nothing runs (the
    first arm, a valid one, included)."""
    from conftest import record_runs
    from fedjax_sparse.algorithms import algorithm_names

    ran = []
    record_runs(monkeypatch, lambda config: ran.append(config) or _recorded(lambda c: 0.5)(config))
    args = ["--quick", "--out", str(tmp_path), "--no-progress", "--arms"]
    assert main(baselines_digits.SETTINGS, "experiments.baselines_digits", [*args, "fedavg,fedprx"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == (f"error: --arms fedprx: not an arm of the setting baselines_digits (fedavg, fedprox, scaffold, "
                    f"fednova) nor a registered algorithm ({', '.join(algorithm_names())})")
    assert not ran and not (tmp_path / "baselines_digits" / "fedavg").exists()
    for bad, why in (("fedavg,,scaffold", "an empty name in 'fedavg,,scaffold'"),
                     ("fedavg,fedavg", "fedavg named twice")):
        with pytest.raises(SystemExit):
            main(baselines_digits.SETTINGS, "experiments.baselines_digits", [*args, bad])
        assert f"error: argument --arms: {why}" in capsys.readouterr().err


def test_a_modules_own_report_covers_the_arms_run(monkeypatch, tmp_path):
    """FedLDF's uplink table and SPATL's transfer follow `--arms`: the uplink table lists the arms run, an
    added algorithm included, and not the setting's others (whose folders do not exist); SPATL's transfer
    is left out when SPATL's arm is (it looked for SPATL's run)."""
    from conftest import record_runs
    import experiments.fedldf as fedldf
    import experiments.spatl as spatl

    record_runs(monkeypatch, _recorded(lambda config: 0.7))
    args = ["--quick", "--rounds", "2", "--out", str(tmp_path), "--no-progress"]
    assert fedldf.run([*args, "--setting", "cifar10_iid", "--arms", "fedavg,fedprox"]) == 0
    table = (tmp_path / "cifar10_iid" / "uplink.md").read_text()
    assert "| fedavg | 2 |" in table and "| fedprox | 2 |" in table and "fedldf" not in table.split("\n", 1)[1]
    assert spatl.run([*args, "--arms", "fedavg"]) == 0
    assert [r["algorithm"] for r in _rows(tmp_path / "digits" / "results.csv")] == ["fedavg"]
    assert not (tmp_path / "digits" / "transfer.json").exists()
