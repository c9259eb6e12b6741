"""spafl_cnn's local training beside the same network in PyTorch, on this machine, in one run.

    python -m benchmarks.pytorch_side_by_side [--quick] [--out DIR] [--torch-python PATH] [--spafl-code DIR]

Issue 19 set this library's training against the official SpaFL code (PyTorch,
2 threads: 3.4 ms per example-pass), measured in another session. This
benchmark re-takes that comparison side by side: the library's client update
(`benchmarks.local_training`: FedAvg and SpaFL, 512 examples, batch 64, SGD
with momentum 0.9, lr 0.001, random crop and flip) against a PyTorch client of
the same network (SpaFL's conv4: four 5x5 convolutions 64-64-128-128 without
bias, BatchNorm and ReLU, 2x2 max pooling after the second and the fourth, then
128-128-10 dense layers with BatchNorm; the same optimizer, batch, crop and
flip, `torch.set_num_threads(2)`), the two alternating, `--repeats` times
each. The PyTorch client is plain SGD on tensors already in memory: it leaves
out the official code's threshold masks and its data loader. With
`--spafl-code DIR` (a checkout of github.com/news-vt/SpaFL_NeruIPS_2024, which
also needs einops and numpy in the torch Python) the official code's own
`Client.local_training` is timed as well, over tensors in memory (its
torchvision augmentation left out): a lower bound on the reference's time.

PyTorch is not a dependency of the library: the PyTorch side runs in a
subprocess of `--torch-python` (default: this interpreter), which must import
torch. Writes `pytorch_side_by_side_<device>_<date>.{md,json}` in --out.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Sequence


from .common import (command_line, environment, environment_markdown, finish, fmt, interleaved,
                     markdown_table)
from .common import parser as benchmark_parser
from .local_training import REFERENCE_MS, Setting, client_update_fn
from fedjax_sparse.core.round.compilation import jit

TORCH_CLIENT = r"""
import json, sys, time
import torch
from torch import nn

examples, batch, repeats = map(int, sys.argv[1:4])
torch.set_num_threads(2)
torch.manual_seed(0)

def block(cin, cout, pool):
    layers = [nn.Conv2d(cin, cout, 5, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
    return layers + [nn.MaxPool2d(2)] if pool else layers

model = nn.Sequential(*block(3, 64, False), *block(64, 64, True), *block(64, 128, False), *block(128, 128, True),
                      nn.Flatten(), nn.Linear(512, 128, bias=False), nn.BatchNorm1d(128), nn.ReLU(),
                      nn.Linear(128, 128, bias=False), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 10, bias=False))
optimizer = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9)
x = torch.randint(0, 256, (examples, 3, 32, 32), dtype=torch.uint8)
y = torch.randint(0, 10, (examples,))
loss_fn = nn.CrossEntropyLoss()

def crop_flip(images):
    padded = nn.functional.pad(images, (4, 4, 4, 4))
    i, j = torch.randint(0, 9, (2,)).tolist()
    out = padded[:, :, i:i + 32, j:j + 32]
    return torch.where(torch.rand(len(out), 1, 1, 1) < 0.5, out.flip(3), out)

def epoch():
    model.train()
    order = torch.randperm(examples)
    for start in range(0, examples, batch):
        idx = order[start:start + batch]
        images = (crop_flip(x[idx].float() / 255.0) - 0.5) / 0.25
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(images), y[idx])
        loss.backward()
        optimizer.step()
    return loss.item()
"""

# Appended to each client script: a warm-up epoch, then `repeats` timed ones.
TIMED_EPOCHS = r"""
epoch()
wall, cpu = [], []
for _ in range(repeats):
    w, c = time.perf_counter(), time.process_time()
    epoch()
    wall.append(time.perf_counter() - w); cpu.append(time.process_time() - c)
print("RESULT " + json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(),
                              "wall": wall, "cpu": cpu}))
"""


def check_torch(python: str) -> str:
    """The version of torch that `python` imports; one line naming the flag if it cannot."""
    try:
        done = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                              text=True, timeout=120)
    except OSError as error:
        raise SystemExit(f"--torch-python {python}: cannot run it ({error}); give a Python that imports torch")
    if done.returncode != 0:
        raise SystemExit(f"--torch-python {python}: it cannot import torch; give a Python that can "
                         f"(e.g. a virtual environment with `pip install torch`)")
    return done.stdout.strip()


OFFICIAL_CLIENT = r"""
import json, sys, time, types
from pathlib import Path
root = Path(sys.argv[4]) / "main" / "cifar10"
sys.path[:0] = [str(root / "model"), str(root), str(root / "client")]
import torch
from torch.utils.data import DataLoader, TensorDataset
import binarization, net
sys.modules["model"] = types.SimpleNamespace(binarization=binarization)  # Client_Class imports `model.binarization`
from Client_Class import Client

examples, batch, repeats = map(int, sys.argv[1:4])
torch.set_num_threads(2)
torch.manual_seed(0)
# Its CIFAR-10 settings (train_argument.py defaults) with issue 19's learning rate; one local epoch a call.
args = types.SimpleNamespace(learning_rate=0.001, lr_decay=1.0, momentum=0.9, weight_decay=0.0, local_epoch=1,
                             th_coeff=0.002, clip=1)
x = torch.randn(examples, 3, 32, 32)
y = torch.randint(0, 10, (examples,))
loader = DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True)
client = Client(args, net.masked_Conv4(), torch.nn.CrossEntropyLoss(), 0, loader, loader, torch.device("cpu"))

def epoch():
    client.local_training(0)
"""


def torch_client(python: str, setting: Setting, repeats: int, code: str = TORCH_CLIENT, *extra: str) -> dict:
    done = subprocess.run([python, "-c", code + TIMED_EPOCHS, str(setting.examples), str(setting.batch_size), str(repeats), *extra],
                          capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"--torch-python {python}: the PyTorch client failed:\n{done.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def library_client(algorithm: str, setting: Setting) -> Callable[[], Any]:
    """One call of the library's client update, compiled as the library compiles it."""
    update, args, _, _ = client_update_fn("spafl_cnn", algorithm, setting)
    fn = jit(update)
    return lambda: fn(*args)


def main(argv: Sequence[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = benchmark_parser("benchmarks.pytorch_side_by_side", __doc__, "64 examples, one alternation")
    parser.add_argument("--torch-python", default=sys.executable, help="a Python that imports torch")
    parser.add_argument("--repeats", type=int, default=3, help="alternations of the library and PyTorch")
    parser.add_argument("--spafl-code", default=None,
                        help="a checkout of the official SpaFL code (github.com/news-vt/SpaFL_NeruIPS_2024): "
                             "its client's local training is timed too")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be at least 1, got {args.repeats}")
    official = Path(args.spafl_code) if args.spafl_code else None
    if official is not None and not (official / "main" / "cifar10" / "client" / "Client_Class.py").is_file():
        raise SystemExit(f"--spafl-code {official}: no main/cifar10/client/Client_Class.py there; give a checkout "
                         f"of github.com/news-vt/SpaFL_NeruIPS_2024")
    check_torch(args.torch_python)
    env = environment(command_line("benchmarks.pytorch_side_by_side", argv))
    setting = Setting(examples=64, repeats=1, profile=False) if args.quick else Setting(profile=False)
    repeats = 1 if args.quick else args.repeats
    clients = {f"library {name}": library_client(name, setting) for name in ("fedavg", "spafl")}
    others = {"pytorch sgd": (TORCH_CLIENT,)}
    if official is not None:
        others["official spafl code"] = (OFFICIAL_CLIENT, str(official.resolve()))
    times = {name: {"wall": [], "cpu": []} for name in (*clients, *others)}
    torch_info = {}
    for _ in range(repeats):
        print("alternation ...", file=sys.stderr, flush=True)
        for name, measured in interleaved(clients, 3).items():
            for k, v in measured.items():
                times[name][k].append(min(v))
        for name, (code, *extra) in others.items():
            torch_info = torch_client(args.torch_python, setting, 3, code, *extra)
            for k in ("wall", "cpu"):
                times[name][k].append(min(torch_info[k]))
    ms = {name: {k: 1e3 * min(v) / setting.examples for k, v in t.items()} for name, t in times.items()}
    record = {"examples": setting.examples, "batch_size": setting.batch_size, "torch": torch_info.get("torch"),
              "torch_threads": torch_info.get("threads"), "times": times, "ms_per_example": ms,
              "issue_reference_ms": REFERENCE_MS["spafl_cnn"], "spafl_code": args.spafl_code,
              "speed_over_pytorch": {name: ms["pytorch sgd"]["wall"] / m["wall"] for name, m in ms.items()}}

    def text(env: dict) -> str:
        rows = [[name, fmt(m["wall"]), fmt(m["cpu"]), f"{record['speed_over_pytorch'][name]:.2f}x"]
                for name, m in ms.items()]
        return "\n".join([
            "# spafl_cnn's local training beside the same network in PyTorch", "", environment_markdown(env),
            f"- PyTorch {record['torch']}, {record['torch_threads']} threads (`--torch-python {args.torch_python}`)",
            "", f"One client, {setting.examples} examples, batch {setting.batch_size}; milliseconds per "
            f"example-pass, the fastest of {repeats} alternations (each the fastest of 3 epochs).", "",
            markdown_table(["client", "ms per example-pass (wall)", "CPU-ms", "speed over PyTorch (wall)"], rows),
            "", "The official SpaFL code's row (with `--spafl-code`) times its own `Client.local_training` "
            "(conv4 with its threshold masks, threshold penalty and gradient clipping; lr 0.001, momentum 0.9) "
            "over tensors already in memory: without its torchvision augmentation pipeline, a lower bound on "
            "its time.", "", f"Issue 19's reference, the official SpaFL code measured in another session: "
            f"{record['issue_reference_ms']} ms per example-pass.", ""])

    finish(args.out, "pytorch_side_by_side", env, record, text)
    return record


if __name__ == "__main__":
    main()
