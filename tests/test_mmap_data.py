"""Memory-mapped client data (`data.mapped`, `--dataset mmap:FOLDER`): converters that round-trip,
a run on the folder that is the run on its source, a process that reads only its clients' rows,
and bad folders refused in one line."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from fedjax_sparse import data
from fedjax_sparse.data import mapped
from fedjax_sparse.data.convert import convert
from fedjax_sparse.data.clients import federate
from fedjax_sparse.data.process_layout import ProcessLayout
from fedjax_sparse.run import RunConfig, run_experiment
from fedjax_sparse.run.fingerprint import data_fingerprint


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDJAX_SPARSE_CACHE", str(tmp_path / "cache"))


def same_dataset(a, b):
    for field in ("x_train", "y_train", "x_test", "y_test", "train_clients", "test_clients"):
        x, y = getattr(a, field), getattr(b, field)
        assert (x is None) == (y is None), field
        if x is not None:
            assert np.asarray(x).dtype == np.asarray(y).dtype, field
            np.testing.assert_array_equal(x, y, err_msg=field)
    for field in ("name", "num_classes", "class_names", "mean", "std", "augment", "client_names"):
        assert getattr(a, field) == getattr(b, field), field


def rounds(folder):
    keep = ("round", "train_loss", "test_accuracy", "test_loss", "personalized_accuracy", "personalized_loss",
            "uplink_bytes", "downlink_bytes")
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in keep if k in r} for r in rows]


@pytest.mark.parametrize("store", ["auto", "device"])
def test_a_run_on_the_converted_folder_is_the_run_on_its_source(tmp_path, store):
    """Bit for bit, on the device store (the folder loaded whole) and where `auto` chooses: the device store
    for digits in memory, never for the folder (it would load it whole), the host store then (the stores
    compute the same)."""
    folder = convert("digits", tmp_path / "digits")
    figures, stores = [], []
    for spec in ("digits", f"mmap:{folder}"):
        out = tmp_path / spec.replace("/", "_")
        config = RunConfig.create(dataset=spec, rounds=2, num_clients=8, clients_per_round=3, local_epochs=1,
                                  client_store=store, tensorboard=False, out=str(out))
        stores.append(run_experiment(config, progress=False)["client_store"])
        figures.append(rounds(out))
    assert figures[0] == figures[1] and len(figures[0]) == 2 and "test_accuracy" in figures[0][0]
    assert stores == (["device", "host"] if store == "auto" else ["device", "device"])


def test_the_fingerprint_is_the_sources_without_reading_the_examples(tmp_path, monkeypatch):
    source = data.load_digits()
    folder = mapped.save_mapped(source, tmp_path / "digits")
    opened = data.load_dataset(f"mmap:{folder}")
    assert isinstance(opened.x_train, np.memmap) and opened.subset(None, None, 0) is opened
    same_dataset(source, opened)
    partitioned = [federate(d, 6, "dirichlet", seed=1, test_seed=2, alpha=0.5) for d in (source, opened)]
    assert data_fingerprint(partitioned[0]) == data_fingerprint(partitioned[1])


def write_leaf(root):
    """Two LEAF FEMNIST files, three writers (w1 spread over both)."""
    rng = np.random.default_rng(0)
    files = {"train": [{"w0": 3, "w1": 2}, {"w1": 2, "w2": 3}], "test": [{"w0": 1, "w1": 1, "w2": 2}]}
    for split, contents in files.items():
        (root / split).mkdir(parents=True)
        for i, users in enumerate(contents):
            user_data = {u: {"x": (rng.integers(0, 256, (n, 784)) / 255.0).tolist(),
                             "y": rng.integers(0, 62, n).tolist()} for u, n in users.items()}
            body = {"users": list(users), "num_samples": list(users.values()), "user_data": user_data}
            (root / split / f"part_{i}.json").write_text(json.dumps(body))
    return root


def test_leaf_json_converts_with_its_writers(tmp_path):
    root = write_leaf(tmp_path / "leaf")
    folder = convert(f"leaf:{root}", tmp_path / "femnist")
    opened = data.load_dataset(f"mmap:{folder}")
    same_dataset(data.load_dataset(f"leaf:{root}"), opened)
    assert opened.has_clients and data.sources.has_own_clients(f"mmap:{folder}")
    assert not data.sources.has_own_clients(f"mmap:{tmp_path / 'none'}")


def test_an_image_folder_converts(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", 3), ("test", 2)):
        for name in ("cat", "dog"):
            (tmp_path / "images" / split / name).mkdir(parents=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 256, (6, 5, 3), dtype=np.uint8)).save(
                    tmp_path / "images" / split / name / f"{i}.png")
    folder = convert(f"imagefolder:{tmp_path / 'images'}", tmp_path / "mapped")
    same_dataset(data.load_dataset(f"imagefolder:{tmp_path / 'images'}", progress=False),
                 data.load_dataset(f"mmap:{folder}"))


def test_a_tfds_data_set_converts(tmp_path, no_network):
    tfds = pytest.importorskip("tensorflow_datasets")
    with tfds.testing.mock_data(num_examples=6):  # mocked reading: nothing is built or downloaded
        source = data.load_tfds("cifar10", data_dir=tmp_path, download=False, progress=False)
        folder = convert("cifar10", tmp_path / "cifar10", data_dir=tmp_path, download=False, progress=False)
    same_dataset(source, data.load_dataset(f"mmap:{folder}"))


def same_files(folder, truth):
    """The two folders hold the same files, byte for byte (arrays and manifest compared first, to say what
    differs)."""
    names = sorted(p.name for p in folder.iterdir())
    assert names == sorted(p.name for p in truth.iterdir())
    for name in names:
        if name.endswith(".npy"):
            a, b = np.load(folder / name), np.load(truth / name)
            assert a.dtype == b.dtype and a.shape == b.shape, name
            np.testing.assert_array_equal(a, b, err_msg=name)
        else:
            assert json.loads((folder / name).read_text()) == json.loads((truth / name).read_text())
        assert (folder / name).read_bytes() == (truth / name).read_bytes(), name


def watch_writes(monkeypatch):
    """([examples decoded], chunks): for every chunk the writer receives, its rows and how many examples had
    been decoded and not yet written when it came (the decoder under test bumps the count)."""
    decoded, chunks = [0], []
    write_split = mapped.write_split

    def watched(folder, split, x_chunks, *args, **kwargs):
        def passing():
            for chunk in x_chunks:
                chunks.append((len(chunk), decoded[0] - sum(n for n, _ in chunks)))
                yield chunk

        return write_split(folder, split, passing(), *args, **kwargs)

    monkeypatch.setattr(mapped, "write_split", watched)
    return decoded, chunks


def never_whole(monkeypatch):
    """Loading the source whole (the in-memory loader) fails while the conversion runs."""
    def whole(spec, **options):
        raise AssertionError(f"convert loaded {spec} whole")

    monkeypatch.setattr(data.sources, "load_dataset", whole)


def write_image_folder(root, colour):
    """40 images of 6x7 (HxW) in two classes, PNG and JPEG: colour, some grayscale among them ('rgb'), or all
    grayscale ('gray', a 1-channel set)."""
    from PIL import Image

    rng = np.random.default_rng(1)
    for split, n in (("train", 12), ("test", 8)):
        for name in ("cat", "dog"):
            (root / split / name).mkdir(parents=True)
            for i in range(n):
                gray = colour == "gray" or i % 3 == 2
                pixels = rng.integers(0, 256, (6, 7) if gray else (6, 7, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / name / f"{i:02d}.{'jpg' if i % 2 else 'png'}")
    return root


@pytest.mark.parametrize("colour, channels", [("rgb", 3), ("gray", 1)])
def test_an_image_folder_streams_into_the_folder_its_loader_writes(tmp_path, monkeypatch, colour, channels):
    """Never loaded whole, written 5 images a chunk: the files of save_mapped(load_dataset(spec)), byte for
    byte (order, labels, channels, the training mean/std from the chunks, digests)."""
    spec = f"imagefolder:{write_image_folder(tmp_path / 'images', colour)}"
    # a budget of 5 decoded images: 3 channels each, a gray one's too (decoded in colour, then its first kept)
    monkeypatch.setattr(mapped, "_CHUNK_BYTES", 5 * 6 * 7 * 3)
    with monkeypatch.context() as patched:
        never_whole(patched)
        _, chunks = watch_writes(patched)
        streamed = convert(spec, tmp_path / "streamed", progress=False)
    assert [n for n, _ in chunks] == [5, 5, 5, 5, 4, 5, 5, 5, 1]
    truth = mapped.save_mapped(data.load_dataset(spec, progress=False), tmp_path / "whole")
    assert json.loads((truth / "manifest.json").read_text())["splits"]["train"]["shape"] == [6, 7, channels]
    same_files(streamed, truth)


@pytest.mark.parametrize("name", ["cifar10", "emnist"])
def test_a_tfds_data_set_streams_into_the_folder_its_loader_writes(tmp_path, monkeypatch, no_network, name):
    """The same for TFDS (mocked records; EMNIST's transposed back a chunk at a time), 3 records a chunk."""
    tfds = pytest.importorskip("tensorflow_datasets")
    options = dict(data_dir=tmp_path, download=False, progress=False)
    with tfds.testing.mock_data(num_examples=10):
        example_bytes = int(np.prod(tfds.builder(data.sources.TFDS_DATASETS[name][0]).info.features["image"].shape))
        monkeypatch.setattr(mapped, "_CHUNK_BYTES", 3 * example_bytes)
        with monkeypatch.context() as patched:
            never_whole(patched)
            _, chunks = watch_writes(patched)
            streamed = convert(name, tmp_path / "streamed", **options)
        truth = mapped.save_mapped(data.load_dataset(name, **options), tmp_path / "whole")
    assert [n for n, _ in chunks] == [3, 3, 3, 1] * 2
    same_files(streamed, truth)


class Records:
    """A tfds data source (random access by index) that counts the records it decodes."""

    def __init__(self, images, labels, decoded):
        self.images, self.labels, self.decoded = images, labels, decoded

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        self.decoded[0] += 1
        return {"image": self.images[index].copy(), "label": self.labels[index]}


@pytest.mark.parametrize("source", ["imagefolder", "tfds"])
def test_conversion_holds_at_most_one_chunk_of_decoded_examples(tmp_path, monkeypatch, no_network, source):
    """With 4 examples a chunk, no more than 4 decoded examples are waiting to be written when a chunk
    reaches the writer, in either split: the count of images (records) decoded, against those written."""
    decoded, chunks = watch_writes(monkeypatch)
    if source == "imagefolder":
        from fedjax_sparse.data import image_folder

        spec = f"imagefolder:{write_image_folder(tmp_path / 'images', 'rgb')}"
        read_image = image_folder._read_image
        monkeypatch.setattr(image_folder, "_read_image",
                            lambda *args: decoded.__setitem__(0, decoded[0] + 1) or read_image(*args))
        monkeypatch.setattr(mapped, "_CHUNK_BYTES", 4 * 6 * 7 * 3)
        convert(spec, tmp_path / "mapped", progress=False)
        examples = 40
    else:
        tfds = pytest.importorskip("tensorflow_datasets")
        rng = np.random.default_rng(2)
        records = {split: Records(rng.integers(0, 256, (n, 28, 28, 1), dtype=np.uint8), rng.integers(0, 10, n),
                                  decoded) for split, n in (("train", 30), ("test", 13))}
        monkeypatch.setattr(mapped, "_CHUNK_BYTES", 4 * 28 * 28)
        with tfds.testing.mock_data(as_data_source_fn=lambda builder, split, **kw: [records[s] for s in split]):
            folder = convert("mnist", tmp_path / "mapped", data_dir=tmp_path, download=False, progress=False)
        opened = data.load_dataset(f"mmap:{folder}")
        np.testing.assert_array_equal(opened.x_train, records["train"].images)
        np.testing.assert_array_equal(opened.y_test, records["test"].labels)
        examples = 43
    assert decoded[0] == examples and sum(n for n, _ in chunks) == examples and len(chunks) >= 10
    assert max(held for _, held in chunks) <= 4, chunks


def test_a_process_reads_only_its_sampled_clients_rows(tmp_path, monkeypatch):
    source = data.load_digits()
    folder = mapped.save_mapped(source, tmp_path / "digits")
    opened = data.load_dataset(f"mmap:{folder}")
    federation = federate(opened, 6, "dirichlet", seed=1, test_seed=2, alpha=0.5)
    read = []  # the byte ranges the gathers read
    pread = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, offset: read.append((offset, n)) or pread(fd, n, offset))
    sampled = np.array([5, 0, 3, 2])
    for index in (0, 1):
        train, _ = federation.on_host(ProcessLayout(index, 2))
        assert train.nbytes < source.x_train.nbytes  # nothing is read until a round asks
        read.clear()
        windows = train.windows(sampled)
        own = [c for c in sampled.tolist() if c % 2 == index]
        row = source.x_train[0].nbytes
        touched = [r for offset, n in read for r in range((offset - train.x.offset) // row,
                                                          (offset - train.x.offset + n) // row)]
        expected = np.concatenate([federation.train_indices[c] for c in own])
        assert touched == expected.tolist()  # its own sampled clients' rows, in their order, and no others
        held = windows.x.reshape(len(sampled), train.max_count, *source.input_shape)
        for k, client in enumerate(sampled.tolist()):
            rows = federation.train_indices[client]
            if client % 2 == index:
                np.testing.assert_array_equal(held[k, :len(rows)], source.x_train[rows])
            else:
                assert windows.counts[k] == 0 and not held[k].any()


def test_bad_folders_are_refused_in_one_line(tmp_path):
    def refusal(folder):
        with pytest.raises(data.DataError) as err:
            data.load_dataset(f"mmap:{folder}")
        message = str(err.value)
        assert "\n" not in message and str(folder) in message
        return message

    assert "no such folder" in refusal(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    assert "no manifest.json" in refusal(tmp_path / "empty")
    folder = mapped.save_mapped(data.load_digits(), tmp_path / "digits")
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**manifest, "version": 99}))
    assert "version 1" in refusal(folder)
    (folder / "manifest.json").write_text(json.dumps({**manifest, "splits": {"train": manifest["splits"]["train"]}}))
    assert "splits.test" in refusal(folder)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    np.save(folder / "train_x.npy", np.zeros((3, 8, 8, 1), np.uint8))  # a truncated rewrite
    assert "the manifest says uint8" in refusal(folder)
    with pytest.raises(ValueError, match="already holds a data set"):
        mapped.save_mapped(data.load_digits(), folder)
