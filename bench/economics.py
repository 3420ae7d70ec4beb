"""Cheating never pays: each cheat's expected profit per round under a preset's own
settings (reward per round, vesting, challenge policy and its detection probabilities,
bond and slash share), and the bond a Sybil party must lock for a share f of the workers.

Profits are in reward units per round, against honest work, for a worker whose round of
training costs its whole fair share of the reward (the worst case: above it no honest
worker takes part). ``open``: no bond; ``bond``: ``min_bond`` = 10 rounds of a worker's
reward, half slashed on a proven fault (specs/scoring.md, "Cheating never pays").

    python bench/economics.py [--workers 16]
"""

from __future__ import annotations

import argparse

from veritrain.protocol.identity import Identity
from veritrain.protocol.membership import cheat_economics
from veritrain.protocol.messages import RunSpec
from veritrain.protocol.presets import run_preset


def preset_spec(name: str, admission: dict | None) -> RunSpec:
    """A spec of preset ``name``'s economic settings (the rest is filler)."""
    s = run_preset(name)
    org = Identity.generate("organiser").public_key.hex()
    body = {"run_id": f"econ-{name}", "round": 0, "created_at": 0, "organiser": org,
            "seed": "0" * 64, "task": {"name": "synthetic", "params": {}},
            "dataset_hash": "0" * 64, "dataset_bytes": 0, "genesis_model_hash": "0" * 64,
            "num_params": 1, "inner": s["inner"], "outer": s["outer"], "codec": s["codec"],
            "aggregator": s["aggregator"], "schedule": s["schedule"],
            "verification": s["verification"], "limits": {"max_payload_bytes": 1},
            "rewards": s["rewards"], "validators": [], "quorum": 1}
    if admission is not None:
        body["admission"] = admission
    return RunSpec.from_body(body)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workers", type=int, default=16)
    args = ap.parse_args()
    worst, sybil, honest = float("-inf"), 0, 0.0
    for name in ("tiny", "demo", "bench"):
        per_worker = run_preset(name)["rewards"]["per_round"] / args.workers
        bond = {"policy": "bond", "min_bond": int(10 * per_worker), "slash_share": 0.5}
        for label, adm in (("open", None), ("bond", bond)):
            eco = cheat_economics(preset_spec(name, adm), workers=args.workers)
            print(f"\n{name} / {label}: reward per worker {eco['reward_per_worker']:.3f}, "
                  f"vesting {eco['vesting_rounds']}, bond {eco['bond']}, "
                  f"lost on a catch {eco['bond_lost']}")
            print(f"  {'cheat':<22} {'saved':>6} {'caught/round':>13} {'profit/round':>13}")
            for c in eco["cheats"]:
                print(f"  {c['cheat']:<22} {c['saved']:>6.3f} {c['caught']:>13.3f} "
                      f"{c['profit']:>13.3f}")
            if label == "bond":
                worst = max(worst, eco["worst_cheat_expected_profit"])
                sybil = max(sybil, eco["sybil_bond_for_f"][0.5])
                honest = eco["honest_net_reward_share"]
    print(f"\neconomics: worst_cheat_expected_profit={worst:.3f} "
          f"sybil_bond_for_f=0.5:{sybil} honest_net_reward_share={honest:.3f}")


if __name__ == "__main__":
    main()
