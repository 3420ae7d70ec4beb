"""The ``veritrain`` command: one subcommand per job."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import errno
import json
import logging
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from veritrain.protocol.identity import Identity

#: Commands that run a node: they log what they do (INFO). The others print what their
#: user asked for; library chatter (alembic, matplotlib, aiohttp) and retries only with -v.
NODE_COMMANDS = ("ledger", "worker", "validator")


def _setup_logging(verbose: bool, command: str) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
    if verbose:
        return
    node = command in NODE_COMMANDS
    logging.getLogger("veritrain").setLevel(logging.INFO if node else logging.WARNING)
    if not node:  # a one-shot command's last line says what failed; no retry warnings
        logging.getLogger("veritrain.client").setLevel(logging.ERROR)


def _read_key(path: str) -> Identity:
    """The identity in key file ``path``; a one-line SystemExit if it cannot be used."""
    from veritrain.protocol.identity import read_key_file

    try:
        return read_key_file(Path(path))
    except FileNotFoundError:
        raise SystemExit(f"no key file {path}: create one with `veritrain keygen --role ROLE "
                         f"--out {path}`") from None
    except PermissionError as exc:
        raise SystemExit(str(exc) if exc.errno is None else
                         f"cannot read key file {path}: {exc.strerror}") from None
    except IsADirectoryError:
        raise SystemExit(f"key file {path} is a directory") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SystemExit(f"{path} is not a veritrain key file ({type(exc).__name__}: {exc}); "
                         "keys are made by `veritrain keygen`") from None


def _read_json(path: str, what: str) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except OSError as exc:
        raise SystemExit(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise SystemExit(f"{what} {path} is not JSON ({exc})") from None


def _json_option(value: str | None, option: str, default: Any) -> Any:
    if value is None:
        return default
    try:
        return json.loads(value)
    except ValueError as exc:
        raise SystemExit(f"{option} must be JSON, e.g. '{{\"bits\": 4}}' ({exc})") from None


def _check_ledger_url(url: str) -> None:
    if not url.startswith(("http://", "https://")):
        raise SystemExit(f"--ledger must be a URL such as http://127.0.0.1:8470, not {url!r}")


def cmd_keygen(args: argparse.Namespace) -> int:
    from veritrain.protocol.identity import Identity, write_key_file

    ident = Identity.generate(args.role)
    out = Path(args.out)
    try:
        write_key_file(out, ident)
    except FileExistsError:
        raise SystemExit(f"{out} exists: keygen never overwrites a key; choose another "
                         "--out") from None
    if args.inbox and args.role != "validator":
        raise SystemExit("--inbox is a validator's: where workers hand it their reveal receipts")
    public = dataclasses.replace(ident.public, inbox=args.inbox) if args.inbox else ident.public
    pub = out.with_name(out.name + ".pub.json")
    pub.write_text(json.dumps({"role": args.role, **public.to_json()}, indent=1) + "\n")
    print(f"wrote {out} (mode 0600) and {pub}")
    print(json.dumps(public.to_json()))
    return 0


def _settings_from_args(args: argparse.Namespace) -> dict[str, Any]:
    from veritrain.protocol.presets import run_preset

    settings = run_preset(args.preset)
    if args.task:
        settings["task"] = {"name": args.task,
                            "params": _json_option(args.task_params, "--task-params", {})}
    elif args.task_params:
        settings["task"]["params"] = _json_option(args.task_params, "--task-params", {})
    overrides = {
        ("inner", "steps"): args.inner_steps, ("inner", "lr"): args.inner_lr,
        ("inner", "batch_size"): args.batch_size, ("inner", "trail_every"): args.trail_every,
        ("inner", "feedback_decay"): args.feedback_decay,
        ("outer", "lr"): args.outer_lr, ("outer", "momentum"): args.outer_momentum,
        ("schedule", "round_seconds"): args.round_seconds,
        ("schedule", "max_rounds"): args.rounds,
        ("schedule", "min_submissions"): args.min_submissions,
        ("verification", "spot_checks_per_round"): args.spot_checks,
        ("verification", "tolerance"): args.tolerance,
        ("verification", "beacon"): args.beacon,
    }
    for (block, key), value in overrides.items():
        if value is not None:
            settings[block][key] = value
    if args.aggregator:
        settings["aggregator"] = {"name": args.aggregator, "params": _json_option(
            args.aggregator_params, "--aggregator-params", {})}
    if args.shards:
        settings["aggregator"]["shards"] = args.shards
    if args.shard_checkers is not None:
        settings["aggregator"]["shard_checkers"] = args.shard_checkers
    if args.codec:
        settings["codec"] = {"name": args.codec,
                             "params": _json_option(args.codec_params, "--codec-params", {})}
    from veritrain.admission import admission_settings

    admission = admission_settings(
        args.admission, min_bond=args.min_bond, slash_share=args.slash_share,
        unbonding_rounds=args.unbonding_rounds, treasury=args.treasury, issuers=args.issuer or [])
    if admission is not None:
        settings["admission"] = admission
    return settings


def cmd_run_create(args: argparse.Namespace) -> int:
    from veritrain.ledger.client import publish_run
    from veritrain.protocol.identity import PublicIdentity
    from veritrain.protocol.organiser import build_run

    _check_ledger_url(args.ledger)
    organiser = _read_key(args.key)
    validators = []
    for path in args.validator:
        data = _read_json(path, "validator identity")
        try:
            validators.append(PublicIdentity(data["ed25519"], data.get("bls"),
                                             data.get("bls_pop"), data.get("inbox")))
        except (KeyError, TypeError, AttributeError):
            raise SystemExit(f"{path} is not a validator's .pub.json (no ed25519 key); "
                             "`veritrain keygen --role validator` writes one") from None
    genesis = None
    if args.from_run:
        genesis = asyncio.run(_certified_genesis(args.ledger, args.from_run))
    try:
        bundle = build_run(organiser, args.run_id, _settings_from_args(args), validators,
                           quorum=args.quorum, genesis=genesis)
    except ValueError as exc:  # RejectedInput is one: the spec is refused before any upload
        raise SystemExit(f"cannot build run {args.run_id!r}: {exc}") from None
    reply = asyncio.run(publish_run(args.ledger, bundle))
    spec = bundle.signed.message
    print(f"created run {reply['run_id']}: task {spec.task['name']}, {spec.num_params} parameters, "
          f"dataset {spec.dataset_bytes} bytes ({spec.dataset_hash[:12]}), genesis "
          f"{spec.genesis_model_hash[:12]}, {len(spec.validators)} validator(s), quorum {spec.quorum}")
    return 0


async def _certified_genesis(ledger_url: str, run_id: str) -> bytes:
    """The newest certified model of ``run_id`` on this ledger (its certificate checked
    against that run's validators), to start a new run from: a new validator set and
    DKG, the training so far kept (specs/protocol.md 5.4a)."""
    from veritrain.ledger.client import LedgerClient, last_certified_model
    from veritrain.protocol.errors import RejectedInput

    async with LedgerClient(ledger_url, retry_for=60.0) as client:
        try:
            spec, model, state = await last_certified_model(
                client, run_id, max_model_bytes=1 << 40)
        except RejectedInput as exc:
            raise SystemExit(f"cannot start from run {run_id!r}: {exc}") from None
    print(f"starting from run {run_id}'s model certified for round {state.round} "
          f"({state.model_hash[:12]}, {len(spec.validators)} validator(s) certified it)")
    return model


def cmd_admit(args: argparse.Namespace) -> int:
    from veritrain.admission import admit, worker_key

    _check_ledger_url(args.ledger)
    key = _read_key(args.key)
    worker = worker_key(args.worker)
    if args.revoke and args.until_round is not None:
        raise SystemExit("--until-round is for a ticket, not with --revoke")
    print(asyncio.run(admit(args.ledger, key, args.run, worker, until_round=args.until_round,
                            revoke=args.revoke)))
    return 0


def cmd_bond(args: argparse.Namespace) -> int:
    from veritrain.admission import deposit, withdraw, worker_key

    _check_ledger_url(args.ledger)
    key = _read_key(args.key)
    if args.amount is not None and args.amount <= 0:
        raise SystemExit("--amount counts units: 1 or more")
    if args.bond_command == "deposit":
        if args.amount is None:
            raise SystemExit("bond deposit needs --amount B")
        line = asyncio.run(deposit(args.ledger, key, args.run, worker_key(args.worker),
                                   args.amount, args.reference))
    else:
        line = asyncio.run(withdraw(args.ledger, key, args.run, args.amount, args.round))
    print(line)
    return 0


def cmd_ledger_serve(args: argparse.Namespace) -> int:
    from sqlalchemy.exc import SQLAlchemyError

    from veritrain.ledger.retention import RetentionPolicy
    from veritrain.ledger.serve import default_db_url, serve
    from veritrain.ledger.server import LedgerConfig
    from veritrain.ledger.uploads import UploadPolicy

    data_dir = Path(args.data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    config = LedgerConfig(
        data_dir=data_dir, db_url=args.db or default_db_url(data_dir), tick_seconds=args.tick,
        ip_rate=args.ip_rate, ip_burst=args.ip_burst, key_rate=args.key_rate,
        key_burst=args.key_burst, bad_signature_burst=args.bad_signature_burst,
        uploads=UploadPolicy(idle_seconds=args.upload_idle, min_bytes_per_s=args.upload_min_rate),
        keepalive_seconds=args.keepalive,
        retention=RetentionPolicy(_audit_window(args.audit_window), keep_blobs=args.keep_blobs))
    try:
        asyncio.run(serve(config, args.host, args.port,
                          Path(args.ready_file) if args.ready_file else None))
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        raise SystemExit(f"cannot listen on {args.host}:{args.port}: the address is in use; "
                         "stop what runs there or choose another --port") from None
    except SQLAlchemyError as exc:
        raise SystemExit(f"cannot use the ledger database {config.db_url}: "
                         f"{str(exc).splitlines()[0]}") from None
    return 0


def _audit_window(value: int) -> int:
    if value < 0:
        raise SystemExit("--audit-window counts finalized rounds: 0 or more")
    return value


def cmd_ledger_prune(args: argparse.Namespace) -> int:
    from sqlalchemy.exc import SQLAlchemyError
    from sqlalchemy.orm import sessionmaker

    from veritrain.ledger import migrate
    from veritrain.ledger.blobs import BlobStore
    from veritrain.ledger.retention import RetentionPolicy, prune
    from veritrain.ledger.serve import default_db_url
    from veritrain.ledger.store import make_engine

    data_dir = Path(args.data_dir)
    if not (data_dir / "blobs").is_dir():
        raise SystemExit(f"{data_dir} holds no ledger blobs (no {data_dir / 'blobs'}); "
                         "give the --data-dir of `veritrain ledger serve`")
    url = args.db or default_db_url(data_dir)
    policy = RetentionPolicy(_audit_window(args.audit_window))
    try:
        engine = make_engine(url)
        migrate.upgrade(engine)
        try:
            report = prune(sessionmaker(engine, expire_on_commit=False),
                           BlobStore(data_dir / "blobs", owner=False), policy, dry_run=args.dry_run,
                           run_id=args.run)
        finally:
            engine.dispose()
    except SQLAlchemyError as exc:
        raise SystemExit(f"cannot use the ledger database {url}: "
                         f"{str(exc).splitlines()[0]}") from None
    for line in report.lines():
        print(line)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from veritrain.workers.node import WorkerConfig, WorkerNode

    _check_ledger_url(args.ledger)
    identity = _read_key(args.key)
    _check_device(args.device)
    state_dir = Path(args.state_dir) if args.state_dir else (
        Path.home() / ".veritrain" / f"worker-{identity.public_key.hex()[:16]}")
    config = WorkerConfig(ledger_url=args.ledger, state_dir=state_dir, run_id=args.run,
                          device=args.device, attack=args.attack, retry_for=args.retry_for,
                          progress=not args.no_progress, keep_every=args.keep_every,
                          stats_path=Path(args.stats) if args.stats else None)
    count = asyncio.run(WorkerNode(config, identity).run(max_rounds=args.max_rounds))
    print(f"worker done: {count} submission(s)")
    return 0


def cmd_validator(args: argparse.Namespace) -> int:
    from veritrain.validators.node import ValidatorConfig, ValidatorNode

    _check_ledger_url(args.ledger)
    identity = _read_key(args.key)
    _check_device(args.device)
    state_dir = Path(args.state_dir) if args.state_dir else (
        Path.home() / ".veritrain" / f"validator-{identity.public_key.hex()[:16]}")
    config = ValidatorConfig(ledger_url=args.ledger, run_id=args.run, device=args.device,
                             retry_for=args.retry_for, shard_wait=args.shard_wait,
                             attack=args.attack, state_dir=state_dir,
                             inbox_listen=args.inbox_listen,
                             stats_path=Path(args.stats) if args.stats else None)
    asyncio.run(ValidatorNode(config, identity).run(max_rounds=args.max_rounds))
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    if args.what != "verify" and not args.ledger:
        raise SystemExit("--ledger is required (only `verify --export FILE` works offline)")
    if args.ledger and not args.export:
        _check_ledger_url(args.ledger)
    if args.what == "recheck":
        from veritrain.validators.recheck import run_recheck

        return asyncio.run(run_recheck(args))
    from veritrain.ledger.audit import run_audit

    return asyncio.run(run_audit(args))


def cmd_demo(args: argparse.Namespace) -> int:
    from veritrain.demo import run_demo

    return run_demo(args)


def _check_device(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda given but torch sees no CUDA device")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="veritrain",
        description="Byzantine-robust, verifiable DiLoCo-style training with an auditable ledger.",
    )
    p.add_argument("-v", "--verbose", action="store_true",
                   help="debug logging, library logs, and the traceback of a failure")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # -v also after the subcommand (``veritrain audit report -v``).
    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                         help="debug logging, library logs, and the traceback of a failure")

    k = sub.add_parser("keygen", parents=[verbose],
                       help="create a key file (mode 0600) and its public identity",
                       description="Write a new Ed25519 key (and, for validators, a BLS12-381 "
                       "key with proof of possession) to OUT, plus OUT.pub.json for sharing.")
    k.add_argument("--role", choices=["worker", "validator", "organiser"], required=True)
    k.add_argument("--out", required=True, help="key file to create (never overwritten)")
    k.add_argument("--inbox", metavar="URL",
                   help="validators: the http(s) URL where workers hand this validator their "
                   "reveal receipts past the ledger (written to OUT.pub.json, so the run spec "
                   "names it; `veritrain validator` listens there)")
    k.set_defaults(func=cmd_keygen)

    run = sub.add_parser("run", help="organiser commands").add_subparsers(
        dest="run_command", required=True, metavar="SUBCOMMAND")
    c = run.add_parser("create", parents=[verbose], help="define a run and publish it to a ledger",
                       description="Pack the dataset, build the genesis model, sign the run "
                       "spec with the organiser key and upload all three to the ledger.")
    c.add_argument("--ledger", required=True, help="ledger URL, e.g. http://127.0.0.1:8470")
    c.add_argument("--key", required=True, help="organiser key file")
    c.add_argument("--run-id", required=True, help="run name: lowercase letters, digits, '-'")
    c.add_argument("--validator", action="append", required=True, metavar="PUB_JSON",
                   help="a validator's .pub.json (repeat for each validator)")
    c.add_argument("--quorum", type=int, help="signatures per certificate (default ceil(2n/3))")
    c.add_argument("--preset", default="demo", choices=["tiny", "demo", "bench"],
                   help="starting settings (default demo)")
    c.add_argument("--task", help="task name: charlm, synthetic or module:function")
    c.add_argument("--task-params", help="task parameters as JSON")
    c.add_argument("--inner-steps", type=int, help="H: inner AdamW steps per round")
    c.add_argument("--inner-lr", type=float, help="inner AdamW learning rate")
    c.add_argument("--batch-size", type=int, help="examples per inner step")
    c.add_argument("--trail-every", type=int, help="k: steps between trail hashes")
    c.add_argument("--outer-lr", type=float, help="outer Nesterov learning rate")
    c.add_argument("--outer-momentum", type=float, help="outer Nesterov momentum")
    c.add_argument("--round-seconds", type=float, help="round deadline in seconds")
    c.add_argument("--rounds", type=int, help="number of rounds")
    c.add_argument("--min-submissions", type=int, help="submissions needed to close a round")
    c.add_argument("--spot-checks", type=int, help="workers recomputed per round")
    c.add_argument("--tolerance", type=float, help="spot-check relative distance tolerance")
    c.add_argument("--from-run", metavar="RUN",
                   help="start from the newest model RUN's validators certified on this "
                   "ledger (its certificate checked) instead of a fresh one: how a run "
                   "changes its validator set (a new run, a new DKG, the training kept)")
    c.add_argument("--beacon", choices=["shares", "threshold"], default="threshold",
                   help="each round's challenge seed: the threshold signature of a key the "
                   "validators make by a DKG when they start (threshold, the default: the "
                   "same seed whichever quorum signs; specs/protocol.md 5.4a) or a hash of "
                   "a quorum of the validators' BLS shares (shares: the ledger picks which "
                   "quorum, 5.4)")
    c.add_argument("--aggregator", help="robust aggregator name (default centered_clip)")
    c.add_argument("--aggregator-params", help="aggregator parameters as JSON")
    c.add_argument("--shards", type=int,
                   help="split the aggregation into one coordinate shard per validator "
                   "(must equal the number of validators; centered_clip only)")
    c.add_argument("--shard-checkers", type=int, metavar="K",
                   help="with --shards and --beacon threshold: K validators drawn from each "
                   "round's beacon check each shard and the others take their signed word "
                   "(default: every other validator checks every shard)")
    c.add_argument("--codec", help="payload codec name (default int4)")
    c.add_argument("--codec-params", help="codec parameters as JSON, e.g. "
                   '\'{"rank": 8, "bits": 3, "layout": "model"}\' for lowrank')
    c.add_argument("--feedback-decay", type=float,
                   help="share of the error-feedback residual workers keep each round (default 1)")
    c.add_argument("--admission", choices=["open", "allowlist", "bond"],
                   help="who may work: anyone (open, the default), keys with a ticket "
                   "(`veritrain admit`), or keys with a bond (`veritrain bond deposit`)")
    c.add_argument("--min-bond", type=int, metavar="B",
                   help="bond: units a worker's bond must hold to be admitted")
    c.add_argument("--slash-share", type=float,
                   help="bond: share of the bond a failed check takes (default 0.5)")
    c.add_argument("--unbonding-rounds", type=int, metavar="R",
                   help="bond: rounds ahead a withdrawal takes effect (default 2)")
    c.add_argument("--treasury", metavar="KEY",
                   help="bond: key (hex or .pub.json) whose deposits count (default: the "
                   "organiser's)")
    c.add_argument("--issuer", action="append", metavar="KEY",
                   help="allowlist: another key (hex or .pub.json) whose tickets count "
                   "(repeat)")
    c.set_defaults(func=cmd_run_create)

    ad = sub.add_parser("admit", parents=[verbose],
                        help="admit a worker to an allowlist run (or revoke it)",
                        description="Sign an admission ticket for --worker with the organiser "
                        "(or a delegated issuer) key and post it to the ledger: it admits the "
                        "key from the first round not yet closed up to --until-round. With "
                        "--revoke, end every earlier ticket of the worker instead.")
    ad.add_argument("--ledger", required=True, help="ledger URL")
    ad.add_argument("--key", required=True, help="organiser (or issuer) key file")
    ad.add_argument("--run", help="run id (default: the ledger's only active run)")
    ad.add_argument("--worker", required=True, help="worker key: hex or its .pub.json")
    ad.add_argument("--until-round", type=int, metavar="R",
                    help="the ticket's expiry: it admits rounds before R (default: the "
                    "run's last round)")
    ad.add_argument("--revoke", action="store_true", help="revoke the worker's tickets")
    ad.set_defaults(func=cmd_admit)

    bond = sub.add_parser("bond", help="bond commands (runs with --admission bond)"
                          ).add_subparsers(dest="bond_command", required=True,
                                           metavar="SUBCOMMAND")
    bd = bond.add_parser("deposit", parents=[verbose], help="record a deposit to a bond",
                         description="Sign, with the run's treasury key, a deposit of --amount "
                         "units to --worker's bond and post it to the ledger (how the money "
                         "moved is recorded only as --reference).")
    bw = bond.add_parser("withdraw", parents=[verbose], help="withdraw a worker's own bond",
                         description="Sign, with the worker's key, a withdrawal from its bond, "
                         "effective after the run's unbonding period; refused while one of "
                         "its rounds is pending its checks.")
    for b in (bd, bw):
        b.add_argument("--ledger", required=True, help="ledger URL")
        b.add_argument("--run", help="run id (default: the ledger's only active run)")
        b.add_argument("--amount", type=int, metavar="B", help="units")
        b.set_defaults(func=cmd_bond)
    bd.add_argument("--key", required=True, help="treasury (by default organiser) key file")
    bd.add_argument("--worker", required=True, help="worker key: hex or its .pub.json")
    bd.add_argument("--reference", default="", help="the treasury's record of the payment")
    bw.add_argument("--key", required=True, help="the worker's key file")
    bw.add_argument("--round", type=int, metavar="R",
                    help="round it takes effect (default: the earliest allowed)")

    led = sub.add_parser("ledger", help="ledger commands").add_subparsers(
        dest="ledger_command", required=True, metavar="SUBCOMMAND")
    s = led.add_parser("serve", parents=[verbose], help="run the ledger HTTP server",
                       description="Serve the ledger API on HOST:PORT, storing rows in a "
                       "SQLite file under --data-dir (or --db URL) and blobs beside it.")
    s.add_argument("--data-dir", default="veritrain-ledger", help="rows, blobs and ledger key")
    s.add_argument("--db", help="SQLAlchemy URL (default: SQLite file in --data-dir)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8470, help="0 lets the OS choose")
    s.add_argument("--tick", type=float, default=0.2, help="seconds between deadline checks")
    s.add_argument("--ready-file", help="write {url, ledger_key} here once listening")
    s.add_argument("--ip-rate", type=float, default=200.0,
                   help="requests per second per client address (0: no limit)")
    s.add_argument("--ip-burst", type=float, default=400.0)
    s.add_argument("--key-rate", type=float, default=5.0,
                   help="signed writes per second per key (0: no limit)")
    s.add_argument("--key-burst", type=float, default=20.0)
    s.add_argument("--bad-signature-burst", type=float, default=5.0,
                   help="BLS signatures that fail to verify one key may send before it waits "
                        "a minute per further try (0: no limit)")
    s.add_argument("--upload-idle", type=float, default=30.0,
                   help="seconds a request body may pause before it is cut off")
    s.add_argument("--upload-min-rate", type=float, default=16384.0,
                   help="bytes per second a body must average after a 10 s grace")
    s.add_argument("--keepalive", type=float, default=30.0,
                   help="seconds an idle connection, or one whose headers never finish, is kept")
    s.add_argument("--audit-window", type=int, default=2, metavar="ROUNDS",
                   help="delete a round's reveal files and superseded models once ROUNDS more "
                   "rounds are finalized (default 2; the chain, payloads, the evidence of "
                   "failed checks and the models nodes need are kept)")
    s.add_argument("--keep-blobs", action="store_true",
                   help="never delete a blob file (no pruning at all)")
    s.set_defaults(func=cmd_ledger_serve)

    pr = led.add_parser("prune", parents=[verbose],
                        help="delete old reveal files and superseded models now",
                        description="Apply the retention policy to a ledger's data "
                        "directory now (the server also does after each finalized round): "
                        "record, then delete, the reveal files and superseded models of "
                        "rounds with --audit-window finalized rounds after them, and print "
                        "the bytes freed and kept.")
    pr.add_argument("--data-dir", default="veritrain-ledger",
                    help="the ledger's data directory (as for serve)")
    pr.add_argument("--db", help="SQLAlchemy URL (default: SQLite file in --data-dir)")
    pr.add_argument("--audit-window", type=int, default=2, metavar="ROUNDS",
                    help="finalized rounds a round's files outlive it (default 2)")
    pr.add_argument("--run", help="only this run")
    pr.add_argument("--dry-run", action="store_true",
                    help="print what would go; delete and record nothing")
    pr.set_defaults(func=cmd_ledger_prune)

    for name, func, helptext in (
        ("worker", cmd_worker, "join a run: train, submit signed pseudo-gradients"),
        ("validator", cmd_validator, "check, spot-check, aggregate and certify rounds"),
    ):
        n = sub.add_parser(name, parents=[verbose], help=helptext, description=helptext)
        n.add_argument("--ledger", required=True, help="ledger URL")
        n.add_argument("--key", required=True, help="key file (veritrain keygen)")
        n.add_argument("--run", help="run id (default: the ledger's only active run)")
        n.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
        n.add_argument("--max-rounds", type=int, help="stop after this many rounds")
        n.add_argument("--retry-for", type=float, default=300.0,
                       help="seconds to keep retrying an unreachable ledger")
        n.add_argument("--stats", metavar="FILE",
                       help="write the bytes sent and received by kind and each round's "
                       "timings to FILE (JSON, rewritten every round)")
        if name == "worker":
            n.add_argument("--keep-every", type=int, metavar="N",
                           help="keep every N-th step's whole training state on disk for "
                           "spot checks (default: every 8th, rounded up to a multiple of the "
                           "run's trail_every); a challenged step between kept states is "
                           "recomputed")
            n.add_argument("--state-dir", help="receipts and error feedback "
                           "(default ~/.veritrain/worker-<key>)")
            n.add_argument("--no-progress", action="store_true", help="no progress bar")
            n.add_argument("--attack", choices=["free_rider", "sign_flip", "drop_after_deal",
                                                "forge_reveal"],
                           help="evaluation only: behave as this kind of cheater")
        else:
            n.add_argument("--state-dir", help="the lists this validator signed and its "
                           "secret beacon key shares, kept across restarts (default "
                           "~/.veritrain/validator-<key>)")
            n.add_argument("--shard-wait", type=float, default=120.0,
                           help="sharded runs: seconds to wait for the other validators' "
                           "shards before they are recomputed")
            n.add_argument("--inbox-listen", metavar="HOST:PORT",
                           help="where the reveal-receipt inbox listens, when not at the "
                           "host and port of this validator's inbox URL in the run spec")
            n.add_argument("--attack", choices=["shard_shift"],
                           help="evaluation only: publish this validator's shard shifted "
                           "by 0.1%%, which the others must catch")
        n.set_defaults(func=func)

    a = sub.add_parser("audit", parents=[verbose], help="read and verify a run's ledger",
                       description="Show a run's report, one worker's history or one round, "
                       "verify the hash chain, signatures and certificates, or re-run a "
                       "recorded spot check from the stored evidence.")
    a.add_argument("--ledger", help="ledger URL (not needed with --export)")
    a.add_argument("--export", metavar="FILE", help="verify: check this export file offline")
    a.add_argument("--save", metavar="FILE", help="download the run's signed export to FILE")
    a.add_argument("--full", action="store_true",
                   help="verify: also check every Ed25519 signature (all cores)")
    a.add_argument("--run", help="run id (default: the ledger's only run)")
    a.add_argument("what", nargs="?", default="report",
                   choices=["report", "worker", "round", "verify", "recheck", "receipt"],
                   help="recheck ROUND --worker KEY re-runs that worker's recorded spot checks; "
                        "receipt FILE says whether the ledger honoured a receipt a worker kept")
    a.add_argument("arg", nargs="?", help="worker key (prefix), round number or receipt file")
    a.add_argument("--worker", help="worker key prefix (for recheck)")
    a.add_argument("--json", action="store_true",
                   help="print the API's JSON instead of tables (for scripts)")
    a.add_argument("--retry-for", type=float, default=10.0, metavar="SECONDS",
                   help="how long to retry an unreachable ledger (default 10)")
    a.set_defaults(func=cmd_audit)

    d = sub.add_parser("demo", parents=[verbose],
                       help="the whole swarm on this machine, with cheaters",
                       description="Start a ledger, a validator and N workers (two of them "
                       "cheating) as processes on loopback, train charlm, and report.")
    d.add_argument("--workers", type=int, default=6)
    d.add_argument("--rounds", type=int, default=8)
    d.add_argument("--validators", type=int, default=3,
                   help="validators; two thirds of them certify each round")
    d.add_argument("--preset", default="demo", choices=["tiny", "demo", "bench"])
    d.add_argument("--out", default="demo-out", help="folder for the report, plot and logs")
    d.add_argument("--no-clean-run", action="store_true",
                   help="skip the reference run without cheaters")
    d.add_argument("--no-undefended", action="store_true",
                   help="skip the in-process run of the same cheaters with no defence "
                   "(plain mean, no checks) that the plot compares with")
    d.add_argument("--device", default="cpu")
    d.add_argument("--sharded", action="store_true",
                   help="validators aggregate one coordinate shard each and check the others")
    d.add_argument("--shard-cheater", action="store_true",
                   help="with --sharded: the last validator shifts its shard by 0.1%%")
    d.add_argument("--shard-checkers", type=int, default=0, metavar="K",
                   help="with --sharded: K checkers per shard drawn from the check seed "
                   "(default: every other validator)")
    d.add_argument("--masked-buckets", type=int, default=0, metavar="S",
                   help="workers hide their updates in masked buckets of S (validators see "
                   "bucket sums only; half the workers are opened by spot checks each round; "
                   "the two cheaters need --workers of at least 5 S)")
    d.add_argument("--beacon", choices=["shares", "threshold"], default="threshold",
                   help="challenge seeds from the validators' DKG key (threshold, the "
                   "default) or from a quorum of their BLS shares (shares)")
    d.add_argument("--admission", default="open", choices=["open", "allowlist", "bond"],
                   help="who may work: anyone (default); keys the organiser signed a ticket "
                   "(allowlist); keys with a bond the treasury recorded (bond: a caught "
                   "cheater loses half of it and with it its place in the run)")
    d.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command; a failure ends in one line on stderr (the traceback with -v)."""
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose, args.command)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            raise
        return _failed(args, exc)
    except Exception as exc:
        return _failed(args, exc)


def _failed(args: argparse.Namespace, exc: BaseException) -> int:
    from veritrain.failures import failure_line

    if args.verbose:
        traceback.print_exc()
    command = " ".join(c for c in (args.command, getattr(args, "run_command", None),
                                   getattr(args, "ledger_command", None),
                                   getattr(args, "bond_command", None)) if c)
    print(f"veritrain {command}: {failure_line(exc)}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
