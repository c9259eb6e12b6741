"""Preparing a TFDS data set on its first use: TFDS's own download and build, in the array_record format.

Reading a prepared data set needs only tensorflow-datasets (and its array_record
dependency), which the base install has. Building one needs more, the `[tfds]`
extra (`pip install "fedjax-sparse[tfds]"`), found on a bare Python 3.11 with
tensorflow-datasets 4.9.10:
  * TensorFlow: the builders of cifar10/cifar100/mnist/fashion_mnist/emnist read
    their downloads with `tf.io.gfile` and TFDS encodes every image to PNG with
    `tf.image.encode_png` (the CPU build, tensorflow-cpu, is enough);
  * importlib_resources: TFDS imports it when it builds a registered data set
    but declares it only for Python < 3.9 (tensorflow/datasets#11212).
Before downloading, the hosts of the data set's URLs (TFDS's checksum list) are
tried with a short TCP connection, so an offline machine gets its answer in
seconds rather than after TFDS's retries (about 3.5 minutes).
"""

from __future__ import annotations

import importlib.util
import socket
import urllib.parse
import urllib.request
from pathlib import Path

BUILD_MODULES = ("tensorflow", "importlib_resources")
EXTRA = 'pip install "fedjax-sparse[tfds]"'


def missing_modules(names=BUILD_MODULES) -> list[str]:
    """The modules of `names` that cannot be imported here (found without importing them)."""
    missing = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # ValueError: the import is blocked (sys.modules[name] is None)
            found = False
        if not found:
            missing.append(name)
    return missing


def unreachable_hosts(urls, timeout: float = 10.0) -> list[str]:
    """The hosts of `urls` that a TCP connection does not reach within `timeout` seconds.

    None are tried when a proxy is configured for their scheme: the download goes
    through the proxy, which a direct connection says nothing about.
    """
    proxies = urllib.request.getproxies()
    unreachable = []
    for host, scheme, port in sorted({(u.hostname, u.scheme, u.port) for u in map(urllib.parse.urlsplit, urls)
                                      if u.hostname}):
        if scheme in proxies:
            continue
        try:
            socket.create_connection((host, port or (443 if scheme == "https" else 80)), timeout=timeout).close()
        except OSError:
            unreachable.append(host)
    return unreachable


def data_dir_root(builder, tfds_name: str) -> Path:
    """The data directory holding `builder`'s NAME[/CONFIG]/VERSION folder."""
    return Path(builder.data_dir).parents[tfds_name.count("/") + 1]


def ways_on(builder, tfds_name: str) -> str:
    """The two ways to get on without building here."""
    return (f"either prepare it where there is a network (a fedjax-sparse run of it with the [tfds] extra "
            f"installed, or `tfds build {tfds_name} --file_format=array_record`) and copy its data directory here "
            f"as {data_dir_root(builder, tfds_name)} (or point --data-dir at the copy), or use --dataset "
            f"imagefolder:PATH")


def prepare(builder, tfds_name: str, *, progress: bool = True) -> None:
    """Downloads and builds `builder`'s data set into its data directory (array_record files).

    Raises a one-line ImportError when the [tfds] extra is missing and a ConnectionError when
    the download cannot be made; a failed build leaves nothing half-written (TFDS builds in a
    temporary directory and renames it at the end).
    """
    import tensorflow_datasets as tfds

    where = f"{tfds_name} is not prepared under {builder.data_dir}"
    missing = missing_modules()
    if missing:
        raise ImportError(f"{where}, and preparing it needs {' and '.join(missing)} ({EXTRA}); "
                          + ways_on(builder, tfds_name))
    try:
        urls = list(type(builder).url_infos or ())
    except Exception:  # the builder has no checksum list: TFDS's own download will tell
        urls = []
    unreachable = unreachable_hosts(urls)
    if unreachable:
        raise ConnectionError(f"{where}, and this machine cannot reach {', '.join(unreachable)} to download it; "
                              + ways_on(builder, tfds_name))
    from tensorflow_datasets.core.utils import tqdm_utils

    shown = getattr(tqdm_utils, "_active", True)  # TFDS's switch for its bars has no public getter
    tfds.display_progress_bar(progress and shown)
    try:
        builder.download_and_prepare(file_format="array_record")
    except OSError as err:  # requests' connection errors are OSErrors
        if not _is_network_error(err):
            raise
        raise ConnectionError(f"{where}, and downloading it failed ({' '.join(str(err).split())[:200]}); "
                              + ways_on(builder, tfds_name)) from err
    finally:
        tfds.display_progress_bar(shown)


def _is_network_error(err: OSError) -> bool:
    module = type(err).__module__
    return module.startswith(("requests", "urllib3", "socket")) or isinstance(err, (ConnectionError, TimeoutError,
                                                                                    socket.gaierror))
