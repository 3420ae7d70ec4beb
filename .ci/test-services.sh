# Test services for `./dev test` (sourced): a throwaway PostgreSQL server for the
# ledger's PostgreSQL leg and the Chromium that renders the ledger's web page.
# Both are best effort: without apt (or root) the note says what is skipped.
#
#   services_start   sets VERITRAIN_TEST_PG_URL unless it is already set
#   services_stop    stops the server and removes its directory

_note() { echo "dev: $*" >&2; }

_apt_install() {  # _apt_install PACKAGE... (root and apt-get only; quiet)
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 || return 1
  if [ -z "${_APT_UPDATED:-}" ]; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null 2>&1 || return 1
    _APT_UPDATED=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" \
    >/dev/null 2>&1
}

_pg_bin() {
  local d best=""
  for d in /usr/lib/postgresql/*/bin; do
    [ -x "$d/initdb" ] && best="$d"
  done
  echo "$best"
}

_pg_start() {
  if [ -n "${VERITRAIN_TEST_PG_URL:-}" ]; then
    _note "PostgreSQL tests use VERITRAIN_TEST_PG_URL as given"
    return 0
  fi
  local bin
  bin=$(_pg_bin)
  if [ -z "$bin" ]; then
    _note "installing PostgreSQL (apt-get install postgresql) for the ledger's PostgreSQL tests"
    _apt_install postgresql || true
    bin=$(_pg_bin)
  fi
  if [ -z "$bin" ]; then
    _note "no PostgreSQL here and it could not be installed: PostgreSQL tests will skip"
    return 0
  fi
  PG_DIR=$(mktemp -d /tmp/veritrain-pg.XXXXXX)
  PG_BIN=$bin
  PG_AS=()
  if [ "$(id -u)" = 0 ]; then  # the server refuses to run as root
    if ! id postgres >/dev/null 2>&1 || ! command -v runuser >/dev/null 2>&1; then
      _note "running as root without a postgres user: PostgreSQL tests will skip"
      rm -rf "$PG_DIR"; PG_DIR=""
      return 0
    fi
    chown postgres "$PG_DIR"
    PG_AS=(runuser -u postgres --)
  fi
  local port
  port=$("${PYTHON:-python3}" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  if "${PG_AS[@]}" "$bin/initdb" -D "$PG_DIR/data" -U veritrain --auth=trust -E UTF8 \
        >"$PG_DIR/initdb.log" 2>&1 \
     && "${PG_AS[@]}" "$bin/pg_ctl" -D "$PG_DIR/data" -l "$PG_DIR/server.log" -w -t 60 \
        -o "-c listen_addresses=127.0.0.1 -p $port -k $PG_DIR -c fsync=off" start >/dev/null \
     && "${PG_AS[@]}" "$bin/createdb" -h 127.0.0.1 -p "$port" -U veritrain veritrain_test; then
    export VERITRAIN_TEST_PG_URL="postgresql+psycopg://veritrain@127.0.0.1:$port/veritrain_test"
    _note "PostgreSQL $("$bin/postgres" --version | awk '{print $3}') on port $port for the ledger tests"
  else
    _note "PostgreSQL did not start (see below): PostgreSQL tests will skip"
    tail -5 "$PG_DIR"/*.log >&2 2>/dev/null || true
    _pg_stop
  fi
}

_pg_stop() {
  if [ -n "${PG_DIR:-}" ]; then
    "${PG_AS[@]}" "$PG_BIN/pg_ctl" -D "$PG_DIR/data" -m fast stop >/dev/null 2>&1 || true
    rm -rf "$PG_DIR"
    PG_DIR=""
  fi
}

_chromium_check() {
  if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
    _note "installing Chromium (apt-get install chromium) for the ledger's web page test"
    _apt_install chromium || _note "no Chromium here: the web page test will skip"
  fi
}

services_start() {
  _pg_start
  _chromium_check
}

services_stop() {
  _pg_stop
}
