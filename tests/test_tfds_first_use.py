"""A TFDS data set is prepared on its first use (TFDS's own download and build) and read afterwards;
missing build requirements or a missing network give one line naming them and the ways on.

No test here touches the network (`no_network` fails any attempt, name resolution included). The
builds run TFDS's real `download_and_prepare` on a stand-in for the cifar10 builder whose examples
are made in memory (the real builder's download needs the network and its build TensorFlow).
"""

from __future__ import annotations

import errno
import io
import socket
import sys
import urllib.request

import numpy as np
import pytest
from PIL import Image

from fedjax_sparse import data
from fedjax_sparse.data import tfds_build

tfds = pytest.importorskip("tensorflow_datasets")

RNG = np.random.default_rng(0)
EXAMPLES = {split: [(RNG.integers(0, 256, (32, 32, 3), dtype=np.uint8), int(RNG.integers(10))) for _ in range(n)]
            for split, n in (("train", 10), ("test", 4))}


def _png(array):  # encoded here: TFDS's own image encoder needs TensorFlow
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def stand_in_cifar10(*, download_url: str | None = None, checksummed_url: str | None = None):
    """A cifar10 builder class whose `_split_generators` counts its calls (one per build) and yields
    EXAMPLES, after downloading `download_url` through TFDS's download manager if given.
    `checksummed_url`: the URL its checksum list names (what the reachability check reads)."""
    base = tfds.builder_cls("cifar10")  # outside skip_registration, which would also block its lazy import
    with tfds.core.registered.skip_registration():

        class StandIn(base):
            name = "cifar10"
            builds = []
            url_infos = {checksummed_url: None} if checksummed_url else None

            def _split_generators(self, dl_manager):
                type(self).builds.append(self.data_dir)
                if download_url:
                    dl_manager.download(download_url)
                return {split: self._examples(split) for split in EXAMPLES}

            def _examples(self, split):
                for i, (image, label) in enumerate(EXAMPLES[split]):
                    yield f"{split}{i}", {"id": f"{split}{i}", "image": _png(image), "label": label}

    return StandIn


@pytest.fixture
def use_builder(monkeypatch):
    """Makes `tfds.builder` return the given builder class for cifar10, and the build requirements
    present (the stand-in needs no TensorFlow)."""

    def use(cls):
        real = tfds.builder
        monkeypatch.setattr(tfds, "builder", lambda name, data_dir=None, try_gcs=False, **kw:
                            cls(data_dir=data_dir) if name == "cifar10" else real(name, data_dir=data_dir, **kw))
        monkeypatch.setattr(tfds_build, "missing_modules", lambda names=tfds_build.BUILD_MODULES: [])
        monkeypatch.setattr(urllib.request, "getproxies", lambda: {})
        return cls

    return use


def assert_examples(ds):
    for split in ("train", "test"):
        x, y = getattr(ds, f"x_{split}"), getattr(ds, f"y_{split}")
        got = sorted((int(label), image.tobytes()) for image, label in zip(x, y))  # TFDS shuffles on write
        assert got == sorted((label, image.tobytes()) for image, label in EXAMPLES[split])


def test_first_use_builds_with_tfds_in_array_record_and_later_uses_only_read(tmp_path, no_network, use_builder,
                                                                            capsys):
    builder = use_builder(stand_in_cifar10())
    tfds.display_progress_bar(True)
    ds = data.load_dataset("cifar10", data_dir=tmp_path, progress=True)
    assert len(builder.builds) == 1
    assert "Generating splits" in capsys.readouterr().err  # TFDS's own progress is shown
    assert_examples(ds)
    assert ds.augment and ds.num_classes == 10
    assert sorted(p.name for p in (tmp_path / "cifar10" / "3.0.2").glob("*.array_record*"))
    again = data.load_dataset("cifar10", data_dir=tmp_path, progress=False)
    assert len(builder.builds) == 1  # read, not rebuilt
    assert_examples(again)
    # --no-download reads prepared data as before
    assert_examples(data.load_dataset("cifar10", data_dir=tmp_path, download=False, progress=False))
    assert len(builder.builds) == 1


def test_no_download_never_builds(tmp_path, no_network, use_builder):
    builder = use_builder(stand_in_cifar10())
    with pytest.raises(data.DataError, match=r"not prepared under .*--no-download"):
        data.load_dataset("cifar10", data_dir=tmp_path, download=False)
    assert builder.builds == []


def one_line(err) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


def test_offline_first_use_says_so_at_once_with_the_two_ways_on(tmp_path, no_network, use_builder, monkeypatch):
    builder = use_builder(stand_in_cifar10(download_url="https://data.example/cifar-10.tar.gz",
                                           checksummed_url="https://data.example/cifar-10.tar.gz"))

    def offline(*args, **kwargs):
        raise OSError(errno.ENETUNREACH, "Network is unreachable")

    monkeypatch.setattr(socket, "create_connection", offline)
    with pytest.raises(data.DataError) as err:
        data.load_dataset("cifar10", data_dir=tmp_path, progress=False)
    message = one_line(err)
    assert "cifar10 is not prepared under" in message and "cannot reach data.example" in message
    assert "where there is a network" in message and f"as {tmp_path}" in message
    assert "imagefolder:PATH" in message
    assert builder.builds == []  # nothing was attempted
    assert not tfds.builder("cifar10", data_dir=tmp_path).is_prepared()


def test_a_download_attempt_fails_the_test_instead_of_passing_as_offline(tmp_path, no_network, use_builder):
    """The guard itself: a build that really downloads (no checksum list, so no reachability check)
    is stopped by `no_network` with its AssertionError, which the loader does not translate."""
    use_builder(stand_in_cifar10(download_url="https://data.example/cifar-10.tar.gz"))
    with pytest.raises(AssertionError, match="tried to open a network connection"):
        data.load_dataset("cifar10", data_dir=tmp_path, progress=False)


def test_first_use_without_the_extra_names_it_and_the_two_ways_on(tmp_path, no_network, monkeypatch):
    """TFDS's real cifar10 builder; TensorFlow made unimportable, as on the base install."""
    monkeypatch.setitem(sys.modules, "tensorflow", None)
    with pytest.raises(data.DataError) as err:
        data.load_dataset("cifar10", data_dir=tmp_path, progress=False)
    message = one_line(err)
    assert "cifar10 is not prepared under" in message and "needs tensorflow" in message
    assert 'pip install "fedjax-sparse[tfds]"' in message
    assert "where there is a network" in message and "imagefolder:PATH" in message
    assert tfds_build.missing_modules(("tensorflow", "numpy")) == ["tensorflow"]
