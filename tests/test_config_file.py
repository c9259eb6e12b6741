"""`fedjax-sparse run --config FILE`: JSON, YAML and TOML files of the flags' options, flags on top,
a run's config.json reruns it, and bad files get the flags' one-line errors naming the key and file."""

import json

import pytest

from fedjax_sparse.run.cli import main
from fedjax_sparse.run.run_flags import command_parser, config_from_args

SMALL = ["--num-clients", "6", "--clients-per-round", "3", "--local-epochs", "1", "--no-progress"]


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_runs_saved_config_reruns_it_with_the_same_metrics(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["run", *SMALL, "--algorithm", "fedprox", "--mu", "0.05", "--server-optimizer", "momentum",
                 "--server-lr", "0.5", "--rounds", "2", "--seed", "3", "--out", str(a)]) == 0
    assert main(["run", "--config", str(a / "config.json"), "--out", str(b), "--no-progress"]) == 0
    saved_a, saved_b = (json.loads((d / "config.json").read_text()) for d in (a, b))
    assert saved_b == {**saved_a, "out": str(b)}
    assert metrics(b) == metrics(a) and len(metrics(a)) == 2


FILES = {
    "run.toml": 'algorithm = "heterofl"\ncapacities = [1, 0.5]\nlocal-epochs = 2\nlr = 0.05\nstatic_bn = false\n'
                'labels_per_client = 3\n',
    "run.yaml": "algorithm: heterofl\ncapacities: [1, 0.5]\nlocal-epochs: 2\nlr: 0.05\nstatic_bn: false\n"
                "labels_per_client: 3\n",
    "run.json": '{"algorithm": "heterofl", "capacities": [1, 0.5], "local_epochs": 2, "lr": 0.05, '
                '"static_bn": false, "labels_per_client": 3}',
}


def config_of(*argv):
    return config_from_args(command_parser().parse_args(["run", *argv]))


def test_toml_yaml_and_json_give_one_config_and_flags_override_it(tmp_path):
    configs = []
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
        configs.append(config_of("--config", str(tmp_path / name)))
    assert configs[0] == configs[1] == configs[2]
    config = configs[0]
    assert (config.algorithm, config.local_epochs, config.lr, config.labels_per_client) == ("heterofl", 2, 0.05, 3)
    assert config.algorithm_options.capacities == (1.0, 0.5) and config.algorithm_options.static_bn is False
    over = config_of("--config", str(tmp_path / "run.toml"), "--lr", "0.2", "--capacities", "0.25",
                     "--static-bn")
    assert (over.lr, over.local_epochs, over.algorithm_options.capacities) == (0.2, 2, (0.25,))
    assert over.algorithm_options.static_bn is True


@pytest.mark.parametrize("name,text,fragment", [
    ("c.toml", "learning-rate = 0.1\n", "unknown option 'learning-rate'"),
    ("c.toml", "num_client = 5\n", "unknown option 'num_client' (did you mean 'num_clients'?)"),
    ("c.yaml", "rounds: many\n", "key 'rounds': --rounds: 'many' is not a valid int"),
    ("c.yaml", "rounds: 2.5\n", "key 'rounds': --rounds: 2.5 is not a valid int"),
    ("c.json", '{"lr": -1}', "key 'lr': --lr must be > 0"),
    ("c.json", '{"partition": "zipf"}', "key 'partition': --partition must be one of iid, dirichlet, labels, natural, got zipf"),
    ("c.toml", 'shard_clients = "yes"\n', "key 'shard_clients': --shard-clients: 'yes' is not a valid bool"),
    ("c.yaml", "algorithm: heterofl\ncapacities: [1.5]\n", "key 'capacities': --capacities must be in (0, 1]"),
    ("c.yaml", "algorithm: fedavg\nmu: 0.1\n", "key 'mu': --mu is an option of fedprox; --algorithm fedavg does"),
    ("c.toml", "lr = \n", "not valid TOML"),
    ("c.yaml", "- 1\n- 2\n", "expected a mapping of option names to values, got a list"),
    ("c.ini", "lr = 0.1\n", "unknown file type .ini; valid: .json, .yaml, .yml, .toml"),
])
def test_bad_config_files_get_one_line_errors_naming_the_key_and_the_file(tmp_path, capsys, name, text, fragment):
    path = tmp_path / name
    path.write_text(text)
    assert main(["run", "--config", str(path), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--config {path}" in err and fragment in err, err
    assert not (tmp_path / "out").exists()


def test_config_and_resume_do_not_combine(tmp_path, capsys):
    (tmp_path / "c.json").write_text("{}")
    assert main(["run", "--config", str(tmp_path / "c.json"), "--resume", str(tmp_path)]) == 2
    assert "--config and --resume do not combine" in capsys.readouterr().err
