#!/usr/bin/env bash
# Set up this checkout and run it.
#   ./dev.sh up [aisynergy up options]   virtualenv + Mosquitto, then the local stack (hub on SQLite, broker, edge agent)
#   ./dev.sh test [pytest options]       virtualenv + Mosquitto + PostgreSQL + Chromium, then the whole test suite
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
VENV=${AISYNERGY_VENV:-.venv}

need_root_apt() {  # install Debian packages when missing (needs root and apt-get)
  local missing=()
  for spec in "$@"; do
    local bin=${spec%%:*} pkg=${spec##*:}
    command -v "$bin" >/dev/null 2>&1 || [ -x "/usr/sbin/$bin" ] || [ -x "/usr/lib/postgresql/15/bin/$bin" ] || missing+=("$pkg")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
    echo "missing system packages: ${missing[*]} (install them, e.g. apt-get install ${missing[*]})" >&2
    exit 1
  fi
  echo "installing ${missing[*]}" >&2
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
}

venv() {  # $1: extras
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  local stamp="$VENV/.aisynergy-$1" want
  want=$(sha256sum pyproject.toml | cut -c1-16)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q -e ".[$1]"
    echo "$want" > "$stamp"
  fi
}

start_postgres() {  # a throwaway cluster in a temp dir, owned by user postgres; sets AISYNERGY_TEST_POSTGRES_URL
  local bin=/usr/lib/postgresql/15/bin port
  PGTMP=$(mktemp -d /tmp/aisynergy-pg.XXXXXX)
  port=$("$VENV/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  if [ "$(id -u)" -eq 0 ]; then
    chown postgres:postgres "$PGTMP"
    RUNPG=(runuser -u postgres --)
  else
    RUNPG=()
  fi
  "${RUNPG[@]}" "$bin/initdb" -D "$PGTMP/data" -U postgres --auth=trust -E UTF8 >/dev/null
  "${RUNPG[@]}" "$bin/pg_ctl" -D "$PGTMP/data" -l "$PGTMP/log" -w \
    -o "-p $port -k $PGTMP -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=300" start >/dev/null
  export AISYNERGY_TEST_POSTGRES_URL="postgresql://postgres@127.0.0.1:$port/postgres"
  trap stop_postgres EXIT
}

stop_postgres() {
  "${RUNPG[@]}" /usr/lib/postgresql/15/bin/pg_ctl -D "$PGTMP/data" -m fast stop >/dev/null 2>&1 || true
  rm -rf "$PGTMP"
}

cmd=${1:-}
shift || true
case "$cmd" in
  up)
    need_root_apt mosquitto:mosquitto
    venv hub,edge,device
    exec "$VENV/bin/aisynergy" up "$@"
    ;;
  test)
    need_root_apt mosquitto:mosquitto initdb:postgresql-15 chromium:chromium chromedriver:chromium-driver jq:jq  # the console's browser tests; jq: the README's curl example
    venv dev
    start_postgres
    "$VENV/bin/aisynergy" contracts check
    set +e
    "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
    rc=$?
    set -e
    [ $rc -eq 5 ] && { echo "no tests were collected" >&2; exit 1; }
    exit $rc
    ;;
  *)
    echo "usage: ./dev.sh up [options] | ./dev.sh test [pytest options]" >&2
    exit 2
    ;;
esac
