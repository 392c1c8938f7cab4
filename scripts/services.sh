#!/usr/bin/env bash
# The services the tests and examples use, on Debian or Ubuntu: installs PostgreSQL,
# MariaDB and Redis when they are missing, sets them up as the tests expect, and starts
# any that is down. Running it again changes nothing.
#
#   PostgreSQL 127.0.0.1:5432  trust auth over local TCP, databases `test` and `root`
#   MariaDB    127.0.0.1:3306  root with an empty password over TCP, database `test`
#   Redis      127.0.0.1:6379
#   NATS       127.0.0.1:4222  with JetStream (store in /var/lib/nats-server)
#
# Usage: bash scripts/services.sh           install what is missing, start what is down
#        bash scripts/services.sh --check   say what is up, down or missing; change nothing
#                                           (exit 1 if anything is not up)
#
# Other systems: `docker compose up -d` with the repository's compose.yaml gives the same.
set -euo pipefail

check=false
case "${1:-}" in
    "") ;;
    --check) check=true ;;
    *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

# Root runs the installs and the servers as this machine kind does; anyone else goes
# through sudo.
as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

pg_up() { command -v pg_isready >/dev/null && pg_isready -h 127.0.0.1 -p 5432 -q; }
redis_up() { command -v redis-cli >/dev/null && redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; }
mysql_up() { command -v mysqladmin >/dev/null && mysqladmin -h 127.0.0.1 -uroot status >/dev/null 2>&1; }
# The server's first line (INFO) says whether JetStream is on.
nats_info() { timeout 2 bash -c 'exec 3<>/dev/tcp/127.0.0.1/4222; head -n1 <&3' 2>/dev/null; }
nats_up() { nats_info | grep -q '^INFO'; }

pg_installed() { command -v pg_ctlcluster >/dev/null && [ -n "$(ls /etc/postgresql 2>/dev/null)" ]; }
redis_installed() { command -v redis-server >/dev/null; }
mysql_installed() { [ -x /usr/sbin/mariadbd ]; }
nats_installed() { command -v nats-server >/dev/null; }

pg_ready() { # the tests' logins: postgres to `test`, root to `root`, no password
    psql -w -h 127.0.0.1 -U postgres -d test -qAtc 'SELECT 1' >/dev/null 2>&1 \
        && psql -w -h 127.0.0.1 -U root -d root -qAtc 'SELECT 1' >/dev/null 2>&1
}
mysql_ready() { mysql -h 127.0.0.1 -uroot -e 'USE test' >/dev/null 2>&1; }
redis_ready() { true; }
nats_ready() { nats_info | grep -q '"jetstream":true'; }

state() { # up-fn installed-fn
    if "$1"; then echo "up"; elif "$2"; then echo "down"; else echo "missing"; fi
}

if $check; then
    ok=true
    for s in "PostgreSQL 127.0.0.1:5432:pg_up:pg_installed:pg_ready" \
        "MariaDB 127.0.0.1:3306:mysql_up:mysql_installed:mysql_ready" \
        "Redis 127.0.0.1:6379:redis_up:redis_installed:redis_ready" \
        "NATS 127.0.0.1:4222:nats_up:nats_installed:nats_ready"; do
        IFS=: read -r name port up installed ready <<<"$s"
        st=$(state "$up" "$installed")
        case $st in
            up) if "$ready"; then echo "$name:$port up"; else
                echo "$name:$port up, not set up as the tests expect: would set it up"; ok=false; fi ;;
            down) echo "$name:$port down: would start it"; ok=false ;;
            missing) echo "$name:$port missing: would install and start it"; ok=false ;;
        esac
    done
    $ok
    exit
fi

# --- install what is missing -------------------------------------------------------
need=()
pg_installed || need+=(postgresql)
mysql_installed || need+=(mariadb-server)
redis_installed || need+=(redis-server)
nats_installed || need+=(nats-server)
fresh_mysql=false
[[ " ${need[*]} " == *" mariadb-server "* ]] && fresh_mysql=true
if [ ${#need[@]} -gt 0 ]; then
    if ! command -v apt-get >/dev/null; then
        echo "missing: ${need[*]}; this script installs them on Debian/Ubuntu only." >&2
        echo "Elsewhere run \`docker compose up -d\` (compose.yaml) or install them yourself." >&2
        exit 1
    fi
    echo "installing ${need[*]}"
    as_root apt-get update -qq
    # Package scripts may try to start the servers (and fail without an init system):
    # they are started below either way.
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
fi

# --- start what is down, the way this machine kind starts them at boot ----------------
if ! pg_up; then
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql)" main start
fi
if ! redis_up; then
    redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
        --dir /var/lib/redis --logfile /var/log/redis/ci.log
fi
if ! nats_up; then
    as_root install -d /var/lib/nats-server
    # By its own pid file: a test's private nats-server must not count as this one.
    as_root start-stop-daemon --start --background --make-pidfile --pidfile /run/nats-server-ci.pid \
        --exec "$(command -v nats-server)" -- \
        -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log
fi
# A fresh MariaDB's root logs in by unix socket only, so "up" for a fresh install is the
# socket's answer; the package's own start may not have run (no init system), and
# mariadbd needs its socket directory.
mysql_socket_up() { as_root mysqladmin -uroot status >/dev/null 2>&1; }
if ! mysql_up; then
    if $fresh_mysql; then
        as_root install -d -o mysql -g mysql /run/mysqld
        mysql_socket_up || as_root start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd
    else
        start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd
    fi
fi

wait_for() { # what fn
    for _ in $(seq 1 60); do
        if "$2"; then return 0; fi
        sleep 1
    done
    echo "$1 did not come up within 60 s" >&2
    return 1
}

# --- set up what the tests expect, where it is not yet so (a fresh install, or a first
# run that stopped part-way) ----------------------------------------------------------
wait_for PostgreSQL pg_up
if ! pg_ready; then
    echo "setting up PostgreSQL: trust for local TCP, databases test and root"
    hba=$(ls /etc/postgresql/*/main/pg_hba.conf | head -n1)
    # Trust local TCP ahead of the package's password rules.
    if ! as_root grep -q '^host all all 127.0.0.1/32 trust' "$hba"; then
        as_root sed -i '1i host all all 127.0.0.1/32 trust\nhost all all ::1/128 trust' "$hba"
        as_root runuser -u postgres -- psql -qc 'SELECT pg_reload_conf()' >/dev/null
    fi
    pg_has() { [ "$(as_root runuser -u postgres -- psql -qtAc "$1")" = 1 ]; }
    pg_has "SELECT 1 FROM pg_roles WHERE rolname = 'root'" \
        || as_root runuser -u postgres -- createuser --superuser root
    for db in test root; do
        pg_has "SELECT 1 FROM pg_database WHERE datname = '$db'" \
            || as_root runuser -u postgres -- createdb "$db"
    done
fi

mysql_any_up() { mysql_up || mysql_socket_up; }
wait_for MariaDB mysql_any_up
if ! mysql_ready; then
    echo "setting up MariaDB: root with an empty password over TCP, database test"
    # From 127.0.0.1, and as `localhost` when the server resolves the address to that
    # name; the socket login stays as it was.
    as_root mysql -uroot <<'SQL'
ALTER USER 'root'@'localhost' IDENTIFIED VIA unix_socket OR mysql_native_password USING PASSWORD('');
CREATE USER IF NOT EXISTS 'root'@'127.0.0.1' IDENTIFIED BY '';
GRANT ALL PRIVILEGES ON *.* TO 'root'@'127.0.0.1' WITH GRANT OPTION;
CREATE DATABASE IF NOT EXISTS test;
FLUSH PRIVILEGES;
SQL
fi

wait_for Redis redis_up
wait_for NATS nats_up
if ! nats_ready; then
    echo "the NATS server on 127.0.0.1:4222 runs without JetStream; restart it with -js" >&2
    exit 1
fi
wait_for MariaDB mysql_up
pg_isready -h 127.0.0.1 -p 5432
redis-cli -h 127.0.0.1 -p 6379 ping
mysqladmin -h 127.0.0.1 -uroot status
