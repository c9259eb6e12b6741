"""Bad input, diverging runs and unreadable data end in one clear line; random streams stay apart."""

import json
import re

import jax
import numpy as np
import pytest
from PIL import Image

from fedjax_sparse import run as runner
from fedjax_sparse.run.cli import main
from fedjax_sparse.core.round import streams
from fedjax_sparse.core.federation.participation import sample_clients
from fedjax_sparse.core.round.streams import STREAMS, stream_key, stream_seed

TINY = ["--num-clients", "6", "--clients-per-round", "3", "--rounds", "1", "--local-epochs", "1", "--no-progress"]


def run_cli(capsys, args):
    code = main(["run", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith("fedjax-sparse: error: "), lines[0]
    return lines[0]


def strict_json(text: str):
    """json.loads that refuses NaN and the infinities, which strict JSON does not have."""
    def refuse(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


def test_strict_parser_refuses_nan():
    with pytest.raises(ValueError, match="NaN"):
        strict_json('{"loss": NaN}')
    with pytest.raises(ValueError, match="Infinity"):
        strict_json("[-Infinity]")


@pytest.mark.parametrize("args,message", [
    (["--weight-decay", "-1"], "--weight-decay must be >= 0, got -1.0"),
    (["--algorithm", "scaffold", "--server-lr", "inf"], "--server-lr must be a finite number > 0, got inf"),
    (["--momentum", "1"], "--momentum must be in [0, 1), got 1.0"),
    (["--seed", "-1"], "--seed must be in [0, 4294967295], got -1"),
    (["--algorithm", "fedprox", "--mu", "-1"], "--mu must be >= 0, got -1.0"),
    (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
])
def test_out_of_range_values_get_one_line_naming_the_flag(tmp_path, capsys, args, message):
    out = tmp_path / "bad"
    code, stdout, err = run_cli(capsys, [*TINY, *args, "--out", str(out)])
    assert code == 2
    assert one_error_line(err) == f"fedjax-sparse: error: {message}"
    assert stdout == "" and not out.exists()  # refused before anything was written


@pytest.mark.parametrize("args,flag,users", [
    (["--mu", "0.1"], "--mu", "fedprox"),
    (["--algorithm", "spafl", "--server-lr", "0.5"], "--server-lr", "scaffold"),
])
def test_a_flag_the_algorithm_does_not_read_is_refused(tmp_path, capsys, args, flag, users):
    code, _, err = run_cli(capsys, [*TINY, *args, "--out", str(tmp_path / "bad")])
    assert code == 2
    line = one_error_line(err)
    algorithm = "spafl" if "spafl" in args else "fedavg"
    assert f"{flag} is an option of " in line and users in line
    assert line.endswith(f"--algorithm {algorithm} does not read it")


def check_written_files_are_strict_json(out):
    rows = [strict_json(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = strict_json((out / "summary.json").read_text())
    strict_json((out / "config.json").read_text())
    strict_json((out / "partition.json").read_text())
    return rows, summary


def test_a_diverging_run_stops_with_one_line_and_strict_json(tmp_path, capsys):
    out = tmp_path / "diverged"
    code, stdout, err = run_cli(capsys, [*TINY, "--rounds", "3", "--lr", "1e6", "--out", str(out)])
    assert code == 2 and "done" not in stdout
    line = one_error_line(err)
    assert re.search(r"round [123]: ", line) and "diverged" in line and "--lr" in line, line
    rows, summary = check_written_files_are_strict_json(out)
    assert summary["status"] == "diverged"
    assert f"fedjax-sparse: error: {summary['error']}" == line
    assert len(rows) < int(re.search(r"round (\d+)", line).group(1))  # the diverged round is not logged


def test_a_non_finite_test_loss_is_written_as_null(tmp_path, capsys):
    """A server step 1000 times the mean update: round 1 trains normally, later rounds blow up, and
    the round whose test loss is NaN is logged (as null) before the run stops, naming --server-lr."""
    out = tmp_path / "diverged"
    code, _, err = run_cli(capsys, [*TINY, "--rounds", "3", "--algorithm", "scaffold", "--server-lr", "1000",
                                    "--out", str(out)])
    assert code == 2
    line = one_error_line(err)
    assert re.search(r"round [23]: ", line) and "--server-lr" in line, line
    rows, summary = check_written_files_are_strict_json(out)
    assert summary["status"] == "diverged" and rows and rows[0]["round"] == 1
    assert np.isfinite(rows[0]["train_loss"])
    if "test loss is nan" in line:
        assert rows[-1]["test_loss"] is None


def make_image_folder(root, bad_split, bad_kind):
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        for label in ("0", "1"):
            folder = root / split / label
            folder.mkdir(parents=True)
            for i in range(3):
                Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8), "L").save(folder / f"{i}.png")
    bad = root / bad_split / "0" / "zz_bad.jpg"  # sorts last: the first image is readable
    if bad_kind == "garbage":
        bad.write_bytes(b"this is not a jpeg at all" * 10)
    else:  # a real JPEG cut short
        good = root / "scratch.jpg"
        Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8), "RGB").save(good, quality=95)
        bad.write_bytes(good.read_bytes()[:60])
        good.unlink()


def without_progress_bars(err: str) -> str:
    """stderr without the lines of the image decoding's tqdm bar (see the test below)."""
    return "\n".join(line for line in err.splitlines() if line.strip() and not line.startswith("decoding "))


@pytest.mark.parametrize("bad_split,bad_kind", [("train", "garbage"), ("test", "garbage"),
                                                 ("train", "truncated")])
def test_an_unreadable_image_gives_one_line(tmp_path, capsys, bad_split, bad_kind):
    root = tmp_path / "images"
    make_image_folder(root, bad_split, bad_kind)
    code, _, err = run_cli(capsys, [*TINY, "--dataset", f"imagefolder:{root}", "--out", str(tmp_path / "run")])
    assert code == 2
    line = one_error_line(without_progress_bars(err))
    assert line.startswith(f"fedjax-sparse: error: cannot load data set 'imagefolder:{root}': "), line
    if bad_kind == "garbage":
        assert f"{bad_split}/0/zz_bad.jpg" in line


def test_no_progress_draws_no_decoding_bar(tmp_path, capsys):
    """KNOWN LIBRARY BUG (fails until fixed): --no-progress does not reach the image decoding, whose
    tqdm bar is drawn on stderr anyway (runner.build_experiment calls load_dataset without the run's
    progress setting, and load_image_folder defaults to progress=True), so an image-folder error is
    not the one line every other error is."""
    root = tmp_path / "images"
    make_image_folder(root, "test", "garbage")
    code, _, err = run_cli(capsys, [*TINY, "--dataset", f"imagefolder:{root}", "--out", str(tmp_path / "run")])
    assert code == 2
    one_error_line(err)


def test_a_missing_image_folder_gives_one_line(tmp_path, capsys):
    code, _, err = run_cli(capsys, [*TINY, "--dataset", "imagefolder:/no/such", "--out", str(tmp_path / "run")])
    assert code == 2
    line = one_error_line(err)
    assert "cannot load data set 'imagefolder:/no/such'" in line and "does not exist" in line


def test_a_method_without_a_global_model_says_so(tmp_path, capsys):
    out = tmp_path / "local"
    code, stdout, _ = run_cli(capsys, [*TINY, "--algorithm", "local", "--out", str(out)])
    assert code == 0
    summary = strict_json((out / "summary.json").read_text())
    assert stdout.startswith(f"done: no global model, personalized accuracy "
                             f"{summary['final_personalized_accuracy']:.4f}, 0 bytes in ")


# ---------------------------------------------------------------------------------------------
# Independent random streams


@pytest.mark.parametrize("seed", [0, 1, 2**31 - 1])
def test_every_stream_of_a_seed_is_different(seed):
    keys = {name: tuple(np.asarray(jax.random.key_data(stream_key(seed, name))).ravel()) for name in STREAMS}
    assert len(set(keys.values())) == len(STREAMS)
    draws = {name: float(jax.random.uniform(stream_key(seed, name))) for name in STREAMS}
    assert len(set(draws.values())) == len(STREAMS)
    seeds = {name: tuple(stream_seed(seed, name)) for name in STREAMS}
    assert len(set(seeds.values())) == len(STREAMS)
    numpy_draws = {name: np.random.default_rng(stream_seed(seed, name)).random() for name in STREAMS}
    assert len(set(numpy_draws.values())) == len(STREAMS)
    # and a stream of one seed is not the same stream of the next seed
    assert np.random.default_rng(stream_seed(seed, "partition")).random() != \
        np.random.default_rng(stream_seed(seed + 1, "partition")).random()
    with pytest.raises(ValueError, match="unknown random stream"):
        stream_key(seed, "no_such_stream")


def experiment_with_a_stream_moved(monkeypatch, moved: str | None):
    """A tiny run's experiment and the clients its first 5 rounds sample, with stream `moved` drawn
    under another tag (as if that stream had been drawn differently), wherever streams are used."""
    tag = streams._tag
    monkeypatch.setattr(streams, "_tag", lambda name: tag(name) ^ 0x5A5A5A if name == moved else tag(name))
    config = runner.RunConfig.create(num_clients=6, clients_per_round=2, local_epochs=1, seed=3, out="unused")
    exp = runner.build_experiment(config)
    sampled = np.stack([sample_clients(3, r, 6, 2) for r in range(5)])
    monkeypatch.undo()
    return exp, sampled


def test_moving_one_stream_leaves_the_others_alone(monkeypatch):
    """A different model initialization leaves the partition, the local test split and the sampled
    clients as they were; a different local test split leaves the partition as it was. Moving the
    partition or the sampling stream does change those (so the checks can see a change)."""
    base, base_ids = experiment_with_a_stream_moved(monkeypatch, None)
    model_moved, model_moved_ids = experiment_with_a_stream_moved(monkeypatch, "model_init")

    def leaves(tree):
        return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]

    assert not all(np.array_equal(a, b) for a, b in zip(leaves(base.server_state), leaves(model_moved.server_state)))
    for a, b in zip(base.client_indices, model_moved.client_indices):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(leaves(base.local_test), leaves(model_moved.local_test)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(base_ids, model_moved_ids)

    test_moved, test_moved_ids = experiment_with_a_stream_moved(monkeypatch, "local_test")
    for a, b in zip(base.client_indices, test_moved.client_indices):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(np.asarray(base.local_test.x), np.asarray(test_moved.local_test.x))
    np.testing.assert_array_equal(base_ids, test_moved_ids)

    partition_moved, _ = experiment_with_a_stream_moved(monkeypatch, "partition")
    assert any(len(a) != len(b) or not np.array_equal(a, b)
               for a, b in zip(base.client_indices, partition_moved.client_indices))
    _, sampling_moved_ids = experiment_with_a_stream_moved(monkeypatch, "sampling")
    assert not np.array_equal(base_ids, sampling_moved_ids)
