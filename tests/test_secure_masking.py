"""Masked buckets: exact sums with dropouts, share verification, openings, privacy, buckets."""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from veritrain.aggregation import CenteredClip, Mean
from veritrain.aggregation.secure import (
    BucketContext,
    InconsistentSharesError,
    SecureAggregationError,
    Share,
    ShareVerificationError,
    TooManyDropoutsError,
    WorkerSecrets,
    aggregate_bucket_means,
    deal_shares,
    default_max_dropouts,
    mask_update,
    open_masked_contribution,
    open_shares,
    precompute_mask,
    reveal_shares,
    unmask_bucket,
)
from veritrain.aggregation.secure.prg import keystream
from veritrain.aggregation.secure.shamir import PRIME, commit_share, split_secret

ROOT = Path(__file__).resolve().parents[1]
DIM = 4099  # not a multiple of a ChaCha20 block


def _det(tag: str, *parts: object) -> bytes:
    return hashlib.sha256(("|".join([tag, *map(str, parts)])).encode()).digest()


def worker_ids(n: int, tag: str = "w") -> list[bytes]:
    return [_det(tag, i) for i in range(n)]


def secrets_for(worker: bytes, salt: str = "") -> WorkerSecrets:
    """Deterministic secrets (tests only: real workers use generate_secrets)."""
    return WorkerSecrets(
        worker,
        X25519PrivateKey.from_private_bytes(_det("enc", worker.hex(), salt)),
        X25519PrivateKey.from_private_bytes(_det("mask", worker.hex(), salt)),
        _det("seed", worker.hex(), salt),
    )


@dataclasses.dataclass
class Bucket:
    ctx: BucketContext
    secrets: dict
    adverts: dict
    commitments: dict
    sealed: dict
    held: dict
    updates: dict
    masked: dict
    openings: dict


def make_bucket(
    size=8, max_dropouts=None, dim=DIM, clip=5.0, seed=0, updates=None, tag=None
) -> Bucket:
    members = tuple(sorted(worker_ids(size, tag or f"b{seed}")))
    t = default_max_dropouts(size) if max_dropouts is None else max_dropouts
    ctx = BucketContext("run-1", 7, 0, members, t, dim, clip)
    sec = {w: secrets_for(w, str(seed)) for w in members}
    ads = {w: s.advertisement() for w, s in sec.items()}
    dealt = {w: deal_shares(ctx, sec[w], ads) for w in members}
    coms = {w: dealt[w][0] for w in members}
    sealed = {w: dealt[w][1] for w in members}
    held = {
        h: {d: open_shares(ctx, sec[h], ads, coms[d], sealed[d][h]) for d in members}
        for h in members
    }
    gen = torch.Generator().manual_seed(seed)
    ups = updates or {w: torch.randn(dim, generator=gen) * 0.05 for w in members}
    out = {w: mask_update(ctx, sec[w], ads, members, ups[w], threads=2) for w in members}
    return Bucket(
        ctx,
        sec,
        ads,
        coms,
        sealed,
        held,
        ups,
        {w: o[0] for w, o in out.items()},
        {w: o[1] for w, o in out.items()},
    )


@pytest.fixture(scope="module")
def bucket() -> Bucket:
    return make_bucket()


def finish(b: Bucket, survivors, holders=None, reveals=None):
    holders = survivors if holders is None else holders
    reveals = reveals or [reveal_shares(b.ctx, h, b.held[h], survivors) for h in holders]
    return unmask_bucket(b.ctx, b.adverts, b.commitments, [b.masked[w] for w in survivors], reveals)


def expected_sum(b: Bucket, survivors) -> np.ndarray:
    q = sum(b.openings[w].quantized.view(np.int32).astype(np.int64) for w in survivors)
    return q.astype(np.float64) / b.ctx.scale


# -- exact sums ----------------------------------------------------------------


@pytest.mark.parametrize("dropouts", [0, 1, 2, 3])
def test_exact_sum_with_up_to_t_dropouts(bucket, dropouts):
    members = bucket.ctx.members
    survivors = members[dropouts:]  # the lowest ids drop: their pairs carry + and - signs
    res = finish(bucket, survivors)
    assert res.dropped == members[:dropouts] and res.survivors == survivors and res.faults == ()
    assert np.array_equal(res.total.numpy(), expected_sum(bucket, survivors))
    # and that is the sum of the clipped updates up to one rounding step each
    clipped = sum(
        u.double() * min(1.0, 5.0 / float(u.double().norm()))
        for w, u in bucket.updates.items()
        if w in survivors
    )
    assert float((res.total - clipped).abs().max()) < len(survivors) / bucket.ctx.scale


def test_exact_sum_when_dropouts_are_interleaved_and_some_holders_silent(bucket):
    m = bucket.ctx.members
    survivors = (m[0], m[2], m[3], m[5], m[7])  # 3 dropped: m1, m4, m6
    res = finish(bucket, survivors)
    assert res.dropped == (m[1], m[4], m[6])
    assert np.array_equal(res.total.numpy(), expected_sum(bucket, survivors))


def test_a_dropped_member_may_still_reveal_its_shares(bucket):
    """Upload lost but the member is online: its reveals count toward the threshold."""
    m = bucket.ctx.members
    survivors = m[4:]  # 4 dropped > t = 3 ...
    res = finish(bucket, survivors, holders=m[3:])  # ... but m3 still reveals: 5 = k holders
    assert np.array_equal(res.total.numpy(), expected_sum(bucket, survivors))


def test_more_than_t_dropouts_fail_with_a_clear_error(bucket):
    survivors = bucket.ctx.members[4:]  # 4 > t = 3
    with pytest.raises(TooManyDropoutsError, match=r"needs 5 valid shares but only 4") as exc:
        finish(bucket, survivors)
    assert exc.value.needed == 5 and exc.value.available == 4


def test_withheld_shares_count_as_dropouts(bucket):
    m = bucket.ctx.members
    with pytest.raises(TooManyDropoutsError):
        finish(bucket, m, holders=m[:4])  # everyone uploaded, only 4 reveal


def test_sum_is_independent_of_thread_count_and_deterministic():
    a = make_bucket(size=4, max_dropouts=1, seed=3)
    b = make_bucket(size=4, max_dropouts=1, seed=3)
    w = a.ctx.members[0]
    assert np.array_equal(a.masked[w].words, b.masked[w].words)
    single = mask_update(a.ctx, a.secrets[w], a.adverts, a.ctx.members, a.updates[w], threads=1)[0]
    assert np.array_equal(single.words, a.masked[w].words)
    pre = precompute_mask(a.ctx, a.secrets[w], a.adverts, a.ctx.members, threads=3)
    online = mask_update(a.ctx, a.secrets[w], a.adverts, a.ctx.members, a.updates[w], mask=pre)[0]
    assert np.array_equal(online.words, a.masked[w].words)
    with pytest.raises(SecureAggregationError, match="precompute_mask"):
        mask_update(a.ctx, a.secrets[w], a.adverts, a.ctx.members, a.updates[w], mask=pre[:-1])


# -- share verification --------------------------------------------------------


def test_forged_revealed_share_is_detected_and_blamed_on_the_holder(bucket):
    m = bucket.ctx.members
    survivors = m  # no dropouts: 8 seed shares per survivor, 5 needed
    reveals = [reveal_shares(bucket.ctx, h, bucket.held[h], survivors) for h in m]
    liar = reveals[2]
    dealer, share, salt = liar.seed_shares[0]
    forged = dataclasses.replace(
        liar,
        seed_shares=((dealer, Share(share.x, (share.y + 1) % PRIME), salt), *liar.seed_shares[1:]),
    )
    reveals[2] = forged
    res = finish(bucket, survivors, reveals=reveals)
    assert [(f.culprit, f.dealer, f.reason) for f in res.faults] == [
        (m[2], dealer, "forged seed share")
    ]
    assert np.array_equal(res.total.numpy(), expected_sum(bucket, survivors))  # still exact


def test_forged_shares_beyond_the_margin_fail_the_bucket(bucket):
    m = bucket.ctx.members
    survivors = m[2:]  # 6 holders reveal, 5 needed
    reveals = []
    for h in survivors:
        rv = reveal_shares(bucket.ctx, h, bucket.held[h], survivors)
        if h in m[2:4]:  # two liars leave 4 valid shares
            rv = dataclasses.replace(
                rv,
                key_shares=tuple(
                    (d, Share(s.x, (s.y + 7) % PRIME), salt) for d, s, salt in rv.key_shares
                ),
            )
        reveals.append(rv)
    with pytest.raises(TooManyDropoutsError):
        finish(bucket, survivors, reveals=reveals)


def test_revealing_the_wrong_kind_of_share_is_ignored_and_recorded(bucket):
    m = bucket.ctx.members
    survivors = m[1:]
    rv = reveal_shares(bucket.ctx, m[1], bucket.held[m[1]], survivors)
    hs = bucket.held[m[1]][m[2]]
    greedy = dataclasses.replace(rv, key_shares=(*rv.key_shares, (m[2], hs.key_share, hs.key_salt)))
    reveals = [greedy] + [reveal_shares(bucket.ctx, h, bucket.held[h], survivors) for h in m[2:]]
    res = finish(bucket, survivors, reveals=reveals)
    assert any(f.culprit == m[1] and "wrong set" in f.reason for f in res.faults)
    assert np.array_equal(res.total.numpy(), expected_sum(bucket, survivors))


def test_tampered_sealed_shares_are_blamed_on_the_dealer(bucket):
    m = bucket.ctx.members
    sealed = bucket.sealed[m[0]][m[1]]
    bad = dataclasses.replace(
        sealed, ciphertext=bytes([sealed.ciphertext[0] ^ 1]) + sealed.ciphertext[1:]
    )
    with pytest.raises(ShareVerificationError) as exc:
        open_shares(bucket.ctx, bucket.secrets[m[1]], bucket.adverts, bucket.commitments[m[0]], bad)
    assert exc.value.culprit == m[0]


def test_invalid_dealer_whose_shares_miss_its_commitments_is_caught_on_receipt(bucket):
    m = bucket.ctx.members
    com = bucket.commitments[m[0]]
    wrong = dataclasses.replace(com, seed_share_commitments=(bytes(32),) * bucket.ctx.size)
    with pytest.raises(ShareVerificationError, match="does not match its commitment") as exc:
        open_shares(
            bucket.ctx, bucket.secrets[m[1]], bucket.adverts, wrong, bucket.sealed[m[0]][m[1]]
        )
    assert exc.value.culprit == m[0]


def test_invalid_inconsistent_dealing_is_blamed_on_the_dealer():
    """A dealer commits to shares that do not lie on one polynomial: found at reconstruction."""
    b = make_bucket(size=5, max_dropouts=2, dim=64, seed=5)
    ctx, m = b.ctx, b.ctx.members
    dealer = m[0]
    shares = split_secret(b.secrets[dealer].self_seed, ctx.threshold, ctx.size)
    shares[4] = Share(5, (shares[4].y + 1) % PRIME)  # holder 5 gets an off-polynomial share
    salt = bytes(32)
    from veritrain.aggregation.secure.masking import _share_context

    sctx = _share_context(ctx, dealer, "seed")
    com = dataclasses.replace(
        b.commitments[dealer],
        seed_share_commitments=tuple(commit_share(sctx, s, salt) for s in shares),
    )
    coms = {**b.commitments, dealer: com}
    held = {
        h: {
            **b.held[h],
            dealer: dataclasses.replace(b.held[h][dealer], seed_share=shares[i], seed_salt=salt),
        }
        for i, h in enumerate(m)
    }
    reveals = [reveal_shares(ctx, h, held[h], m) for h in m]
    with pytest.raises(InconsistentSharesError) as exc:
        unmask_bucket(ctx, b.adverts, coms, [b.masked[w] for w in m], reveals)
    assert exc.value.culprit == dealer
    # with only k shares the inconsistency is invisible to interpolation but the
    # seed no longer matches its hash commitment
    reveals = [reveal_shares(ctx, h, held[h], m) for h in m[2:]]
    with pytest.raises(InconsistentSharesError, match="does not match its commitment") as exc:
        unmask_bucket(ctx, b.adverts, coms, [b.masked[w] for w in m], reveals)
    assert exc.value.culprit == dealer


# -- openings (spot checks) ----------------------------------------------------


def test_honest_opening_verifies(bucket):
    w = bucket.ctx.members[3]
    assert open_masked_contribution(
        bucket.ctx,
        bucket.adverts,
        bucket.commitments,
        bucket.masked[w],
        bucket.openings[w],
        update=bucket.updates[w],
    )


def test_invalid_masked_input_without_a_valid_opening_fails(bucket):
    ctx, w = bucket.ctx, bucket.ctx.members[3]
    masked, op = bucket.masked[w], bucket.openings[w]

    def check(mk=masked, o=op, update=None, coms=bucket.commitments):
        return open_masked_contribution(ctx, bucket.adverts, coms, mk, o, update=update)

    words = masked.words.copy()
    words[17] += np.uint32(1)
    assert not check(mk=dataclasses.replace(masked, words=words))  # y tampered after the fact
    q = op.quantized.copy()
    q[5] += np.uint32(1)
    assert not check(o=dataclasses.replace(op, quantized=q))  # q not the committed one
    assert not check(o=dataclasses.replace(op, self_seed=bytes(32)))  # wrong self-mask seed
    other = bucket.openings[ctx.members[4]]
    assert not check(
        o=dataclasses.replace(op, mask_private=other.mask_private)
    )  # someone else's key
    assert not check(update=bucket.updates[w] + 0.01)  # q is not this update
    assert not check(o=dataclasses.replace(op, worker=ctx.members[4]))
    assert not check(o=dataclasses.replace(op, quantized=q[:-1]))  # malformed
    assert not check(o=dataclasses.replace(op, mask_private=b"short"))


def test_invalid_unclipped_contribution_fails_its_opening():
    """A worker that skips the clip (norm 10x C) is caught when opened."""
    b = make_bucket(size=3, max_dropouts=1, dim=256, clip=1.0, seed=9)
    ctx, w = b.ctx, b.ctx.members[1]
    big = torch.full((ctx.dim,), 10.0 / math.sqrt(ctx.dim))
    y = np.floor(big.double().numpy() * ctx.scale).astype(np.int64).astype(np.uint32)
    from veritrain.aggregation.secure.masking import (
        _mask_terms,
        _priv_bytes,
        _self_key,
        commitment_salt,
        quantized_commitment,
    )
    from veritrain.aggregation.secure.prg import combine_streams

    masked = y.copy()
    terms = [(_self_key(ctx, w, b.secrets[w].self_seed), 1)]
    terms += _mask_terms(ctx, w, b.secrets[w].mask_key, b.adverts, ctx.members)
    combine_streams(masked, terms)
    salt = commitment_salt(ctx, w, b.secrets[w].self_seed, _priv_bytes(b.secrets[w].mask_key))
    mk = dataclasses.replace(b.masked[w], words=masked,
                             commitment=quantized_commitment(ctx, w, y, salt))
    op = dataclasses.replace(b.openings[w], quantized=y)
    assert not open_masked_contribution(ctx, b.adverts, b.commitments, mk, op)


# -- privacy: what one validator holds -----------------------------------------


def _chi2_uniform_bytes(words: np.ndarray) -> float:
    """Largest z-score of a chi-square test of uniformity over each byte of the words."""
    worst = 0.0
    raw = words.astype("<u4").view(np.uint8).reshape(-1, 4)
    for col in range(4):
        counts = np.bincount(raw[:, col], minlength=256)
        exp = len(raw) / 256
        chi2 = float(((counts - exp) ** 2 / exp).sum())
        worst = max(worst, abs(chi2 - 255) / math.sqrt(2 * 255))
    return worst


def test_masked_vectors_look_uniform_whatever_the_input():
    """Zero, constant and random updates all give byte-uniform masked words."""
    dim = 60_000
    members = tuple(sorted(worker_ids(4, "priv")))
    ups = {
        members[0]: torch.zeros(dim),
        members[1]: torch.full((dim,), 1e-3),
        members[2]: torch.randn(dim, generator=torch.Generator().manual_seed(0)) * 1e-3,
        members[3]: torch.zeros(dim),
    }
    b = make_bucket(size=4, max_dropouts=1, dim=dim, clip=1.0, seed=11, updates=ups, tag="priv")
    b2 = make_bucket(
        size=4,
        max_dropouts=1,
        dim=dim,
        clip=1.0,
        seed=11,
        tag="priv",
        updates={w: torch.zeros(dim) for w in members},
    )
    # the structured inputs are far from uniform ...
    assert _chi2_uniform_bytes(b.openings[members[1]].quantized) > 100
    for w in b.ctx.members:
        assert _chi2_uniform_bytes(b.masked[w].words) < 6  # ... their masked forms are not
    # what a validator learns after unmasking a survivor's self mask: still
    # covered by the pairwise masks with the other members
    from veritrain.aggregation.secure.masking import _self_key

    w = members[1]
    self_mask = keystream(_self_key(b.ctx, w, b.secrets[w].self_seed), 4 * dim).view("<u4")
    stripped = (b.masked[w].words - self_mask).astype(np.uint32)
    assert _chi2_uniform_bytes(stripped) < 6
    # changing every input changes nothing a chi-square can see, only the words
    assert not np.array_equal(b.masked[w].words, b2.masked[w].words)
    corr = np.corrcoef(
        b.openings[w].quantized.view(np.int32).astype(np.float64),
        b.masked[w].words.astype(np.float64),
    )[0, 1]
    assert abs(corr) < 6 / math.sqrt(dim)


def test_a_validator_never_receives_both_shares_of_one_dealer(bucket):
    m = bucket.ctx.members
    survivors = m[2:]
    reveals = [reveal_shares(bucket.ctx, h, bucket.held[h], survivors) for h in m]
    for rv in reveals:
        seeds = {d for d, _, _ in rv.seed_shares}
        keys = {d for d, _, _ in rv.key_shares}
        assert seeds == set(survivors) and keys == set(m[:2]) and not seeds & keys


def test_fewer_than_threshold_key_shares_do_not_unmask_an_individual(bucket):
    """A validator with k - 1 shares of a survivor's key cannot strip its pairwise masks."""
    ctx, m = bucket.ctx, bucket.ctx.members
    target = m[0]
    shares = [bucket.held[h][target].key_share for h in m[: ctx.threshold - 1]]
    from veritrain.aggregation.secure.shamir import reconstruct_secret

    with pytest.raises(SecureAggregationError, match="cannot reconstruct"):
        reconstruct_secret(shares, ctx.threshold)
    # and the sum of everyone but the target is all a bucket sum gives away:
    # the masked input alone, minus its (revealed) self mask, is still uniform
    from veritrain.aggregation.secure.masking import _self_key

    sm = keystream(_self_key(ctx, target, bucket.secrets[target].self_seed), 4 * ctx.dim).view(
        "<u4"
    )
    assert _chi2_uniform_bytes((bucket.masked[target].words - sm).astype(np.uint32)) < 6


def test_invalid_bucket_contexts():
    m = tuple(sorted(worker_ids(8)))
    with pytest.raises(SecureAggregationError, match="must exceed s/2"):
        BucketContext("r", 1, 0, m, 4, 10, 1.0)
    with pytest.raises(SecureAggregationError, match="ascending"):
        BucketContext("r", 1, 0, tuple(reversed(m)), 3, 10, 1.0)
    with pytest.raises(SecureAggregationError):
        BucketContext("r", 1, 0, m[:1], 0, 10, 1.0)
    with pytest.raises(SecureAggregationError):
        BucketContext("r", 1, 0, m, 3, 10, -1.0)
    assert BucketContext("r", 1, 0, m, 3, 10, 1.0).threshold == 5


def test_invalid_masked_inputs_are_refused(bucket):
    m = bucket.ctx.members
    reveals = [reveal_shares(bucket.ctx, h, bucket.held[h], m) for h in m]
    short = dataclasses.replace(bucket.masked[m[0]], words=bucket.masked[m[0]].words[:-1])
    with pytest.raises(SecureAggregationError, match="uint32"):
        unmask_bucket(bucket.ctx, bucket.adverts, bucket.commitments, [short], reveals)
    twice = [bucket.masked[m[0]], bucket.masked[m[0]]]
    with pytest.raises(SecureAggregationError, match="one per worker"):
        unmask_bucket(bucket.ctx, bucket.adverts, bucket.commitments, twice, reveals)
    with pytest.raises(SecureAggregationError, match="shape"):
        mask_update(bucket.ctx, bucket.secrets[m[0]], bucket.adverts, m, torch.zeros(3))


def test_centered_clip_over_bucket_means(bucket):
    m = bucket.ctx.members
    s1 = finish(bucket, m)
    s2 = finish(bucket, m[1:])
    sums = torch.stack([s1.total, s2.total])
    mean = aggregate_bucket_means(sums, [s1.count, s2.count], Mean())
    assert torch.allclose(mean, (s1.total + s2.total) / 15)
    cc = aggregate_bucket_means([s1.total, s2.total], [s1.count, s2.count], CenteredClip(tau=1e-9))
    assert cc.shape == (bucket.ctx.dim,)
    with pytest.raises(SecureAggregationError):
        aggregate_bucket_means(sums, [8], Mean())


# -- layering ------------------------------------------------------------------


def test_secure_package_imports_no_io_pickle_or_weak_rng():
    found: set[str] = set()
    for path in (ROOT / "aggregation" / "secure").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
            elif isinstance(node, ast.Attribute) and node.attr in {
                "random",
                "rand",
                "randn",
                "randint",
            }:
                found.add(f"<attribute {node.attr}>")
    banned = {
        "socket",
        "http",
        "asyncio",
        "aiohttp",
        "sqlalchemy",
        "sqlite3",
        "urllib",
        "pickle",
        "random",
        "<attribute random>",
        "<attribute rand>",
        "<attribute randn>",
        "<attribute randint>",
    }
    assert not found & banned
    code = (
        "import sys, veritrain.aggregation.secure as s; print(','.join(sorted("
        "m for m in sys.modules if m.split('.')[0] in {'aiohttp','sqlalchemy','requests','urllib3'})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_the_quantized_commitment_is_salted_with_secrets_only_an_opening_reveals():
    """A guess of q_i cannot be tested against the public commitment: the salt needs both
    the self-mask seed and the mask private key, of which unmasking reveals at most one."""
    import hashlib

    from veritrain.aggregation.secure.masking import (
        _priv_bytes,
        commitment_salt,
        quantized_commitment,
    )
    from veritrain.aggregation.secure.prg import encode_parts

    b = make_bucket(size=3, max_dropouts=1, dim=64, seed=11)
    ctx, w = b.ctx, b.ctx.members[0]
    q, secrets = b.openings[w].quantized, b.secrets[w]
    seed, private = secrets.self_seed, _priv_bytes(secrets.mask_key)
    assert b.masked[w].commitment == quantized_commitment(
        ctx, w, q, commitment_salt(ctx, w, seed, private))
    unsalted = hashlib.sha256(b"veritrain/v1/secure/quantized" + encode_parts(
        ctx.run_id, ctx.round_index, w) + np.ascontiguousarray(q, dtype="<u4").tobytes())
    assert b.masked[w].commitment != unsalted.digest()
    # Knowing one of the two secrets (as after unmasking) gives another salt.
    assert commitment_salt(ctx, w, seed, bytes(32)) != commitment_salt(ctx, w, seed, private)
    assert commitment_salt(ctx, w, bytes(32), private) != commitment_salt(ctx, w, seed, private)
