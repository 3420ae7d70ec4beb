"""bench/beacon.py at its smallest size: the DKG it drives agrees on one group key, any
quorum of a round's partials gives one seed, and every validator's bytes and seconds
are counted."""

from __future__ import annotations

import argparse
import re

from bench_scripts import load_bench


def test_the_beacon_bench_at_four_validators_finds_one_seed(capsys):
    beacon = load_bench("beacon")
    line = beacon.bench_n(4, argparse.Namespace(quorums=4, all_cold=True))
    out = capsys.readouterr().out
    m = re.fullmatch(r"beacon: n=4 quorum=3 seeds_over_quorums=(\d+) dkg_s=([\d.]+) "
                     r"dkg_bytes_per_validator=(\d+) round_ms=(\d+)", line)
    assert m is not None, line
    assert int(m.group(1)) == 1
    assert float(m.group(2)) > 0 and int(m.group(4)) > 0
    # Each validator posts keys, a deal, a complaint and a result, and reads the others':
    # at least its own four posts and the three others' of each phase it reads.
    assert int(m.group(3)) > 4 * 500
    assert "seeds over 4 quorums of the 4 partials: 1 distinct" in out


def test_quorums_are_drawn_from_the_partials_and_start_with_the_lowest(monkeypatch):
    beacon = load_bench("beacon")
    seen = []
    monkeypatch.setattr(beacon.dkg, "combine", lambda partials, q: seen.append(
        sorted(partials)) or bytes(sorted(partials)))
    distinct, _ = beacon.seeds_over_quorums({j: b"" for j in range(6)}, 4, 5,
                                            beacon.random.Random(1))
    assert seen[0] == [0, 1, 2, 3] and all(len(s) == 4 and set(s) <= set(range(6))
                                           for s in seen)
    assert distinct == len({tuple(s) for s in seen})  # a seed per distinct combination


def test_the_beacon_bench_over_http_runs_the_dkg_in_validator_processes(capsys):
    """A ledger process and three validator processes: each ends the DKG holding a share
    of one group key (the bench raises otherwise) and moves bytes through its client."""
    beacon = load_bench("beacon")
    line = beacon.bench_http(3, 0.2)
    m = re.fullmatch(r"beacon_http: n=3 quorum=2 dkg_wall_s=([\d.]+) dkg_cpu_s_max=([\d.]+) "
                     r"dkg_bytes_per_validator=(\d+)", line)
    assert m is not None, line
    assert float(m.group(1)) > 0 and float(m.group(2)) > 0
    # Its own keys, deal, complaint and result up; at least the others' posts down.
    assert int(m.group(3)) > 3 * 4 * 300
    assert "validator processes" in capsys.readouterr().out
