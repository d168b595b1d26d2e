#!/usr/bin/env bash
# services.sh — private PostgreSQL 15, RabbitMQ and Babelfish (a T-SQL engine) for development
# and tests.
#
#   scripts/services.sh start     install missing packages, start all three (idempotent, fast when up)
#   scripts/services.sh stop      stop them
#   scripts/services.sh status    print their state (exit 0 only when all run)
#   scripts/services.sh env       shell exports: eval "$(scripts/services.sh env)"
#   scripts/services.sh rabbitmqctl ARGS...   rabbitmqctl against the private node
#
# State lives in <repo>/.services/ (override with OUTBOX_SERVICES_DIR): data, logs, sockets and
# the ports picked at first start (ports.env). Nothing system-wide is started or changed, except
# that missing Debian packages are installed and psqlODBC is registered with unixODBC if absent.
#
# Babelfish for PostgreSQL (T-SQL over TDS, SQL Server's wire protocol) comes from the prebuilt
# tarball in OUTBOX_BABELFISH_TARBALL (default: ../shared/babelfish/babelfish-*.tar.xz beside the
# repository); it is unpacked under .services/babelfish and reached with FreeTDS's ODBC driver.
# Its T-SQL database for the tests is `outbox_test`.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SVC=${OUTBOX_SERVICES_DIR:-$ROOT/.services}
PKG_LIST=$ROOT/scripts/packages.txt
PORTS=$SVC/ports.env
READY_TIMEOUT=${OUTBOX_SERVICES_TIMEOUT:-60}

PG_DATA=$SVC/pg
PG_SOCK=$SVC/pgsock
PG_LOG=$SVC/pg.log

RMQ_DIR=$SVC/rabbitmq
RMQ_HOME=$RMQ_DIR/home
RMQ_LOG=$SVC/rabbitmq.log
RMQ_OUT=$SVC/rabbitmq-console.log
RMQ_PIDFILE=$RMQ_DIR/rabbitmq.pid

BBF_DIR=$SVC/babelfish
BBF_DATA=$BBF_DIR/data
BBF_LOG=$SVC/babelfish.log
BBF_LOGIN=babelfish_user
BBF_PASSWORD=Babelfish-Pass1
BBF_DB=outbox_test

die() { echo "services.sh: $*" >&2; exit 1; }
note() { echo "services.sh: $*" >&2; }

# ---------------------------------------------------------------- packages
packages() { grep -v '^[[:space:]]*\(#\|$\)' "$PKG_LIST" | awk '{print $1}'; }

ensure_packages() {
    local missing=() p st
    command -v dpkg-query >/dev/null || { note "not a Debian system; skipping package check"; return 0; }
    # installed, or installed with its triggers still to run: another apt-get or dpkg at
    # work beside us (the package tests of the other CI run) leaves man-db that way for a
    # moment (and half-configured while its triggers run: apt-get then waits for dpkg's
    # lock, DPkg::Lock::Timeout, and finds it installed)
    while read -r p; do
        st=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
        [[ $st =~ ^install\ ok\ (installed|triggers-pending|triggers-awaited)$ ]] || missing+=("$p")
    done < <(packages)
    ((${#missing[@]} == 0)) && return 0
    [[ $(id -u) == 0 ]] || die "missing packages (${missing[*]}); run as root or: sudo apt-get install -y ${missing[*]}"
    note "installing missing packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get -o DPkg::Lock::Timeout=300 update -q
    apt-get -o DPkg::Lock::Timeout=300 install -y -q --no-install-recommends "${missing[@]}"
}

ensure_odbc_driver() {
    command -v odbcinst >/dev/null || { note "odbcinst not found; skipping ODBC driver check"; return 0; }
    if odbcinst -q -d 2>/dev/null | grep -qx '\[PostgreSQL Unicode\]'; then
        return 0
    fi
    local so
    so=$(find /usr/lib -name psqlodbcw.so 2>/dev/null | head -n1)
    [[ -n $so ]] || die "psqlODBC (psqlodbcw.so) not found; is odbc-postgresql installed?"
    [[ $(id -u) == 0 ]] || die "ODBC driver 'PostgreSQL Unicode' not registered; run as root to register it"
    note "registering ODBC driver 'PostgreSQL Unicode' ($so)"
    local tmpl
    tmpl=$(mktemp)
    printf '[PostgreSQL Unicode]\nDescription=PostgreSQL ODBC driver (Unicode version)\nDriver=%s\n' "$so" > "$tmpl"
    odbcinst -i -d -f "$tmpl" >/dev/null
    rm -f "$tmpl"
    odbcinst -q -d | grep -qx '\[PostgreSQL Unicode\]' || die "could not register ODBC driver 'PostgreSQL Unicode'"
}

# ---------------------------------------------------------------- ports
port_free() {  # port_free PORT → 0 when nothing listens on 127.0.0.1:PORT
    /usr/bin/python3 - "$1" <<'EOF'
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError:
    sys.exit(1)
EOF
}

pick_ports() {  # six distinct free ports outside the ephemeral range, none another set of
                # this repository's services has picked (.services*/ports.env)
    /usr/bin/python3 - "$ROOT"/.services*/ports.env <<'EOF'
import random, re, socket, sys
taken = set()
for path in sys.argv[1:]:
    try:
        taken.update(int(p) for p in re.findall(r"(?m)^\w+_PORT=(\d+)$", open(path).read()))
    except OSError:
        pass
got = []
while len(got) < 6:
    p = random.randint(20000, 29999)
    if p in got or p in taken or p == 25672:
        continue
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", p))
    except OSError:
        continue
    finally:
        s.close()
    got.append(p)
print("PG_PORT=%d\nAMQP_PORT=%d\nDIST_PORT=%d\nEPMD_PORT=%d\nBBF_PG_PORT=%d\nBBF_TDS_PORT=%d"
      % tuple(got))
EOF
}

load_ports() {
    [[ -f $PORTS ]] || return 1
    # shellcheck disable=SC1090
    source "$PORTS"
    [[ -n ${BBF_TDS_PORT:-} ]] || return 1   # written by a version without Babelfish
    RMQ_NODE=outbox-test-$AMQP_PORT@localhost
}

ensure_ports() {
    if ! load_ports; then
        pick_ports > "$PORTS.tmp"
        mv "$PORTS.tmp" "$PORTS"
        load_ports
    fi
}

# ---------------------------------------------------------------- postgres
PG_BIN=${PG_BINDIR:-/usr/lib/postgresql/15/bin}
if [[ ! -x $PG_BIN/pg_ctl ]]; then
    # fall back to the newest installed major version
    for d in $(printf '%s\n' /usr/lib/postgresql/*/bin | sort -V -r); do
        [[ -x $d/pg_ctl ]] && { PG_BIN=$d; break; }
    done
fi

as_pg() {  # run a postgres binary as the postgres OS user when we are root
    if [[ $(id -u) == 0 ]]; then
        (cd "$SVC" && runuser -u postgres -- "$@" 9>&-)
    else
        (cd "$SVC" && "$@" 9>&-)
    fi
}

pg_running() {
    [[ -f $PG_DATA/PG_VERSION ]] || return 1
    as_pg "$PG_BIN/pg_ctl" -D "$PG_DATA" status >/dev/null 2>&1
}

pg_ready() { pg_isready -q -h 127.0.0.1 -p "$PG_PORT" -U postgres -d postgres -t 2 >/dev/null 2>&1; }

pg_init() {
    [[ -f $PG_DATA/PG_VERSION ]] && return 0
    note "initdb $PG_DATA"
    rm -rf "$PG_DATA"
    mkdir -p "$PG_DATA" "$PG_SOCK"
    touch "$PG_LOG"
    if [[ $(id -u) == 0 ]]; then chown postgres:postgres "$PG_DATA" "$PG_SOCK" "$PG_LOG"; fi
    chmod 700 "$PG_DATA"
    as_pg "$PG_BIN/initdb" -D "$PG_DATA" -U postgres --auth=trust -E UTF8 --locale=C.UTF-8 \
        >"$SVC/initdb.log" 2>&1 || { tail -n 30 "$SVC/initdb.log" >&2; die "initdb failed"; }
    cat >> "$PG_DATA/postgresql.conf" <<EOF

# --- outbox-relay test cluster (scripts/services.sh) ---
listen_addresses = '127.0.0.1'
port = $PG_PORT
unix_socket_directories = '$PG_SOCK'
max_connections = 200
max_prepared_transactions = 10   # the health tests prepare one (it holds the xmin horizon)
shared_preload_libraries = 'pg_stat_statements'
fsync = off                      # test cluster: survives process crashes, not OS crashes
full_page_writes = off
log_line_prefix = '%m [%p] %q%u@%d '
log_min_messages = warning
log_connections = off
EOF
}

pg_start() {
    pg_init
    # the remembered port may have been re-set when ports.env was recreated
    sed -i "s/^port = .*/port = $PG_PORT/" "$PG_DATA/postgresql.conf"
    if pg_running && pg_ready; then return 0; fi
    if ! pg_running; then
        port_free "$PG_PORT" || die "PostgreSQL port $PG_PORT is taken by something else (remove $PORTS to pick new ports)"
        mkdir -p "$PG_SOCK"; touch "$PG_LOG"
        if [[ $(id -u) == 0 ]]; then chown postgres:postgres "$PG_SOCK" "$PG_LOG"; fi
        note "starting PostgreSQL on 127.0.0.1:$PG_PORT"
        as_pg "$PG_BIN/pg_ctl" -D "$PG_DATA" -l "$PG_LOG" -w -t "$READY_TIMEOUT" start >/dev/null 2>&1 || {
            tail -n 50 "$PG_LOG" >&2
            die "PostgreSQL did not start (log: $PG_LOG)"
        }
    fi
    local deadline=$((SECONDS + READY_TIMEOUT))
    until pg_ready; do
        if ((SECONDS >= deadline)); then
            tail -n 50 "$PG_LOG" >&2
            die "PostgreSQL not ready on port $PG_PORT after ${READY_TIMEOUT}s (log: $PG_LOG)"
        fi
        sleep 0.2
    done
}

pg_stop() {
    if pg_running; then
        note "stopping PostgreSQL"
        as_pg "$PG_BIN/pg_ctl" -D "$PG_DATA" -m fast -w -t 60 stop >/dev/null
    fi
}

# ---------------------------------------------------------------- rabbitmq
RMQ_LIBBIN=/usr/lib/rabbitmq/bin   # Debian's /usr/sbin wrappers would su to the rabbitmq user
rmq_bin() {
    if [[ -x $RMQ_LIBBIN/$1 ]]; then echo "$RMQ_LIBBIN/$1"; else command -v "$1"; fi
}

rmq_env() {  # the environment of the private node, for the server and its CLI tools
    export HOME=$RMQ_HOME
    export RABBITMQ_NODENAME=$RMQ_NODE
    export RABBITMQ_NODE_IP_ADDRESS=127.0.0.1
    export RABBITMQ_NODE_PORT=$AMQP_PORT
    export RABBITMQ_DIST_PORT=$DIST_PORT
    export ERL_EPMD_PORT=$EPMD_PORT
    export ERL_EPMD_ADDRESS=127.0.0.1
    export RABBITMQ_USE_LONGNAME=false
    export RABBITMQ_CONF_ENV_FILE=$RMQ_DIR/rabbitmq-env.conf
    export RABBITMQ_CONFIG_FILE=$RMQ_DIR/rabbitmq.conf
    export RABBITMQ_ADVANCED_CONFIG_FILE=$RMQ_DIR/advanced.config
    export RABBITMQ_ENABLED_PLUGINS_FILE=$RMQ_DIR/enabled_plugins
    export RABBITMQ_MNESIA_BASE=$RMQ_DIR/mnesia
    export RABBITMQ_LOG_BASE=$RMQ_DIR/log
    export RABBITMQ_LOGS=$RMQ_LOG
    export RABBITMQ_PID_FILE=$RMQ_PIDFILE
    export RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
}

rmqctl() {  # rabbitmqctl against the private node; bounded
    (rmq_env; timeout 60 "$(rmq_bin rabbitmqctl)" -n "$RMQ_NODE" "$@" 9>&-)
}

rmq_pid() {
    local pid
    [[ -f $RMQ_PIDFILE ]] || return 1
    pid=$(tr -dc 0-9 < "$RMQ_PIDFILE")
    [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null || return 1
    echo "$pid"
}

amqp_ready() {  # TCP connect + AMQP protocol header → expects a connection.start method frame
    /usr/bin/python3 - "$AMQP_PORT" <<'EOF'
import socket, sys
try:
    s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=2)
    s.settimeout(2)
    s.sendall(b"AMQP\x00\x00\x09\x01")
    b = s.recv(7)
    s.close()
except OSError:
    sys.exit(1)
sys.exit(0 if len(b) >= 1 and b[0] == 1 else 1)
EOF
}

rmq_configure() {
    mkdir -p "$RMQ_HOME" "$RMQ_DIR/mnesia" "$RMQ_DIR/log"
    if [[ ! -s $RMQ_HOME/.erlang.cookie ]]; then
        (umask 077; head -c 32 /dev/urandom | od -An -tx1 | tr -dc a-f0-9 | tr a-f A-F > "$RMQ_HOME/.erlang.cookie")
        chmod 400 "$RMQ_HOME/.erlang.cookie"
    fi
    : > "$RMQ_DIR/rabbitmq-env.conf"
    echo '[].' > "$RMQ_DIR/enabled_plugins"
    echo '[].' > "$RMQ_DIR/advanced.config"
    cat > "$RMQ_DIR/rabbitmq.conf" <<EOF
# private test node (scripts/services.sh)
listeners.tcp.1 = 127.0.0.1:$AMQP_PORT
loopback_users.guest = true
disk_free_limit.absolute = 50MB
log.file.level = info
log.console = false
EOF
}

rmq_start() {
    if rmq_pid >/dev/null && amqp_ready; then return 0; fi
    if ! rmq_pid >/dev/null; then
        local p
        for p in "$AMQP_PORT" "$DIST_PORT"; do
            port_free "$p" || die "RabbitMQ port $p is taken by something else (remove $PORTS to pick new ports)"
        done
        rmq_configure
        note "starting RabbitMQ node $RMQ_NODE on 127.0.0.1:$AMQP_PORT"
        rm -f "$RMQ_PIDFILE"
        (
            rmq_env
            cd "$RMQ_DIR"
            exec setsid "$(rmq_bin rabbitmq-server)" </dev/null >>"$RMQ_OUT" 2>&1 9>&-
        ) &
        disown || true
    fi
    local deadline=$((SECONDS + READY_TIMEOUT))
    until amqp_ready; do
        if ((SECONDS >= deadline)); then
            tail -n 50 "$RMQ_LOG" "$RMQ_OUT" >&2 2>/dev/null || true
            die "RabbitMQ not ready on port $AMQP_PORT after ${READY_TIMEOUT}s (log: $RMQ_LOG)"
        fi
        sleep 0.2
    done
    # the AMQP listener opens at the end of boot; confirm the boot finished
    rmqctl await_startup --timeout "$READY_TIMEOUT" >/dev/null 2>&1 || {
        tail -n 50 "$RMQ_LOG" >&2 2>/dev/null || true
        die "RabbitMQ node $RMQ_NODE did not finish booting"
    }
}

rmq_stop() {
    local pid
    if pid=$(rmq_pid); then
        note "stopping RabbitMQ node $RMQ_NODE"
        rmqctl stop >/dev/null 2>&1 || true
        local deadline=$((SECONDS + 30))
        while kill -0 "$pid" 2>/dev/null; do
            if ((SECONDS >= deadline)); then kill -9 "$pid" 2>/dev/null || true; break; fi
            sleep 0.2
        done
    fi
    rm -f "$RMQ_PIDFILE"
    # the private epmd started by the node
    (rmq_env; timeout 10 epmd -kill >/dev/null 2>&1) || true
}

# ---------------------------------------------------------------- babelfish
bbf_tarball() {
    local t=${OUTBOX_BABELFISH_TARBALL:-}
    if [[ -z $t ]]; then
        t=$(find "$ROOT/../shared/babelfish" -maxdepth 1 -name 'babelfish-*.tar.xz' 2>/dev/null | sort -V | tail -n1)
    fi
    [[ -n $t && -f $t ]] || die "Babelfish tarball not found (set OUTBOX_BABELFISH_TARBALL, or put shared/babelfish/ beside the repository)"
    echo "$t"
}

bbf_prefix() {  # the unpacked install prefix, or nothing
    [[ -d $BBF_DIR ]] || return 0
    find "$BBF_DIR" -mindepth 1 -maxdepth 1 -type d -name 'babelfish-*' | sort | head -n1
}

tds_driver() {
    local so
    so=$(find /usr/lib -name libtdsodbc.so 2>/dev/null | head -n1)
    [[ -n $so ]] || die "FreeTDS's ODBC driver (libtdsodbc.so) not found; is tdsodbc installed?"
    echo "$so"
}

bbf_odbc() {  # the ODBC connection string to the private Babelfish, database $1
    echo "Driver=$(tds_driver);Server=127.0.0.1;Port=$BBF_TDS_PORT;UID=$BBF_LOGIN;PWD=$BBF_PASSWORD;Database=$1;TDS_Version=7.4;ClientCharset=UTF-8"
}

bbf_running() {
    local p; p=$(bbf_prefix)
    [[ -n $p && -f $BBF_DATA/PG_VERSION ]] || return 1
    as_pg "$p/bin/pg_ctl" -D "$BBF_DATA" status >/dev/null 2>&1
}

bbf_tsql() {  # T-SQL batch on stdin, over TDS; bounded
    TDSVER=7.4 timeout 60 tsql -H 127.0.0.1 -p "$BBF_TDS_PORT" -U "$BBF_LOGIN" -P "$BBF_PASSWORD" 2>&1
}

bbf_start() {
    local p out
    p=$(bbf_prefix)
    if [[ -z $p ]]; then
        note "unpacking Babelfish into $BBF_DIR"
        rm -rf "$BBF_DIR"; mkdir -p "$BBF_DIR"
        tar -xJf "$(bbf_tarball)" -C "$BBF_DIR" || die "could not unpack Babelfish"
        p=$(bbf_prefix)
        [[ -n $p ]] || die "the Babelfish tarball holds no babelfish-*/ directory"
    fi
    if [[ $(id -u) == 0 ]]; then chown -R postgres:postgres "$BBF_DIR"; fi
    if [[ ! -f $BBF_DATA/PG_VERSION ]]; then
        rm -rf "$BBF_DATA"
        if ! port_free "$BBF_PG_PORT" || ! port_free "$BBF_TDS_PORT"; then
            die "Babelfish ports $BBF_PG_PORT/$BBF_TDS_PORT are taken (remove $PORTS to pick new ports)"
        fi
        note "initializing Babelfish (T-SQL on 127.0.0.1:$BBF_TDS_PORT)"
        out=$(as_pg env DATADIR="$BBF_DATA" PGPORT="$BBF_PG_PORT" TDSPORT="$BBF_TDS_PORT" \
              LISTEN=127.0.0.1 BBF_LOGIN="$BBF_LOGIN" BBF_PASSWORD="$BBF_PASSWORD" \
              "$p/bin/babelfish-init.sh" 2>&1) || { echo "$out" >&2; die "Babelfish initialization failed"; }
        echo "$out" > "$BBF_LOG"
    fi
    if ! bbf_running; then
        port_free "$BBF_TDS_PORT" || die "Babelfish's TDS port $BBF_TDS_PORT is taken (remove $PORTS to pick new ports)"
        note "starting Babelfish on 127.0.0.1:$BBF_TDS_PORT"
        as_pg "$p/bin/pg_ctl" -D "$BBF_DATA" -l "$BBF_DATA/server.log" -w -t "$READY_TIMEOUT" start >/dev/null 2>&1 || {
            tail -n 50 "$BBF_DATA/server.log" >&2
            die "Babelfish did not start (log: $BBF_DATA/server.log)"
        }
    fi
    local deadline=$((SECONDS + READY_TIMEOUT))
    until printf 'SELECT 1\ngo\n' | bbf_tsql | grep -q '^1$'; do
        if ((SECONDS >= deadline)); then
            tail -n 50 "$BBF_DATA/server.log" >&2
            die "Babelfish not ready on port $BBF_TDS_PORT after ${READY_TIMEOUT}s"
        fi
        sleep 0.2
    done
    out=$(printf "IF DB_ID('%s') IS NULL CREATE DATABASE %s\ngo\nSELECT 'db-' + CAST(DB_ID('%s') AS varchar(10))\ngo\n" \
          "$BBF_DB" "$BBF_DB" "$BBF_DB" | bbf_tsql)
    [[ $out == *"db-"[0-9]* ]] || { echo "$out" >&2; die "could not create the T-SQL database $BBF_DB on Babelfish"; }
}

bbf_stop() {
    local p; p=$(bbf_prefix)
    if bbf_running; then
        note "stopping Babelfish"
        as_pg "$p/bin/pg_ctl" -D "$BBF_DATA" -m fast -w -t 60 stop >/dev/null
    fi
}

# ---------------------------------------------------------------- commands
with_lock() {  # serialise start/stop between concurrent test sessions
    mkdir -p "$SVC"
    exec 9>"$SVC/lock"
    flock -w 300 9 || die "could not lock $SVC/lock"
}

cmd_start() {
    with_lock
    # what sets of services started at the same time share (packages, the ODBC driver's
    # registration, the ports they pick), one at a time
    exec 8<"$ROOT/scripts/services.sh"
    flock -w 600 8 || die "could not lock scripts/services.sh"
    ensure_packages
    ensure_odbc_driver
    ensure_ports
    exec 8<&-
    pg_start
    rmq_start
    bbf_start
    echo "services.sh: PostgreSQL 127.0.0.1:$PG_PORT, RabbitMQ 127.0.0.1:$AMQP_PORT ($RMQ_NODE), Babelfish (T-SQL) 127.0.0.1:$BBF_TDS_PORT" >&2
}

cmd_stop() {
    with_lock
    load_ports || { note "nothing to stop"; return 0; }
    rmq_stop
    pg_stop
    bbf_stop
}

cmd_status() {
    load_ports || { echo "postgresql: not set up"; echo "rabbitmq: not set up"; echo "babelfish: not set up"; return 3; }
    local rc=0
    if pg_running && pg_ready; then
        echo "postgresql: running on 127.0.0.1:$PG_PORT (data $PG_DATA)"
    else
        echo "postgresql: stopped"; rc=3
    fi
    local pid
    if pid=$(rmq_pid) && amqp_ready; then
        echo "rabbitmq: running on 127.0.0.1:$AMQP_PORT (node $RMQ_NODE, pid $pid)"
    else
        echo "rabbitmq: stopped"; rc=3
    fi
    if bbf_running; then
        echo "babelfish: running, T-SQL on 127.0.0.1:$BBF_TDS_PORT (data $BBF_DATA)"
    else
        echo "babelfish: stopped"; rc=3
    fi
    return $rc
}

cmd_env() {
    load_ports || die "services not set up yet: run scripts/services.sh start"
    cat <<EOF
export OUTBOX_SERVICES_DIR='$SVC'
export OUTBOX_PG_HOST='127.0.0.1'
export OUTBOX_PG_PORT='$PG_PORT'
export OUTBOX_PG_USER='postgres'
export OUTBOX_PG_LOG='$PG_LOG'
export OUTBOX_AMQP_PORT='$AMQP_PORT'
export OUTBOX_AMQP_URL='amqp://guest:guest@127.0.0.1:$AMQP_PORT/%2f'
export OUTBOX_RABBIT_NODE='$RMQ_NODE'
export OUTBOX_RABBIT_HOME='$RMQ_HOME'
export OUTBOX_RABBIT_LOG='$RMQ_LOG'
export OUTBOX_RABBITMQCTL='$(rmq_bin rabbitmqctl)'
export ERL_EPMD_PORT='$EPMD_PORT'
export PGHOST='127.0.0.1'
export PGPORT='$PG_PORT'
export PGUSER='postgres'
export OUTBOX_BABELFISH_ODBC='$(bbf_odbc "$BBF_DB")'
export OUTBOX_BABELFISH_PG_PORT='$BBF_PG_PORT'
export OUTBOX_BABELFISH_LOG='$BBF_DATA/server.log'
# rabbitmqctl needs the node's cookie: HOME=\$OUTBOX_RABBIT_HOME \$OUTBOX_RABBITMQCTL -n \$OUTBOX_RABBIT_NODE status
# or simply: scripts/services.sh rabbitmqctl status
EOF
}

case "${1:-}" in
    start)  cmd_start ;;
    stop)   cmd_stop ;;
    status) cmd_status ;;
    env)    cmd_env ;;
    rabbitmqctl) shift; load_ports || die "services not set up yet"; rmqctl "$@" ;;
    *) echo "usage: $0 start|stop|status|env|rabbitmqctl ARGS..." >&2; exit 2 ;;
esac
