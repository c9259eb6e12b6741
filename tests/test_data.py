"""Tests for fedjax_sparse.data: partitioners, loaders and augmentation."""

from __future__ import annotations

import io
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from fedjax_sparse import data
from fedjax_sparse.data import image_folder
from fedjax_sparse.data.partition import (
    dirichlet_partition,
    iid_partition,
    label_partition,
    local_test_split,
    partition,
    partition_summary,
)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    # No test may write into the user's ~/.cache.
    monkeypatch.setenv("FEDJAX_SPARSE_CACHE", str(tmp_path / "env_cache"))


def make_labels(num_classes=10, per_class=100, seed=0):
    labels = np.repeat(np.arange(num_classes), per_class)
    return np.random.default_rng(seed).permutation(labels)


def assert_covers(parts, n):
    assert sum(len(p) for p in parts) == n
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(n))


def mean_tv_from_global(parts, labels, num_classes):
    """Mean total-variation distance between each client's label mix and the global one."""
    global_p = np.bincount(labels, minlength=num_classes) / len(labels)
    tvs = [0.5 * np.abs(np.bincount(labels[p], minlength=num_classes) / len(p) - global_p).sum() for p in parts]
    return float(np.mean(tvs))


# ----------------------------------------------------------------------------
# Partitioners


def test_iid_partition_covers_and_is_balanced():
    labels = make_labels()
    parts = iid_partition(labels, 7, seed=0)
    assert len(parts) == 7
    assert_covers(parts, len(labels))
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert mean_tv_from_global(parts, labels, 10) < 0.15


def test_dirichlet_partition_covers_and_skew_follows_alpha():
    labels = make_labels()
    skewed = dirichlet_partition(labels, 10, alpha=0.05, seed=0)
    flat = dirichlet_partition(labels, 10, alpha=1000.0, seed=0)
    for parts in (skewed, flat):
        assert len(parts) == 10
        assert_covers(parts, len(labels))
        assert min(len(p) for p in parts) >= 2
    assert mean_tv_from_global(skewed, labels, 10) > 0.5
    assert mean_tv_from_global(flat, labels, 10) < 0.05
    # Small alpha: a typical client has most of its data from few classes.
    top2 = np.mean([np.sort(np.bincount(labels[p], minlength=10))[-2:].sum() / len(p) for p in skewed])
    assert top2 > 0.7


def test_label_partition_exact_labels_per_client():
    labels = make_labels()
    for num_clients, s in [(10, 2), (7, 3), (20, 1), (4, 10)]:
        parts = label_partition(labels, num_clients, s, seed=1)
        assert_covers(parts, len(labels))
        holders = np.zeros(10, dtype=int)
        for p in parts:
            present = np.unique(labels[p])
            assert len(present) == s
            holders[present] += 1
        # Balanced over labels: every class has floor or ceil of num_clients * s / 10 holders.
        assert holders.max() - holders.min() <= 1
        # The holders of a class split its examples evenly.
        for c in range(10):
            counts = [int((labels[p] == c).sum()) for p in parts if (labels[p] == c).any()]
            assert max(counts) - min(counts) <= 1


@pytest.mark.parametrize(
    "method, kwargs",
    [("iid", {}), ("dirichlet", {"alpha": 0.3}), ("labels", {"labels_per_client": 2})],
)
def test_partition_is_deterministic_in_seed(method, kwargs):
    labels = make_labels()
    a = partition(labels, 10, method, seed=3, **kwargs)
    b = partition(labels, 10, method, seed=3, **kwargs)
    c = partition(labels, 10, method, seed=4, **kwargs)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(len(x) == len(y) and np.array_equal(x, y) for x, y in zip(a, c))
    assert_covers(a, len(labels))


def test_dirichlet_gives_up_quickly_with_clear_message():
    labels = make_labels()
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"num_clients=50.*min_examples=15.*alpha=0\.01.*larger alpha"):
        dirichlet_partition(labels, 50, alpha=0.01, seed=0, min_examples=15)
    # Impossible outright: 50 clients x 30 examples > 1000 examples.
    with pytest.raises(ValueError, match=r"num_clients=50.*min_examples=30"):
        dirichlet_partition(labels, 50, alpha=0.01, seed=0, min_examples=30)
    with pytest.raises(ValueError, match=r"in 4 draws"):
        dirichlet_partition(labels, 50, alpha=0.01, seed=0, min_examples=15, max_redraws=3)
    assert time.perf_counter() - start < 5.0


@pytest.mark.parametrize(
    "args, kwargs, pattern",
    [
        ((10, "shards"), {}, r"'shards'.*iid, dirichlet, labels"),
        ((10, "dirichlet"), {}, r"needs alpha"),
        ((10, "dirichlet"), {"alpha": 0.0}, r"alpha=0\.0 must be a positive"),
        ((10, "dirichlet"), {"alpha": -1.0}, r"alpha=-1\.0 must be a positive"),
        ((10, "labels"), {}, r"needs labels_per_client between 1 and .* \(10\)"),
        ((10, "labels"), {"labels_per_client": 0}, r"labels_per_client=0 must be between 1 and .* \(10\)"),
        ((10, "labels"), {"labels_per_client": 11}, r"labels_per_client=11 must be between 1 and .* \(10\)"),
        ((0, "iid"), {}, r"num_clients=0 must be at least 1"),
        ((1001, "iid"), {}, r"num_clients=1001 exceeds the 1000 examples"),
        ((3, "labels"), {"labels_per_client": 2}, r"covers only 6 of 10 classes"),
    ],
)
def test_partition_argument_errors(args, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        partition(make_labels(), *args, seed=0, **kwargs)


# ----------------------------------------------------------------------------
# Local test splits and summaries


def test_local_test_split_follows_client_label_mix():
    train_labels = make_labels(per_class=100, seed=0)
    test_labels = make_labels(per_class=200, seed=1)
    parts = dirichlet_partition(train_labels, 8, alpha=0.3, seed=0)
    splits = local_test_split(parts, train_labels, test_labels, 10, seed=0, ratio=0.2)
    assert len(splits) == 8
    for train_idx, test_idx in zip(parts, splits):
        n_test = max(1, round(0.2 * len(train_idx)))
        assert len(test_idx) == n_test
        assert len(np.unique(test_idx)) == len(test_idx)  # without replacement
        train_counts = np.bincount(train_labels[train_idx], minlength=10)
        test_counts = np.bincount(test_labels[test_idx], minlength=10)
        assert set(np.flatnonzero(test_counts)) <= set(np.flatnonzero(train_counts))
        # Largest remainder: each class is within one example of its exact quota.
        quota = train_counts / train_counts.sum() * n_test
        assert np.all(np.abs(test_counts - quota) < 1.0)
    again = local_test_split(parts, train_labels, test_labels, 10, seed=0, ratio=0.2)
    assert all(np.array_equal(a, b) for a, b in zip(splits, again))


def test_local_test_split_min_examples_and_cap():
    train_labels = np.array([0] * 50 + [1] * 50)
    test_labels = np.array([0] * 3 + [1] * 100)
    parts = [np.arange(50), np.arange(50, 52), np.arange(0, 0)]
    splits = local_test_split(parts, train_labels, test_labels, 2, seed=0, ratio=0.2, min_examples=5)
    assert len(splits[0]) == 3  # wants 10 of class 0, the test set only has 3
    assert np.all(test_labels[splits[0]] == 0)
    assert len(splits[1]) == 5 and np.all(test_labels[splits[1]] == 1)  # min_examples
    assert len(splits[2]) == 0  # no training data, nothing to mirror


def test_partition_summary():
    labels = make_labels()
    parts = label_partition(labels, 5, 2, seed=0)
    summary = partition_summary(parts, labels, 10)
    assert [s["num_examples"] for s in summary] == [len(p) for p in parts]
    for s, p in zip(summary, parts):
        assert s["class_counts"] == np.bincount(labels[p], minlength=10).tolist()
        assert all(type(v) is int for v in s["class_counts"])
    assert sum(s["num_examples"] for s in summary) == len(labels)


# ----------------------------------------------------------------------------
# Digits


def test_load_digits():
    ds = data.load_digits(seed=0)
    assert isinstance(ds, data.ImageDataset)
    assert ds.x_train.dtype == np.uint8 and ds.x_train.shape[1:] == (8, 8, 1)
    assert ds.x_train.shape[0] + ds.x_test.shape[0] == 1797
    assert abs(ds.x_test.shape[0] - 0.2 * 1797) <= 10
    assert ds.x_train.max() == 255 and ds.x_train.min() == 0
    assert ds.num_classes == 10 and len(ds.class_names) == 10 and not ds.augment
    assert set(np.unique(ds.y_train)) == set(range(10)) and ds.y_test.max() < 10
    # Stratified: every class has about 20% of its examples in test.
    frac = np.bincount(ds.y_test, minlength=10) / (np.bincount(ds.y_test, minlength=10) + np.bincount(ds.y_train, minlength=10))
    assert np.all(np.abs(frac - 0.2) < 0.02)
    x = ds.x_train / 255.0
    np.testing.assert_allclose(ds.mean, x.mean(axis=(0, 1, 2)), rtol=1e-9)
    np.testing.assert_allclose(ds.std, x.std(axis=(0, 1, 2)), rtol=1e-9)
    same = data.load_digits(seed=0)
    other = data.load_digits(seed=1)
    np.testing.assert_array_equal(ds.x_train, same.x_train)
    np.testing.assert_array_equal(ds.y_test, same.y_test)
    assert not np.array_equal(ds.y_test, other.y_test) or not np.array_equal(ds.x_test, other.x_test)
    assert data.load_dataset("digits").x_train.shape == ds.x_train.shape


def test_digits_are_scikit_learns_read_without_importing_it():
    """The images and labels are what scikit-learn's own loader gives, every one, in its order; a process
    that loads them has not imported scikit-learn (a second of every run's start)."""
    import subprocess
    import sys

    from sklearn.datasets import load_digits as sklearn_digits

    from fedjax_sparse.data.sources import _digits_arrays

    pixels, labels = _digits_arrays()
    bunch = sklearn_digits()
    np.testing.assert_array_equal(pixels, bunch.data)
    np.testing.assert_array_equal(labels, bunch.target)
    ds = data.load_digits(seed=0)
    order = np.concatenate([ds.x_train, ds.x_test]).reshape(-1, 64)
    assert sorted(map(bytes, order)) == sorted(map(bytes, np.round(bunch.data * 255 / 16).astype(np.uint8)))
    code = ("import sys; from fedjax_sparse.data import load_digits; load_digits(); "
            "assert 'sklearn' not in sys.modules and 'scipy' not in sys.modules, sorted(sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_load_dataset_unknown_spec():
    with pytest.raises(ValueError, match=r"'svhn'.*digits.*cifar10.*mnist.*imagefolder:PATH"):
        data.load_dataset("svhn")
    with pytest.raises(ValueError, match=r"'imagefolder:'"):
        data.load_dataset("imagefolder:")


# ----------------------------------------------------------------------------
# Image folders


def write_image(path, array, fmt):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path, format=fmt)


def make_folder(root, size=8, seed=0):
    """2 classes x (3 train + 2 test); 'cat' is PNG, 'dog' is JPEG. Returns the PNG pixels."""
    rng = np.random.default_rng(seed)
    pngs = {}
    for split, n in (("train", 3), ("test", 2)):
        for i in range(n):
            img = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
            write_image(root / split / "cat" / f"{i}.png", img, "PNG")
            pngs[(split, i)] = img
            write_image(root / split / "dog" / f"{i}.jpg", np.full((size, size, 3), 40 * i + 20, np.uint8), "JPEG")
    return pngs


def test_image_folder_loads_and_caches(tmp_path, monkeypatch):
    root = tmp_path / "folder"
    pngs = make_folder(root)
    cache = tmp_path / "cache"
    ds = data.load_image_folder(root, cache_dir=cache)
    assert ds.class_names == ("cat", "dog") and ds.num_classes == 2
    assert ds.x_train.shape == (6, 8, 8, 3) and ds.x_test.shape == (4, 8, 8, 3)
    assert ds.x_train.dtype == np.uint8 and not ds.augment
    np.testing.assert_array_equal(ds.y_train, [0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(ds.y_test, [0, 0, 1, 1])
    for i in range(3):
        np.testing.assert_array_equal(ds.x_train[i], pngs[("train", i)])
    for i in range(2):
        np.testing.assert_array_equal(ds.x_test[i], pngs[("test", i)])
    # JPEG of a flat colour decodes to (almost) that colour.
    assert np.abs(ds.x_train[4].astype(int) - 60).max() <= 2
    x = ds.x_train / 255.0
    np.testing.assert_allclose(ds.mean, x.mean(axis=(0, 1, 2)), rtol=1e-9)
    np.testing.assert_allclose(ds.std, x.std(axis=(0, 1, 2)), rtol=1e-9)
    # Atomic write leaves exactly one finished cache directory and no temporaries.
    (entry,) = (cache / "imagefolder").iterdir()
    assert (entry / "meta.json").exists() and not entry.name.startswith(".tmp")

    def must_not_decode(*args, **kwargs):
        raise AssertionError("second load decoded images instead of reading the cache")

    monkeypatch.setattr(image_folder, "_decode_files", must_not_decode)
    again = data.load_image_folder(root, cache_dir=cache)
    for name in ("x_train", "y_train", "x_test", "y_test"):
        np.testing.assert_array_equal(getattr(again, name), getattr(ds, name))
    assert again.mean == ds.mean and again.class_names == ds.class_names
    # A new file changes the cache key, so the folder is decoded again.
    write_image(root / "train" / "cat" / "9.png", pngs[("train", 0)], "PNG")
    with pytest.raises(AssertionError, match="decoded images"):
        data.load_image_folder(root, cache_dir=cache)
    # load_dataset dispatches 'imagefolder:PATH'.
    monkeypatch.undo()
    assert data.load_dataset(f"imagefolder:{root}", cache_dir=cache).x_train.shape == (7, 8, 8, 3)


def test_image_folder_repairs_corrupt_cache(tmp_path, monkeypatch):
    root = tmp_path / "folder"
    make_folder(root)
    cache = tmp_path / "cache"
    ds = data.load_image_folder(root, cache_dir=cache)
    (entry,) = (cache / "imagefolder").iterdir()
    (entry / "x_train.npy").write_bytes(b"not a numpy file")
    repaired = data.load_image_folder(root, cache_dir=cache)
    np.testing.assert_array_equal(repaired.x_train, ds.x_train)
    monkeypatch.setattr(image_folder, "_decode_files", lambda *a, **k: pytest.fail("cache was not repaired"))
    np.testing.assert_array_equal(data.load_image_folder(root, cache_dir=cache).x_train, ds.x_train)
    assert [p.name for p in (cache / "imagefolder").iterdir()] == [entry.name]


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # JAX's warning; workers never touch JAX
def test_image_folder_env_cache_and_process_pool(tmp_path, monkeypatch):
    root = tmp_path / "folder"
    make_folder(root)
    serial = data.load_image_folder(root, cache_dir=tmp_path / "c1", num_workers=1)
    # Other tests may have initialised JAX already; force the forked pool anyway.
    monkeypatch.setattr(image_folder, "_fork_is_safe", lambda: True)
    monkeypatch.setenv("FEDJAX_SPARSE_CACHE", str(tmp_path / "from_env"))
    pooled = data.load_image_folder(root, num_workers=2)
    assert len(list((tmp_path / "from_env" / "imagefolder").iterdir())) == 1
    np.testing.assert_array_equal(serial.x_train, pooled.x_train)
    np.testing.assert_array_equal(serial.x_test, pooled.x_test)
    # Errors raised inside a worker reach the caller intact.
    write_image(root / "test" / "dog" / "odd.png", np.zeros((8, 7, 3), np.uint8), "PNG")
    with pytest.raises(ValueError, match=r"dog/odd\.png is 7x8"):
        data.load_image_folder(root, num_workers=2)


def test_fork_is_unsafe_once_jax_is_initialised():
    jnp.zeros(1).block_until_ready()
    assert not image_folder._fork_is_safe()


def test_image_folder_grayscale_and_cifar_like(tmp_path):
    gray_root = tmp_path / "gray"
    rng = np.random.default_rng(0)
    imgs = {}
    for split in ("train", "test"):
        for c in ("a", "b"):
            imgs[(split, c)] = rng.integers(0, 256, (5, 6), dtype=np.uint8)
            write_image(gray_root / split / c / "x.png", imgs[(split, c)], "PNG")
    ds = data.load_image_folder(gray_root, cache_dir=tmp_path / "cache")
    assert ds.x_train.shape == (2, 5, 6, 1) and len(ds.mean) == 1
    np.testing.assert_array_equal(ds.x_train[1, ..., 0], imgs[("train", "b")])
    # One RGBA image makes the whole set RGB; grayscale images are replicated.
    rgba = np.concatenate([rng.integers(0, 256, (5, 6, 3), dtype=np.uint8), np.full((5, 6, 1), 255, np.uint8)], -1)
    write_image(gray_root / "test" / "a" / "y.png", rgba, "PNG")
    ds = data.load_image_folder(gray_root, cache_dir=tmp_path / "cache")
    assert ds.x_train.shape == (2, 5, 6, 3)
    np.testing.assert_array_equal(ds.x_train[0], np.repeat(imgs[("train", "a")][..., None], 3, -1))
    np.testing.assert_array_equal(ds.x_test[1], rgba[..., :3])

    cifar_root = tmp_path / "cifar_like"
    make_folder(cifar_root, size=32)
    ds = data.load_image_folder(cifar_root, cache_dir=tmp_path / "cache")
    assert ds.input_shape == (32, 32, 3) and ds.augment


def test_image_folder_errors(tmp_path):
    cache = tmp_path / "cache"
    with pytest.raises(FileNotFoundError, match=r"nowhere.*does not exist.*ROOT/\{train,test\}/CLASS_NAME"):
        data.load_image_folder(tmp_path / "nowhere", cache_dir=cache)

    root = tmp_path / "f"
    make_folder(root)
    os.rename(root / "test", root / "val")
    with pytest.raises(FileNotFoundError, match=r"f/test does not exist.*expected layout"):
        data.load_image_folder(root, cache_dir=cache)
    os.rename(root / "val", root / "test")

    write_image(root / "train" / "cow" / "0.png", np.zeros((8, 8, 3), np.uint8), "PNG")
    with pytest.raises(ValueError, match=r"missing from test/: \['cow'\]; missing from train/: none"):
        data.load_image_folder(root, cache_dir=cache)
    write_image(root / "test" / "cow" / "0.png", np.zeros((9, 8, 3), np.uint8), "PNG")
    with pytest.raises(ValueError, match=r"test/cow/0\.png is 8x9 \(WxH\).*8x8"):
        data.load_image_folder(root, cache_dir=cache)
    os.remove(root / "test" / "cow" / "0.png")
    (root / "test" / "cow" / "notes.txt").write_text("not an image")
    with pytest.raises(ValueError, match=r"test/cow holds no \.jpg/\.jpeg/\.png files"):
        data.load_image_folder(root, cache_dir=cache)
    # Nothing half-written was left in the cache by the failed loads.
    assert not (cache / "imagefolder").exists() or not any((cache / "imagefolder").iterdir())


# ----------------------------------------------------------------------------
# TensorFlow Datasets (without TensorFlow, never touching the network)


@pytest.mark.parametrize(
    "name, shape, num_classes, augment",
    [
        ("cifar10", (32, 32, 3), 10, True),
        ("cifar100", (32, 32, 3), 100, True),
        ("fashion_mnist", (28, 28, 1), 10, False),
        ("emnist", (28, 28, 1), 47, False),
        ("mnist", (28, 28, 1), 10, False),
    ],
)
def test_load_tfds_with_mock_data(name, shape, num_classes, augment, no_network, tmp_path):
    tfds = pytest.importorskip("tensorflow_datasets")
    with tfds.testing.mock_data(num_examples=6):  # mocks reading: is_prepared() stays False, so no build
        ds = data.load_tfds(name, data_dir=tmp_path, download=False, progress=False)
    assert ds.name == name and ds.augment == augment
    assert ds.x_train.shape == (6, *shape) and ds.x_test.shape == (6, *shape)
    assert ds.x_train.dtype == np.uint8 and ds.y_train.dtype == np.int32
    assert ds.num_classes == num_classes and len(ds.class_names) == num_classes
    assert len(ds.mean) == shape[-1]


def test_load_tfds_reads_real_array_record_files(tmp_path, no_network):
    """Prepares a tiny fake 'cifar10' in array_record format (no TF needed) and reads it back."""
    tfds = pytest.importorskip("tensorflow_datasets")
    rng = np.random.default_rng(0)
    examples = {
        split: [(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8), int(rng.integers(10))) for _ in range(n)]
        for split, n in (("train", 12), ("test", 5))
    }

    def png(array):  # Encoding ourselves: tfds's own image encoder needs TensorFlow.
        buf = io.BytesIO()
        Image.fromarray(array).save(buf, format="PNG")
        buf.seek(0)
        return buf

    base = tfds.builder_cls("cifar10")  # outside skip_registration, which would also block its lazy import
    with tfds.core.registered.skip_registration():

        class FakeCifar10(base):
            name = "cifar10"

            def _split_generators(self, dl_manager):
                return {split: self._fake(split) for split in examples}

            def _fake(self, split):
                for i, (img, label) in enumerate(examples[split]):
                    yield f"{split}{i}", {"id": f"{split}{i}", "image": png(img), "label": label}

    FakeCifar10(data_dir=tmp_path, file_format="array_record").download_and_prepare()
    ds = data.load_tfds("cifar10", data_dir=tmp_path, progress=False)
    for split in ("train", "test"):
        x, y = getattr(ds, f"x_{split}"), getattr(ds, f"y_{split}")
        # tfds shuffles records on write, so compare as multisets.
        got = sorted((int(label), img.tobytes()) for img, label in zip(x, y))
        want = sorted((label, img.tobytes()) for img, label in examples[split])
        assert got == want
    assert ds.augment and ds.num_classes == 10
    # The same data recorded as tfrecord-only cannot be read without TF: a clear error, not a download.
    info = tmp_path / "cifar10" / "3.0.2" / "dataset_info.json"
    info.write_text(info.read_text().replace('"fileFormat": "array_record"', '"fileFormat": "tfrecord"'))
    with pytest.raises(RuntimeError, match=r"array_record format, found .*tfds build cifar10 --file_format=array_record"):
        data.load_tfds("cifar10", data_dir=tmp_path, progress=False)


def test_load_tfds_unprepared_and_unknown(tmp_path, no_network):
    pytest.importorskip("tensorflow_datasets")
    with pytest.raises(FileNotFoundError, match=r"not prepared.*tfds build fashion_mnist --file_format=array_record"):
        data.load_tfds("fashion_mnist", data_dir=tmp_path / "empty", download=False)
    with pytest.raises(ValueError, match=r"unknown tfds data set 'svhn'.*cifar10"):
        data.load_tfds("svhn")


# ----------------------------------------------------------------------------
# Augmentation


def crop_candidates(image, pad):
    """All pad-crops of `image` and their mirrors, as numpy arrays."""
    h, w, _ = image.shape
    padded = np.pad(image, ((pad, pad), (pad, pad), (0, 0)))
    out = []
    for dy in range(2 * pad + 1):
        for dx in range(2 * pad + 1):
            crop = padded[dy : dy + h, dx : dx + w]
            out += [((dy, dx, False), crop), ((dy, dx, True), crop[:, ::-1])]
    return out


def test_random_crop_flip_pad0_is_identity_or_mirror():
    image = np.arange(4 * 5 * 2, dtype=np.float32).reshape(4, 5, 2) + 1
    batch = jnp.asarray(np.repeat(image[None], 64, axis=0))
    out = np.asarray(data.random_crop_flip(jax.random.PRNGKey(0), batch, pad=0))
    assert out.shape == batch.shape and out.dtype == np.float32
    flipped = np.array([np.array_equal(o, image[:, ::-1]) for o in out])
    same = np.array([np.array_equal(o, image) for o in out])
    assert np.all(flipped ^ same)
    assert 16 < flipped.sum() < 48


def test_random_crop_flip_crops_of_padded_image():
    pad = 2
    image = np.arange(6 * 6 * 3, dtype=np.float32).reshape(6, 6, 3) + 1  # unique, non-zero pixels
    batch = jnp.asarray(np.repeat(image[None], 400, axis=0))
    out = np.asarray(data.random_crop_flip(jax.random.PRNGKey(1), batch, pad=pad))
    candidates = crop_candidates(image, pad)
    seen = set()
    for o in out:
        matches = [tag for tag, cand in candidates if np.array_equal(o, cand)]
        assert len(matches) == 1
        seen.add(matches[0])
    # Independent per example: most of the 5 * 5 * 2 = 50 variants show up.
    assert len(seen) > 40
    assert len({t[:2] for t in seen}) == 25


def test_random_crop_flip_jit_and_vmap():
    images = jax.random.uniform(jax.random.PRNGKey(2), (3, 8, 8, 3))
    key = jax.random.PRNGKey(3)
    eager = data.random_crop_flip(key, images)
    jitted = jax.jit(data.random_crop_flip, static_argnames="pad")(key, images)
    np.testing.assert_array_equal(np.asarray(eager), np.asarray(jitted))
    keys = jax.random.split(key, 4)
    clients = jnp.stack([images] * 4)
    stacked = jax.jit(jax.vmap(data.random_crop_flip))(keys, clients)
    assert stacked.shape == (4, 3, 8, 8, 3)
    np.testing.assert_allclose(np.asarray(stacked[2]), np.asarray(data.random_crop_flip(keys[2], images)))
