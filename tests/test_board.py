"""What a node takes from the ledger's board (protocol/board.py): posts bound to the member
they name, lists signed once per round."""

from __future__ import annotations

import pytest
from veritrain.protocol.board import BoardFault, SignedOnce, open_member_post
from veritrain.protocol.identity import Identity
from veritrain.protocol.messages import SecaggKeys, sign

RUN = "board-run"
ALICE, BOB, MALLORY = (Identity.generate("worker") for _ in range(3))
MEMBERS = {ALICE.public_key.hex(), BOB.public_key.hex()}


def advert(who: Identity, *, run_id: str = RUN, r: int = 2, bucket: int = 1) -> SecaggKeys:
    return SecaggKeys(run_id=run_id, round=r, bucket=bucket, worker=who.public_key.hex(),
                      enc_public="11" * 32, mask_public="22" * 32)


def test_a_members_own_post_opens():
    signed = open_member_post(sign(ALICE, advert(ALICE)).to_wire(), SecaggKeys,
                              member_field="worker", members=MEMBERS, run_id=RUN,
                              round_index=2, bucket=1)
    assert signed.signer == ALICE.public_key.hex() == signed.message.worker


@pytest.mark.parametrize(("wire", "problem"), [
    (sign(MALLORY, advert(ALICE)).to_wire(), "signed by"),  # the ledger's own key, Alice's name
    (sign(MALLORY, advert(MALLORY)).to_wire(), "not a member"),
    (sign(ALICE, advert(ALICE, r=1)).to_wire(), "round 1"),  # a genuine advert of another round
    (sign(ALICE, advert(ALICE, run_id="other-run")).to_wire(), "run other-run"),
    (sign(ALICE, advert(ALICE, bucket=0)).to_wire(), "bucket"),
    ({"kind": "secagg_keys", "body": advert(ALICE).to_body(), "signer": ALICE.public_key.hex(),
      "signature": "00" * 64}, "does not open"),
])
def test_invalid_posts_are_board_faults(wire, problem):
    with pytest.raises(BoardFault, match=problem) as info:
        open_member_post(wire, SecaggKeys, member_field="worker", members=MEMBERS, run_id=RUN,
                         round_index=2, bucket=1)
    assert info.value.reason == "board_fault"


def test_a_node_signs_one_list_per_round_and_remembers_it_across_restarts():
    disk: dict[str, dict[str, str]] = {}
    once = SignedOnce(save=lambda state: disk.__setitem__("state", state))
    once.claim("shard_check", RUN, 3, "aa" * 32)
    once.claim("shard_check", RUN, 3, "aa" * 32)  # the same list again: fine
    once.claim("shard_check", RUN, 4, "bb" * 32)  # another round: its own list
    once.claim("beacon", RUN, 3, "cc" * 32)  # another kind: its own list
    with pytest.raises(BoardFault, match="already signed another shard_check"):
        once.claim("shard_check", RUN, 3, "dd" * 32)
    restarted = SignedOnce(disk["state"])
    assert restarted.signed("shard_check", RUN, 3) == "aa" * 32
    with pytest.raises(BoardFault):
        restarted.claim("shard_check", RUN, 3, "dd" * 32)


def test_claims_from_many_threads_all_reach_the_disk(tmp_path):
    """Nodes sign on threads and on their event loop: claims made at once all end up in
    the file a restart reads, none lost to another's save."""
    from concurrent.futures import ThreadPoolExecutor

    path = tmp_path / "signed-once.json"
    once = SignedOnce.in_file(path)

    def claim_many(t: int) -> None:
        for r in range(25):
            once.claim(f"kind{t}", RUN, r, f"{t:02x}{r:02x}" * 16)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(claim_many, range(8)))
    restarted = SignedOnce.in_file(path)
    assert len(restarted.state) == 8 * 25
    assert all(restarted.signed(f"kind{t}", RUN, r) == f"{t:02x}{r:02x}" * 16
               for t in range(8) for r in range(25))
