"""Clients shared by several CPU devices (core.round.cpu): which clients each device trains, which
devices a round takes, and the same figures as on one device."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedjax_sparse.core.evaluation.cpu import MIN_SLOTS_PER_DEVICE, evaluation_devices
from fedjax_sparse.core.round.cpu import MIN_CHUNKS_PER_DEVICE, client_shares, round_devices

JOB = Path(__file__).resolve().parent / "cpu_round_job.py"


def test_each_device_trains_whole_chunks_the_first_ones_one_more():
    assert client_shares(100, 4, 2) == [(0, 52), (52, 100)]  # 25 chunks: 13 + 12
    assert client_shares(10, 2, 3) == [(0, 4), (4, 8), (8, 10)]  # 5 chunks: 2 + 2 + 1
    assert client_shares(12, 3, 1) == [(0, 12)]
    with pytest.raises(ValueError, match="a chunk of 4 does not divide the 10 clients"):
        client_shares(10, 4, 2)
    with pytest.raises(ValueError, match="3 devices cannot share 2 chunks of 5 clients: give between 1 and 2"):
        client_shares(10, 5, 3)


def test_a_round_takes_several_devices_only_where_they_pay_unless_chosen():
    devices = ["cpu0", "cpu1"]
    assert round_devices(100, 4, devices) == devices  # 25 chunks: 12 and 13 per device
    assert round_devices(10, 2, devices) == ["cpu0"]  # 5 chunks: fewer than 4 per device
    assert round_devices(4 * MIN_CHUNKS_PER_DEVICE * 2, 4, devices) == devices
    assert round_devices(4 * MIN_CHUNKS_PER_DEVICE * 2 - 4, 4, devices) == ["cpu0"]
    assert round_devices(100, 1, devices) == ["cpu0"]  # a large model's client: XLA spreads its operations
    assert round_devices(100, None, devices) == ["cpu0"]  # one vmap: an accelerator's layout
    assert round_devices(10, 2, devices, chosen=True) == devices
    assert round_devices(4, 2, ["cpu0", "cpu1", "cpu2"], chosen=True) == ["cpu0", "cpu1"]  # a chunk each at most


def test_an_evaluation_takes_several_devices_only_where_they_pay_unless_chosen():
    devices = ["cpu0", "cpu1"]
    assert evaluation_devices(1000, 100, 1, devices) == devices  # 50,000 padded examples each
    assert evaluation_devices(200, 4, 1, devices) == ["cpu0"]  # the digits: 400 each
    assert evaluation_devices(2 * MIN_SLOTS_PER_DEVICE // 100, 100, 1, devices) == devices
    assert evaluation_devices(2 * MIN_SLOTS_PER_DEVICE // 100 - 1, 100, 1, devices) == ["cpu0"]
    assert evaluation_devices(1000, 100, 4, devices) == ["cpu0"]  # groups of clients: the share would change them
    assert evaluation_devices(1000, 100, None, devices) == ["cpu0"]
    assert evaluation_devices(4, 1, 1, devices, chosen=True) == devices
    assert evaluation_devices(3, 1, 1, devices, chosen=True) == ["cpu0"]  # two clients a device at least


def test_rounds_and_evaluations_shared_by_three_cpu_devices_equal_one_device_bit_for_bit(tmp_path):
    """FedNova: 3 rounds of 12 clients in chunks of 3 on 3 devices (2 + 1 + 1 chunks) give the server
    state, client states and every output of one device's jit, and the personalized accuracies of 17
    clients scored on 3 devices (6 + 6 + 5) those of one; SCAFFOLD from the command line with
    --cpu-devices 3 (2 + 1 + 1 chunks of 4, 10 evaluated clients a device) writes the metrics of
    --cpu-devices 1 and says it used 3 for both."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(JOB.parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(JOB), str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"devices": 3, "fednova": True, "fednova evaluation": True, "cli cpu_devices 1": [None, None],
                      "cli cpu_devices 3": [3, 3], "cli metrics": True}
