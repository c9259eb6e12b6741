"""A run's configuration: the options every algorithm shares, and the chosen algorithm's own."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from fedjax_sparse.algorithms import (ENTRY_POINT_GROUP, UnknownAlgorithm, flags_of, get_spec, make_options,
                                     option_users, options_dict, refused, registered, reserve)
from fedjax_sparse.privacy.mechanism import DifferentialPrivacyOptions
from fedjax_sparse.algorithms.personalization import PersonalizationOptions
from fedjax_sparse.algorithms.uplink_compression import UplinkCompressionOptions
from fedjax_sparse.core.client_state.choice import BACKENDS
from fedjax_sparse.core.round.device_split import SPLITS
from fedjax_sparse.core.round.numerics import MATMUL_PRECISIONS, PRECISION_ALIASES, Numerics
from fedjax_sparse.core.contract.options import (check_value, coerce, option, option_fields, refuse_unread_values, spec_of,
                                        validate)
from fedjax_sparse.data.partition import METHODS, NATURAL
from fedjax_sparse.data.sources import has_own_clients
from fedjax_sparse.models import MODEL_ALIASES, MODEL_NAMES, REFUSED, model_names
from fedjax_sparse.models.structure import COMPUTE_DTYPES
from fedjax_sparse.run.client_metrics import check_stats
from fedjax_sparse.run.federation import FederationOptions
from fedjax_sparse.run.tracker_options import TrackerOptions, check_trackers


@dataclasses.dataclass(frozen=True)
class RunConfig(TrackerOptions, FederationOptions, DifferentialPrivacyOptions, UplinkCompressionOptions,
                PersonalizationOptions):
    """A run: the options every algorithm shares, and the chosen algorithm's own options.

    Two patterns apply to any algorithm they fit, from the run's options: uplink compression
    (`algorithms.uplink_compression`) and personal layers (`algorithms.personalization`). The
    federation's options (sampler, devices, stragglers) are `run.federation.FederationOptions`, the
    trackers' (`--logger`) `run.tracker_options.TrackerOptions`.

    The shared options are the fields below; each algorithm declares its own
    beside its math (e.g. `algorithms.fedprox.FedProxOptions`). `options` holds
    algorithm option values by name; `algorithm_options` turns them into the
    chosen algorithm's dataclass (defaults for the rest). Build configs with
    `RunConfig.create(**flat)` / `config.replace(**flat)`, which route every
    name to its place; `to_dict()` is the flat saved form.
    """

    # the command line's help groups of the run's own options (`core.contract.options.option_group`); the
    # patterns' and the federation's are their classes'
    OPTION_GROUPS = {
        **dict.fromkeys(("algorithm", "dataset", "data_dir", "download", "model", "num_clients", "clients_per_round",
                         "rounds", "local_epochs", "batch_size", "lr", "lr_decay", "momentum", "weight_decay",
                         "grad_clip_norm", "partition", "alpha", "labels_per_client", "min_examples",
                         "local_test_ratio", "seed", "eval_every", "max_train_examples", "max_test_examples"), "data"),
        **dict.fromkeys(("out", "checkpoint_every", "checkpoint_minutes", "tensorboard", "client_metric_stats",
                         "compilation_cache"), "output"),
        **dict.fromkeys(("client_store", "shard_clients", "client_chunk", "cpu_devices", "device_split",
                         "matmul_precision", "compute_dtype", "deterministic"), "scale"),
    }

    algorithm: str = option("fedavg", "the federated algorithm: a registered one (the library's, a script's, an "
                                      "installed package's)")
    dataset: str = option("digits", "digits, cifar10, cifar100, fashion_mnist, emnist, mnist (TFDS: prepared on "
                                    "first use), imagefolder:PATH, femnist, shakespeare (Flower's Hugging Face "
                                    "copies: prepared on first use), leaf:PATH (LEAF's JSON), synthetic:ALPHA,BETA "
                                    "(FedProx's, generated per client) or mmap:FOLDER (a data set converted to files "
                                    "read a round at a time: fedjax-sparse convert)")
    data_dir: str | None = option(None, "TFDS data directory (default: TFDS's own, $TFDS_DATA_DIR or "
                                        "~/tensorflow_datasets); femnist and shakespeare are prepared under "
                                        "DIR/leaf (default: ~/.cache/fedjax_sparse/leaf)")
    download: bool = option(True, "prepare a TFDS, femnist or shakespeare data set (download and build) on its "
                                  "first use; --no-download only reads prepared data")
    model: str = option("mlp", f"the model: {', '.join(MODEL_NAMES)} (and {', '.join(MODEL_ALIASES)}), or one "
                               f"registered from outside (register_model, entry point group fedjax_sparse.models)")
    num_clients: int = option(20, "clients in the federation", low=1)
    clients_per_round: int = option(10, "clients sampled each round", low=1)
    rounds: int = option(30, "communication rounds", low=1)
    local_epochs: int = option(5, "local epochs per round", low=1)
    batch_size: int = option(16, "local batch size", low=1)
    lr: float = option(0.1, "local learning rate", low=0.0, low_open=True)
    lr_decay: float = option(1.0, "multiply the local learning rate by this every round", low=0.0, low_open=True,
                             high=1.0)
    momentum: float = option(0.0, "local SGD momentum", low=0.0, high=1.0, high_open=True)
    weight_decay: float = option(0.0, "local weight decay", low=0.0)
    grad_clip_norm: float | None = option(None, "clip each local step's gradients to this global L2 norm first, "
                                                "as PyTorch's clip_grad_norm_ in the authors' code of HeteroFL and "
                                                "FedRolex (1), FedP3 (10) (default: none)", low=0.0, low_open=True)
    partition: str | None = option(None, "how data is split over clients: natural (the data set's own clients: "
                                         "writers, roles, generated clients) or a split of pooled data (default: "
                                         "natural where the data set has its own clients, else dirichlet)",
                                   choices=(*METHODS, NATURAL))
    alpha: float | None = option(0.5, "Dirichlet concentration", low=0.0, low_open=True)
    labels_per_client: int | None = option(None, "labels each client holds (labels partition)", low=1)
    min_examples: int = option(2, "fewest training examples a client may hold (natural: a client with fewer "
                                  "takes no part)", low=1)
    local_test_ratio: float = option(0.2, "size of each client's test split relative to its training data",
                                     low=0.0, low_open=True, high=1.0)
    seed: int = option(0, "seed of every random stream of the run", low=0, high=2 ** 32 - 1)
    eval_every: int = option(1, "evaluate every this many rounds", low=1)
    client_store: str = option("auto", "where the clients' states and data live: device (all on the device, the "
                                       "fastest), host (host memory), disk (files in the run folder) or auto "
                                       "(device when they fit in half the device's memory, else host when they "
                                       "fit in half the host's, else disk; says what it chose)",
                               choices=(*BACKENDS, "auto"))
    shard_clients: bool = option(False, "shard the sampled clients over all local devices")
    client_chunk: int | None = option(None, "train the sampled clients this many at a time (0: all at once, one "
                                            "vmap); default: all at once on an accelerator, a cache-sized chunk "
                                            "on a CPU", low=0)
    cpu_devices: int | None = option(None, "on a CPU, train the sampled clients and evaluate every client on this "
                                           "many JAX CPU devices at once, one per core (default: as many as pay, up "
                                           "to one per usable core; 1: one device); the figures are the same for any "
                                           "number", low=1)
    device_split: str = option("balanced", "how a sharded round (--shard-clients, --cpu-devices, several processes) "
                                           "places the sampled clients on its devices: balanced (by local steps, "
                                           "fewer padded steps) or id (in the order drawn); the figures are the "
                                           "same either way, and one device is not affected", choices=SPLITS)
    max_train_examples: int | None = option(None, "use a random subset of this many training examples", low=1)
    max_test_examples: int | None = option(None, "use a random subset of this many test examples", low=1)
    checkpoint_every: int | None = option(None, "save the whole run state every R rounds and at the end (an "
                                                "interrupted run saves anyway)", low=1)
    checkpoint_minutes: float = option(5.0, "save the whole run state once M minutes of wall time have passed since "
                                            "its last save (or its start), at the end of the next round, and at the "
                                            "end, so that a killed run resumes (--resume); 0: only --checkpoint-every "
                                            "saves", low=0.0)
    tensorboard: bool = option(True, "also write every per-round figure as TensorBoard event files into the run "
                                     "folder (on by default; view with tensorboard --logdir runs)")
    matmul_precision: str = option("float32", "how float32 matrix products and convolutions are computed: float32 "
                                              "(XLA's HIGHEST: float32 on every backend), tensorfloat32 (HIGH: TF32 "
                                              "on Ampere and newer GPUs), bfloat16 (DEFAULT: one bfloat16 pass on a "
                                              "TPU, TF32 on a GPU) or default (JAX's own setting); highest and high "
                                              "name the first two; a CPU computes float32 for every one "
                                              "(docs/precision.md)",
                                   choices=(*MATMUL_PRECISIONS, *PRECISION_ALIASES))
    compute_dtype: str = option("float32", "the dtype the model's forward and backward passes compute in: float32, "
                                           "or bfloat16 (mixed precision: float32 master weights, optimizer states, "
                                           "BatchNorm statistics, loss, aggregation and server state; messages "
                                           "are priced as sent)", choices=COMPUTE_DTYPES)
    deterministic: bool = option(False, "on a GPU, compile with XLA's deterministic ops (the same figures every "
                                        "time, at some speed); a CPU and a TPU are deterministic already")
    client_metric_stats: tuple[str, ...] = option(("mean",), "what each round logs of a metric the clients report "
                                                           "(an agent's reward, a sub-model's capacity) over the "
                                                           "clients that trained, besides its mean: min, max, std, "
                                                           "pN (a percentile, 0 <= N <= 100), e.g. "
                                                           "mean,min,max,p10,p90")
    compilation_cache: bool = option(True, "keep compiled rounds in JAX's persistent cache "
                                           "($FEDJAX_SPARSE_CACHE or ~/.cache/fedjax_sparse/jax)")
    out: str = option("runs/default", "directory for config, metrics, summary and plot")
    options: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def create(cls, **values) -> "RunConfig":
        """A config from flat names: shared fields go to their fields, the rest to `options`."""
        return cls().replace(**values)

    def replace(self, **values) -> "RunConfig":
        shared = {f.name for f in dataclasses.fields(self)} - {"options"}
        users = option_users()
        unknown = sorted(k for k in values if k not in shared and k not in users and k != "options")
        if unknown:
            raise ValueError(f"unknown options {unknown}; run options are {sorted(shared)} and algorithm "
                             f"options are {sorted(users)}")
        options = {**self.options, **values.get("options", {}),
                   **{k: v for k, v in values.items() if k in users and k not in shared}}
        return dataclasses.replace(self, **{k: v for k, v in values.items() if k in shared}, options=options)

    @classmethod
    def from_dict(cls, values: dict) -> "RunConfig":
        """From a saved (flat) config, each value checked and typed as its flag would be (a ValueError
        names the key); options of algorithms other than its own are dropped, so configs saved before
        options moved beside their algorithms still load."""
        values = dict(values)
        values.pop("options", None)
        algorithm = values.get("algorithm", cls.algorithm)
        if not isinstance(algorithm, str):
            raise ValueError(f"--algorithm: {algorithm!r} is not a valid str")
        if algorithm not in registered():
            raise UnknownAlgorithm(refused().get(algorithm) or (  # an installed plug-in: why it was left out
                f"the run's algorithm {algorithm!r} is not registered here; install the package that provides it "
                f"(entry point group {ENTRY_POINT_GROUP}) or register it (fedjax_sparse.algorithms.register) "
                f"before resuming"))
        own = {f.name for f in dataclasses.fields(make_options(algorithm, {}))}
        users = option_users()
        return cls.create(**typed_values({k: v for k, v in values.items() if k not in users or k in own}))

    @property
    def algorithm_options(self) -> Any:
        return make_options(self.algorithm, self.options)

    def to_dict(self) -> dict:
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "options"}
        return {**shared, **options_dict(self.algorithm_options)}

    def validate(self) -> None:
        """Checks what can be checked before any data is loaded; one clear line per problem."""
        validate(self)
        get_spec(self.algorithm)  # one line listing the registered algorithms
        if self.model not in (*model_names(), *MODEL_ALIASES):
            raise ValueError(REFUSED.get(self.model) or f"--model {self.model!r} is not a model; valid: "
                                                        f"{', '.join(model_names())} (and {', '.join(MODEL_ALIASES)})")
        if not self.out.strip():
            raise ValueError("--out must name a folder for the run's files, got ''")
        self.refuse_unread_values()
        if self.clients_per_round > self.num_clients:
            raise ValueError(f"--clients-per-round {self.clients_per_round} exceeds --num-clients "
                             f"{self.num_clients}; valid: 1..{self.num_clients}")
        if self.split_by == "dirichlet" and self.alpha is None:
            raise ValueError("--alpha must be > 0 for the dirichlet partition, got None")
        if self.split_by == "labels" and self.labels_per_client is None:
            raise ValueError("--labels-per-client must be >= 1 for the labels partition, got None")
        if self.client_chunk is not None and self.client_chunk > self.clients_per_round:
            raise ValueError(f"--client-chunk must be in [0, {self.clients_per_round}] (0: all sampled "
                             f"clients at once), got {self.client_chunk}")
        if (self.round_deadline is not None or self.over_selection) and self.device_profile is None:
            given = "--round-deadline" if self.round_deadline is not None else "--over-selection"
            raise ValueError(f"{given} needs a clock: give --device-profile (phone, iot, edge or a profile file)")
        check_trackers(self)
        check_stats(self.client_metric_stats)
        if self.client_chunk and self.shard_clients:
            raise ValueError(f"--client-chunk {self.client_chunk} and --shard-clients do not combine: "
                             f"sharding splits the vmap of all sampled clients over the devices")

    def ignored(self) -> dict[str, str]:
        return {**UplinkCompressionOptions.ignored(self), **FederationOptions.ignored(self),
                **DifferentialPrivacyOptions.ignored(self), **TrackerOptions.ignored(self)}

    def refuse_unread_values(self) -> None:
        """One line for an option set away from its default that this run would ignore (an unread
        server-optimizer setting, a compression setting without compression): config.json would
        record a value that training never used. Validates the algorithm's own options too."""
        refuse_unread_values(self.algorithm_options)
        refuse_unread_values(self)

    @property
    def numerics(self) -> Numerics:
        """The run's matrix-product precision and determinism (`core.round.numerics`)."""
        return Numerics(self.matmul_precision, self.deterministic)

    @property
    def split_by(self) -> str:
        """The partition: `partition`, else natural where the data set has its own clients, else dirichlet."""
        return self.partition or (NATURAL if has_own_clients(self.dataset) else "dirichlet")


SHARED_OPTIONS = tuple(f.name for f in option_fields(RunConfig))
reserve(flags_of(RunConfig), "fedjax-sparse's run options (fedjax_sparse.run.config.RunConfig)")


def declared_options() -> dict[str, tuple[Any, Any]]:
    """Every option a run takes, shared or an algorithm's: name -> (OptionSpec, type annotation)."""
    out = {}
    for cls in (RunConfig, *(spec.options for spec in registered().values())):
        hints = typing.get_type_hints(cls)
        for field in option_fields(cls):
            out.setdefault(field.name, (spec_of(field), hints[field.name]))
    return out


def typed_values(values: dict) -> dict:
    """`values` (from a file: JSON, YAML or TOML types) as the options' types, each checked as its flag
    would be; a ValueError names the first bad one's flag. Unknown keys pass (`RunConfig.replace` refuses
    them)."""
    declared = declared_options()
    out = {}
    for key, value in values.items():
        if key not in declared:
            out[key] = value
            continue
        spec, annotation = declared[key]
        out[key] = coerce(key, annotation, value)
        check_value(key, spec, out[key])
    return out
