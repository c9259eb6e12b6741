"""Uplink compression for any algorithm whose upload is a model or a delta: top-k, random-k or QSGD, with
error feedback, as one wrapper around the algorithm's own functions.

What is compressed. Every float leaf of a client's upload of 2 entries or more, except BatchNorm
statistics (under a `batch_stats` key: not gradients, and a zeroed running variance would break the
model), which travel dense, as do integer and scalar leaves. A leaf the server sent at the same
path, shape and dtype (a model upload: FedAvg's, FedProx's, FedDyn's variables) is compressed as the
client's change of it, upload - broadcast, and rebuilt by the server as broadcast + the decompressed
change (it knows what it sent); any other leaf (SCAFFOLD's delta and control delta, FedNova's
normalized update) is already a delta and is compressed as it is.

Compressors (`core.messages.compression`), each priced by its message leaves: `topk` keeps the ceil(r n)
largest-magnitude entries of each leaf (values + index); `randk` k = ceil(r n) entries drawn from the
client's round key (values only: the server draws the same entries), sent times n / k so that the
server's mean is unbiased (E = the change itself, as random-k is defined in the literature; unscaled,
the default r = 0.01 would shrink every update 100-fold); `qsgd` QSGD with `--quantization-bits` b in
buckets of `--quantization-bucket` d entries of a leaf, each with its own norm (b + 1 bits an entry and
a float32 norm a bucket; Alistarh et al. 2017 quantize in buckets: the error bound of their Lemma
3.1, min(d / s^2, sqrt(d) / s) ||x||^2 a bucket, grows with its size, so one norm for a leaf of n
entries would bound it by sqrt(n) / s instead). The server decompresses each message
once (the n / k is in the values sent), then rebuilds and aggregates as the algorithm does.

`--error-feedback` keeps, per client, what its compressed messages left out and adds it to its next
upload (Seide et al. 2014, Stich et al. 2018): a residual per compressed leaf in the client's state, so
checkpoints and resume carry it. Under it `randk` sends its entries unscaled: error feedback needs a
contraction (Stich et al. 2018's rand-k, E||C(x) - x||^2 = (1 - k / n) ||x||^2), and the scaled
one would leave (1 - n / k) times each sent entry in the residual, which grows without bound; the
residual returns what the unscaled one leaves out in later rounds instead. `qsgd` is sent as it is
under error feedback (unbiased, not a contraction in the worst case: Lemma 3.1 allows 1.5 ||x||^2 at 4
bits in buckets of 512); on a Gaussian leaf of 100,000 entries resent every round its error is
0.38 ||x||^2 and the residual stayed at 0.78 ||x|| over 20 rounds, where one norm for the whole leaf
(15.8 ||x||^2) let it grow 6,800-fold.

The wrapped client state is {'inner': the algorithm's, 'residual': ...}: every function of client
states (evaluation's `client_variables`, `client_diagnostics`, `evaluation_clients`) reads the
algorithm's own part (`reading_inner_state`), so the wrapper composes with `--personal` and with
SpaFL, whose thresholds are a dense upload.

Under client-level differential privacy (`--dp-clip`, `privacy.mechanism`) the privacy
wrapper sits outside this one (`run.experiment` composes them so): it clips the message the client
sends, after compression, so a top-k message keeps its k entries (and its sparse price) and its values
are scaled to norm C with the dense leaves' changes. Where the algorithm reads its uploads through their
plain mean, this wrapper's server reads them through the plain mean of the decompressed messages (it
rebuilds each as broadcast + change, linear in the message), so it declares a plain sum
(`PrivateSum`: one client moves it by its clipped message, C; 2 C replaced) whose dense leaves are new
values of the broadcast's at the same path under `dense`. The server adds the noise to the dense sum,
every entry, sent or not. Error feedback's residual is computed before the clipping, from the message
compressed: what the clipping cuts is lost (as in DP-FedAvg), not carried into later rounds, where a
client whose updates stay above C would grow it without bound; the residual never leaves the client.
Under `--dp-noise local` top-k is refused: the noise would cover the values sent, not the client-chosen
indexes (random-k's entries come from the round's key, which the server shares, not from the data).
`qsgd` is refused under `--dp-clip` (its integer levels and per-bucket norms are not clipped here).
Secure aggregation stays refused for top-k: masks cannot hide client-chosen indexes in a sum.

Refused in one line: algorithms whose upload is already priced per entry (sparse or known-mask
leaves: FedLDF, the sub-model family, SPATL, FedPM, ...) or chosen by the server after the
clients answer (`select_uploads`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fedjax_sparse.core.contract.algorithm import BuildContext, FederatedAlgorithm, PrivateSum, replicate
from fedjax_sparse.core.messages.compression import (COMPRESSORS, decompressed, error_feedback, random_k,
                                            stochastic_quantization, top_k)
from fedjax_sparse.core.messages.pricing import PRICED_LEAVES
from fedjax_sparse.core.contract.options import option
from fedjax_sparse.core.contract.wrapping import (broadcast_shapes, flat_leaves, reading_inner_state, upload_changes,
                                         upload_shapes)

RANDOM_K_STREAM = 0x72616E64  # the client's round key folded with this draws its random-k entries


@dataclasses.dataclass(frozen=True)
class UplinkCompressionOptions:
    OPTION_GROUP = "compression"  # the command line's help group (`core.contract.options.option_group`)

    uplink_compression: str = option("none", "compress every client's upload (a model or a delta): top-k, random-k "
                                             "or QSGD (none: as the algorithm sends it)", choices=COMPRESSORS)
    compression_ratio: float = option(0.01, "topk, randk: the share of each leaf's entries sent", low=0.0,
                                      low_open=True, high=1.0)
    quantization_bits: int = option(4, "qsgd: bits per entry besides the sign (2^b - 1 levels)", low=1, high=16)
    quantization_bucket: int = option(512, "qsgd: entries of a leaf quantized with one norm (a bucket; a leaf of "
                                           "fewer entries is one bucket)", low=1)
    error_feedback: bool = option(False, "keep what each client's compressed uploads left out and add it to its "
                                         "next one")

    def ignored(self) -> dict[str, str]:
        out = {}
        if self.uplink_compression == "none":
            out.update({name: "is read only with --uplink-compression topk, randk or qsgd"
                        for name in ("compression_ratio", "quantization_bits", "quantization_bucket",
                                     "error_feedback")})
        elif self.uplink_compression == "qsgd":
            out["compression_ratio"] = "is read by --uplink-compression topk and randk, not qsgd"
        else:
            out.update({name: "is read only by --uplink-compression qsgd"
                        for name in ("quantization_bits", "quantization_bucket")})
        return out


def compress_uplink(algorithm: FederatedAlgorithm, context: BuildContext,
                    options: UplinkCompressionOptions) -> FederatedAlgorithm:
    """`algorithm` with its clients' uploads compressed as `options` say (the module docstring)."""
    if options.uplink_compression == "none":
        return algorithm
    flag = f"--uplink-compression {options.uplink_compression}"
    if algorithm.select_uploads is not None:
        raise ValueError(f"{flag}: {algorithm.name}'s server chooses what its clients upload after they answer; "
                         f"compression applies to algorithms whose clients upload a model or a delta")
    up_shape = upload_shapes(algorithm, context)
    priced = [leaf for leaf in jax.tree_util.tree_leaves(up_shape, is_leaf=lambda x: isinstance(x, PRICED_LEAVES))
              if isinstance(leaf, PRICED_LEAVES)]
    if priced:
        raise ValueError(f"{flag}: {algorithm.name}'s upload is already priced entry by entry (sparse or known-mask "
                         f"leaves); compression applies to algorithms whose clients upload a dense model or delta")
    up_leaves = flat_leaves(up_shape)
    message = upload_changes(up_shape, broadcast_shapes(algorithm, context), lambda path, leaf: (
        jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.size > 1 and "batch_stats" not in path.split("/")))
    paths = message.paths

    def compress(values: dict, key):
        if options.uplink_compression == "topk":
            return top_k(values, options.compression_ratio)
        if options.uplink_compression == "randk":
            return random_k(values, options.compression_ratio, jax.random.fold_in(key, RANDOM_K_STREAM),
                            unbiased=not options.error_feedback)
        return stochastic_quantization(values, options.quantization_bits, jax.random.fold_in(key, RANDOM_K_STREAM),
                                       options.quantization_bucket)

    def init_clients(key, variables, ids):
        inner = algorithm.init_clients(key, variables, ids) if algorithm.init_clients is not None else {}
        state = {"inner": inner}
        if options.error_feedback:
            state["residual"] = replicate({p: jnp.zeros(up_leaves[p].shape, up_leaves[p].dtype) for p in paths}, len(ids))
        return state

    def init(key, variables, n):
        server_state, _ = algorithm.init(key, variables, n)
        return server_state, init_clients(key, variables, jnp.arange(n))

    def client_update(down, state, data, key, info):
        up, inner, metrics = algorithm.client_update(down, state["inner"], data, key, info)
        changes, rest = message.split(up, down)
        if options.error_feedback:
            sent, residual = error_feedback(changes, state["residual"], lambda t: compress(t, key))
            return {"compressed": sent, "dense": rest}, {"inner": inner, "residual": residual}, metrics
        return {"compressed": compress(changes, key), "dense": rest}, {"inner": inner}, metrics

    def server_update(server_state, ups, weights, info):
        downs = jax.vmap(lambda c: algorithm.broadcast(server_state, c, info))(info.client_ids)
        stacked = message.rebuild(decompressed(ups["compressed"]), ups["dense"], downs)
        return algorithm.server_update(server_state, stacked, weights, info)

    # differential privacy: the plain mean of the decompressed messages (the module docstring)
    private_sum = PrivateSum(references=(("dense", ""),)) if algorithm.aggregates_mean else None
    return dataclasses.replace(algorithm, init=init, init_clients=init_clients, client_update=client_update,
                               server_update=server_update, select_uploads=None, stale_upload=None, aggregates_mean=False,
                               private_sum=private_sum, **reading_inner_state(algorithm))
