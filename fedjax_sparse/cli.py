"""`fedjax-sparse run ...`: one federated experiment from the command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from fedjax_sparse.algorithms import ALGORITHM_NAMES
from fedjax_sparse.models import MODEL_NAMES



_UNSET = object()


def _run_parser(sub, suppress_defaults: bool = False) -> argparse.ArgumentParser:
    from fedjax_sparse.runner import RunConfig
    d = RunConfig()
    p = sub.add_parser("run", help="run one federated experiment",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--algorithm", choices=ALGORITHM_NAMES, default=d.algorithm)
    p.add_argument("--dataset", default=d.dataset,
                   help="digits, cifar10, cifar100, fashion_mnist, emnist or imagefolder:PATH")
    p.add_argument("--model", choices=MODEL_NAMES, default=d.model)
    p.add_argument("--num-clients", type=int, default=d.num_clients)
    p.add_argument("--clients-per-round", type=int, default=d.clients_per_round)
    p.add_argument("--rounds", type=int, default=d.rounds)
    p.add_argument("--local-epochs", type=int, default=d.local_epochs)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--momentum", type=float, default=d.momentum)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--partition", choices=("iid", "dirichlet", "labels"), default=d.partition)
    p.add_argument("--alpha", type=float, default=d.alpha, help="Dirichlet concentration")
    p.add_argument("--labels-per-client", type=int, default=d.labels_per_client)
    p.add_argument("--min-examples", type=int, default=d.min_examples,
                   help="fewest training examples a client may hold")
    p.add_argument("--local-test-ratio", type=float, default=d.local_test_ratio,
                   help="size of each client's test split relative to its training data")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--mu", type=float, default=d.mu, help="FedProx proximal coefficient")
    p.add_argument("--server-lr", type=float, default=d.server_lr, help="SCAFFOLD server learning rate")
    p.add_argument("--sparsity-coef", type=float, default=d.sparsity_coef,
                   help="SpaFL: alpha, the weight of sum(exp(-threshold)) in the loss")
    p.add_argument("--no-weight-bounds", dest="weight_bounds", action="store_false",
                   help="SpaFL: do not clip weights to [-1, 1] and thresholds to [0, 1] after each step")
    p.add_argument("--no-threshold-update", dest="threshold_update", action="store_false",
                   help="SpaFL: skip the weight update from the change of the global thresholds (eq. 13)")
    p.add_argument("--clients-per-layer", type=int, default=d.clients_per_layer,
                   help="FedLDF: n, the clients that upload each layer")
    p.add_argument("--shard-clients", action="store_true",
                   help="shard the sampled clients over all local devices")
    p.add_argument("--client-chunk", type=int, default=d.client_chunk,
                   help="train the sampled clients this many at a time (0: all at once, one vmap); "
                        "default: all at once on an accelerator, a cache-sized chunk on a CPU")
    p.add_argument("--max-train-examples", type=int, default=d.max_train_examples,
                   help="use a random subset of this many training examples (quick runs)")
    p.add_argument("--max-test-examples", type=int, default=d.max_test_examples,
                   help="use a random subset of this many test examples (quick runs)")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every,
                   help="save the whole run state every R rounds (and at the end and on Ctrl-C)")
    p.add_argument("--resume", metavar="DIR", default=None,
                   help="continue the run in DIR from its latest checkpoint; its config.json is the "
                        "default for every flag, and flags that would change the results are refused")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--out", default=d.out, help="directory for config, metrics, summary and plot")
    if suppress_defaults:  # to learn which flags were given explicitly
        p.set_defaults(**{action.dest: _UNSET for action in p._actions})
    return p


def _parser(suppress_defaults: bool = False) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedjax-sparse",
                                     description="Communication-efficient, sparse federated learning in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    _run_parser(sub, suppress_defaults)
    return parser


def _config(args: argparse.Namespace, argv: list[str] | None):
    """The run's config: the flags, or for --resume the saved config updated with the flags given."""
    from fedjax_sparse.runner import RunConfig
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    if args.resume is None:
        return RunConfig(**{k: v for k, v in vars(args).items() if k in fields})
    saved_path = Path(args.resume) / "config.json"
    if not saved_path.exists():
        raise FileNotFoundError(f"--resume {args.resume}: no config.json there (is it a run directory?)")
    saved = json.loads(saved_path.read_text())
    given = {k: v for k, v in vars(_parser(suppress_defaults=True).parse_args(argv)).items()
             if v is not _UNSET}
    merged = {**{k: v for k, v in saved.items() if k in fields},
              **{k: v for k, v in given.items() if k in fields}, "out": args.resume}
    return RunConfig(**merged)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    from fedjax_sparse.runner import DivergenceError, Interrupted, run_experiment
    try:
        config = _config(args, argv)
        summary = run_experiment(config, progress=not args.no_progress, resume=args.resume is not None)
    except (ValueError, FileNotFoundError, DivergenceError) as e:
        print(f"fedjax-sparse: error: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:
        print(f"fedjax-sparse: {e}", file=sys.stderr)
        return 130
    acc = summary["final_test_accuracy"]
    print(f"done: test accuracy {acc if acc is None else round(acc, 4)}, personalized accuracy "
          f"{summary['final_personalized_accuracy']:.4f}, {summary['cumulative_bytes']:,} bytes "
          f"in {summary['wall_seconds']:.1f} s; results in {config.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
