"""Secure averaging: sharded CenteredClip with cheap checks, and pairwise-masked buckets.

Two independent mechanisms (specs/secure-averaging.md):

* **Sharded aggregation** (BTARD's ButterflyClip): validator j computes the
  CenteredClip fixed point on coordinate shard j (``aggregate_shard``); the
  others check it on beacon-drawn coordinate blocks (``check_shard_result``)
  at a small fraction of the cost of recomputing it, and a failed check is
  settled exactly (``recompute_shard``), blaming the publisher only if the
  published result is really wrong.
* **Masked buckets** (SecAgg+ style): workers in a beacon-drawn bucket
  (``veritrain.protocol.secagg.round_buckets``) clip, quantize to Z_(2^32) and add pairwise ChaCha20
  masks from X25519 agreements plus a self mask; Shamir shares of the self-mask
  seeds and mask keys let the bucket finish with up to t dropouts
  (``unmask_bucket``).  Validators see only bucket sums, and CenteredClip runs
  over bucket means (``aggregate_bucket_means``).

Pure functions over typed values: no I/O, no global random generator; every
random choice another party must reproduce is a ChaCha20 stream.
"""

from .buckets import aggregate_bucket_means
from .errors import (
    InconsistentSharesError,
    NonFiniteShardError,
    SecureAggregationError,
    ShareVerificationError,
    TooManyDropoutsError,
)
from .fixed_point import clip_factor, dequantize, fixed_point_scale, quantize
from .masking import (
    BucketContext,
    BucketSum,
    HeldShare,
    KeyAdvertisement,
    MaskedInput,
    MaskOpening,
    SealedShares,
    ShareCommitments,
    ShareFault,
    ShareReveal,
    WorkerSecrets,
    commitment_salt,
    deal_shares,
    default_max_dropouts,
    generate_secrets,
    mask_update,
    open_masked_contribution,
    open_shares,
    precompute_mask,
    quantized_commitment,
    reveal_shares,
    rounding_key,
    unmask_bucket,
)
from .projection import (
    ShardCheck,
    check_shard_result,
    default_sample_blocks,
    sample_blocks,
)
from .shamir import PRIME, Share, reconstruct_secret, split_secret
from .sharding import (
    ExactVerdict,
    ShardFinding,
    ShardResult,
    aggregate_shard,
    assemble_shards,
    fixed_point_coefficients,
    recompute_shard,
    shard_bounds,
    shard_tau,
    verify_shard_exact,
)

__all__ = [
    "PRIME",
    "BucketContext",
    "BucketSum",
    "ExactVerdict",
    "HeldShare",
    "InconsistentSharesError",
    "KeyAdvertisement",
    "MaskOpening",
    "MaskedInput",
    "NonFiniteShardError",
    "SealedShares",
    "SecureAggregationError",
    "ShardCheck",
    "ShardFinding",
    "ShardResult",
    "Share",
    "ShareCommitments",
    "ShareFault",
    "ShareReveal",
    "ShareVerificationError",
    "TooManyDropoutsError",
    "WorkerSecrets",
    "aggregate_bucket_means",
    "aggregate_shard",
    "assemble_shards",
    "check_shard_result",
    "clip_factor",
    "deal_shares",
    "default_max_dropouts",
    "default_sample_blocks",
    "dequantize",
    "fixed_point_coefficients",
    "fixed_point_scale",
    "generate_secrets",
    "commitment_salt",
    "mask_update",
    "open_masked_contribution",
    "open_shares",
    "precompute_mask",
    "quantize",
    "quantized_commitment",
    "recompute_shard",
    "reconstruct_secret",
    "reveal_shares",
    "rounding_key",
    "sample_blocks",
    "shard_bounds",
    "shard_tau",
    "split_secret",
    "unmask_bucket",
    "verify_shard_exact",
]
