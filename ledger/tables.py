"""The audit's terminal tables: a run's report, one round, one worker.

Plain text from the audit API's JSON (``veritrain audit report|round|worker``;
``--json`` prints the JSON itself). Keys and hashes are cut to 12 hex digits
in columns; the evidence of a spot check (the revealed states' content
hashes) is printed under the verdict it backs.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["format_report", "format_round", "format_worker"]

VERDICT_HEADER = ("worker        status    reason              spot-checked   distance  samples"
                  "     score    reward")
WORKER_HEADER = ("round  status    reason              spot-checked   distance  samples     score"
                 "    reward  submission      bytes")


def _short(value: str | None) -> str:
    return (value or "-")[:12]


def _when(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))


def _after(start: float | None, ts: float | None) -> str:
    return "-" if start is None or ts is None else f"{ts - start:.1f}s"


def _signers(cert: dict[str, Any] | None) -> str:
    return ",".join(str(i) for i in cert["signers"]) if cert else "-"


def _spot(v: dict[str, Any]) -> str:
    segments = [str(c["segment"]) for c in v.get("checks") or []]
    if segments:
        return "segment " + ",".join(segments) if len(segments) == 1 else (
            "segments " + ",".join(segments))
    return "yes" if v.get("spot_checked") else "no"


def _distance(v: dict[str, Any]) -> str:
    return "-" if v.get("distance") is None else f"{v['distance']:.2e}"


def _verdict_cells(v: dict[str, Any]) -> str:
    return (f"{v['status']:<8}  {(v.get('reason') or '-'):<18}  {_spot(v):<13}  "
            f"{_distance(v):>9}  {v['samples']:>7}  {v['score']:>8.1f}  {v['reward']:>8.2f}")


def _verdict_notes(v: dict[str, Any], indent: str = "    ") -> list[str]:
    """Why a submission was rejected or excluded, and the evidence of each segment check."""
    lines = []
    if v["status"] == "rejected" and v.get("detail"):
        lines.append(f"{indent}why: {v['detail']}")
    elif v["status"] == "excluded":  # suspicion, not proof: left out, paid
        lines.append(f"{indent}excluded from the aggregate, not rejected (paid by its clip "
                     f"quality): {v.get('detail') or v.get('reason')}")
    for c in v.get("checks") or []:
        dist = "-" if c.get("distance") is None else f"{c['distance']:.2e}"
        states = f"states {_short(c.get('start'))} -> {_short(c.get('end'))}"
        ef = f", residual {_short(c['ef'])}" if c.get("ef") else ""
        note = f": {c['note']}" if c.get("note") else ""
        lines.append(f"{indent}segment {c['segment']}: {'ok' if c.get('ok') else 'FAILED'}, "
                     f"distance {dist}, {states}{ef}{note}")
    return lines


def format_round(data: dict[str, Any]) -> str:
    """One round (``GET /v1/runs/RUN/rounds/R``): what was certified, every verdict with its
    reason and spot-check evidence, and the writes refused at the door."""
    loss = f"eval loss {data['eval_loss']:.4f}" if data.get("eval_loss") is not None else (
        "no eval loss yet")
    cert, base = data.get("certificate"), data.get("base_certificate")
    new_model = (f"new model    {_short(cert['certified']['model_hash'])}, certified by "
                 f"validators {_signers(cert)}" if cert else "new model    - (not certified yet)")
    base_from = (f"certified in round {data['round'] - 1} by validators {_signers(base)}"
                 if base else "the genesis model of the signed run spec")
    opened = data.get("opened_at")
    lines = [f"run {data['run_id']}, round {data['round']}: {data['status']}, {loss}",
             f"base model   {_short(data.get('base_model_hash'))} ({base_from})",
             new_model,
             f"{data['submissions']} submission(s); opened {_when(opened)}, closed after "
             f"{_after(opened, data.get('closed_at'))}, finalized after "
             f"{_after(opened, data.get('finalized_at'))}"
             + (f", deadline extended {data['extensions']}x" if data.get("extensions") else ""),
             ""]
    verdicts = data.get("verdicts") or []
    if verdicts:
        lines.append(VERDICT_HEADER)
        for v in verdicts:
            lines.append(f"{_short(v['worker']):<12}  {_verdict_cells(v)}")
            lines += _verdict_notes(v)
    else:
        lines.append("no verdicts yet")
    rejections = data.get("rejections") or []
    if rejections:
        lines += ["", "refused at the ledger's door in this round:"]
        for x in rejections:
            lines.append(f"    {_short(x.get('signer'))} {x['endpoint']} {x['reason']}: "
                         f"{x['detail']}")
    return "\n".join(lines)


def format_worker(data: dict[str, Any]) -> str:
    """One worker's history (``GET /v1/runs/RUN/workers/KEY``): a row per round with its
    verdict and submission, the spot-check evidence, and the penalties taken."""
    totals = data["totals"]
    banned = (f"; banned until round {data['banned_until_round']}"
              if data["banned_until_round"] >= 0 else "")
    excluded = totals.get("excluded", 0)
    accepted = totals["verdicts"] - totals["rejected"] - excluded
    lines = [f"worker {data['worker']}, run {data['run_id']}",
             f"registered in round {data['registered_round']}{banned}",
             f"{totals['verdicts']} verdict(s): {accepted} accepted, {totals['rejected']} "
             f"rejected, {excluded} excluded (paid); score {totals['score']:.1f}, "
             f"reward {totals['reward']:.2f}, "
             f"forfeited {totals.get('forfeited', 0.0):.2f}", ""]
    subs = {x["round"]: x for x in data.get("submissions") or []}
    verdicts = {v["round"]: v for v in data.get("verdicts") or []}
    rounds = sorted(set(subs) | set(verdicts))
    if not rounds:
        lines.append("no submissions yet")
    else:
        lines.append(WORKER_HEADER)
    for r in rounds:
        sub, v = subs.get(r), verdicts.get(r)
        cells = _verdict_cells(v) if v else f"{'pending':<8}  {'':<18}  {'':<13}  {'':>9}  " \
            f"{'':>7}  {'':>8}  {'':>8}"
        sub_cells = (f"{_short(sub['digest']):<12}  {sub['payload_bytes']:>7}" if sub
                     else f"{'-':<12}  {'-':>7}")
        lines.append(f"{r:>5}  {cells}  {sub_cells}")
        if v:
            lines += _verdict_notes(v, "       ")
    if data.get("admission") and data.get("bond"):
        lines += ["", f"admission {_policy(data['admission'])}: {_bond_text(data['bond'])}"]
        for x in data["bond"]["slashes"]:
            lines.append(f"    round {x['round']}: slashed {x['amount']} units")
    penalties = data.get("penalties") or []
    if penalties:
        lines += ["", "penalties:"]
        for p in penalties:
            lines.append(f"    round {p['round']}: {p['kind']} {p['amount']:.2f} earned in round "
                         f"{p['source_round']} ({p['reason']})")
    return "\n".join(lines)


def format_report(report: dict[str, Any]) -> str:
    """The run at a glance (``GET /v1/runs/RUN/report``): a line per round, a line per
    worker with each rejection's reason, the refusals at the door grouped, and validator
    faults."""
    lines = [f"run {report['run_id']} ({report['status']})", "",
             "round  status     eval_loss  accepted  rejected  excluded  certified model  "
             "signers"]
    for r in report["rounds"]:
        loss = f"{r['eval_loss']:.4f}" if r["eval_loss"] is not None else "-"
        signers = ",".join(str(i) for i in r.get("certified_by") or [])
        lines.append(f"{r['round']:>5}  {r['status']:<9}  {loss:>9}  {r['accepted']:>8}  "
                     f"{r['rejected']:>8}  {r.get('excluded', 0):>8}  "
                     f"{(r.get('model_hash') or '-')[:15]:<15}  {signers}")
    lines += ["", "worker        accepted  rejected  excluded  spot-checked     score    reward  "
              "forfeited  banned"]
    for w in report["workers"]:
        banned = f"until r{w['banned_until_round']}" if w["banned_until_round"] >= 0 else ""
        excluded = w.get("excluded", [])
        lines.append(f"{w['worker'][:12]}  {w['accepted']:>8}  {len(w['rejected']):>8}  "
                     f"{len(excluded):>8}  "
                     f"{w['spot_checked']:>12}  {w['score']:>8.0f}  {w['reward']:>8.2f}  "
                     f"{w.get('forfeited', 0.0):>9.2f}  {banned}")
        for rej in w["rejected"]:
            lines.append(f"    round {rej['round']}: {rej['reason']} ({rej['detail']})")
        for exc in excluded:  # a statistical filter's suspicion: left out, still paid
            lines.append(f"    round {exc['round']}: excluded, paid: {exc['reason']} "
                         f"({exc['detail']})")
    lines += _bond_lines(report)
    if report["rejections"]:
        lines += ["", "refused at the ledger's door:"]
        grouped: dict[tuple[str, str], list[Any]] = {}
        for x in report["rejections"]:
            grouped.setdefault(((x["signer"] or "?")[:12], x["reason"]), []).append(x)
        for (who, reason), xs in grouped.items():
            rounds = sorted({x["round"] for x in xs if x["round"] is not None})
            where = f"rounds {rounds[0]}-{rounds[-1]}" if len(rounds) > 1 else (
                f"round {rounds[0]}" if rounds else "no round")
            lines.append(f"    {who} {reason} x{len(xs)} ({where}): {xs[0]['detail']}")
    if report.get("validator_faults"):
        lines += ["", "validators whose result differs from the certificate:"]
        for f in report["validator_faults"]:
            lines.append(f"    round {f['round']}: {f['validator'][:12]} signed "
                         f"{f['result_digest'][:12]}, certified {f['certified_digest'][:12]}")
    return "\n".join(lines)



def _policy(admission: dict[str, Any]) -> str:
    if admission.get("policy") != "bond":
        return str(admission.get("policy"))
    return (f"bond (min {admission.get('min_bond')} units, slash share "
            f"{admission.get('slash_share', 0.5)}, unbonding "
            f"{admission.get('unbonding_rounds', 2)} rounds)")


def _bond_text(b: dict[str, Any]) -> str:
    admitted = "admitted" if b["admitted"] else f"not admitted ({b.get('why_not')})"
    pending = (f", {b['withdrawal_pending']} withdrawal pending"
               if b.get("withdrawal_pending") else "")
    return (f"bond {b['bond']} units (deposited {b['deposited']}, slashed {b['slashed']}, "
            f"withdrawn {b['withdrawn']}{pending}); {admitted}")


def _bond_lines(report: dict[str, Any]) -> list[str]:
    """Each worker's bond, slashes and admission (runs with an admission policy only)."""
    admission = report.get("admission")
    if not admission:
        return []
    lines = ["", f"admission: {_policy(admission)}",
             "worker           bond  deposited   slashed  withdrawn  admitted  slashes"]
    for w in report["workers"]:
        b = w.get("bond")
        if b is None:
            continue
        slashes = ", ".join(f"r{x['round']}: -{x['amount']}" for x in b["slashes"])
        lines.append(f"{w['worker'][:12]}  {b['bond']:>7}  {b['deposited']:>9}  "
                     f"{b['slashed']:>8}  {b['withdrawn']:>9}  "
                     f"{'yes' if b['admitted'] else 'no':<8}  {slashes}")
    return lines
