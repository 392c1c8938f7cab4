#!/usr/bin/env bash
# Emit on the partitioned layout against emit on the unpartitioned one and a hand-written
# insert, one event per transaction, with pgbench running the emit's exact statement
# (`-M prepared`), rounds interleaved so that the disk's drift weighs on all three alike.
# Prints transactions/s per way and round, then the medians' ratios.
#
#   bash scripts/bench-partitioned-emit.sh [SECONDS_PER_RUN] [ROUNDS]
#
# With SYNCHRONOUS_COMMIT=off every session commits without waiting for its WAL flush:
# where the disk's flush time drifts from run to run, this shows the statements' own cost.
#
# Needs the local PostgreSQL (DATABASE_URL, default postgres://postgres@127.0.0.1:5432/test)
# and the `outbox` binary (built if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-10}"; rounds="${2:-3}"
url="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}"
bin="${OUTBOX_BIN:-${CARGO_TARGET_DIR:-target}/release/outbox}"
[ -x "$bin" ] || cargo build -q --release -p typed-outbox-cli
tag="bench_pemit_$$"
work="$(mktemp -d)"
cleanup() {
    psql "$url" -qc "SET client_min_messages = warning; DROP SCHEMA IF EXISTS ${tag}_plain CASCADE; DROP SCHEMA IF EXISTS ${tag}_parted CASCADE" || true
    rm -rf "$work"
}
trap cleanup EXIT
psql "$url" -qc "CREATE SCHEMA ${tag}_plain; CREATE SCHEMA ${tag}_parted"
with_path() { echo "${url}?options=-c%20search_path%3D$1"; }
"$bin" --database-url "$(with_path "${tag}_plain")" migrate >/dev/null
"$bin" --database-url "$(with_path "${tag}_parted")" migrate --partitioned >/dev/null

# The columns emit writes; msg_id unique per client and transaction (its colon as chr(58):
# pgbench would read `:AccountTransferred` in a literal as a variable).
cols="(msg_id, topic, event_type, msg_key, schema_version, payload, headers)"
vals="('t-' || (:client_id)::text || '-' || (:tx)::text || chr(58) || 'AccountTransferred', 'account.transferred', \
'AccountTransferred', 't-' || (:client_id)::text, 1, '{\"from\":\"alice\",\"to\":\"bob\",\"amount\":1}'::jsonb, '{}'::jsonb)"
script() { # name, ON CONFLICT clause
    printf '\\set tx random(1, 1000000000000)\nINSERT INTO outbox %s VALUES %s%s;\n' "$cols" "$vals" "$2" > "$work/$1.sql"
}
script hand ""
script emit " ON CONFLICT DO NOTHING"

declare -A tps
run() { # way schema script clients
    local out
    out="$(PGOPTIONS="-c search_path=$2 -c synchronous_commit=${SYNCHRONOUS_COMMIT:-on}" pgbench -n -M prepared -c "$4" -j "$4" -T "$secs" -f "$work/$3.sql" "$url" 2>&1)"
    grep -oP 'tps = \K[0-9.]+' <<<"$out" | head -1
}
for clients in 1 8; do
    for ((r = 0; r < rounds; r++)); do
        ways=(hand emit parted); ((r % 2)) && ways=(parted emit hand)
        for way in "${ways[@]}"; do
            case "$way" in
                hand) t="$(run hand "${tag}_plain" hand "$clients")" ;;
                emit) t="$(run emit "${tag}_plain" emit "$clients")" ;;
                parted) t="$(run parted "${tag}_parted" emit "$clients")" ;;
            esac
            tps[$clients,$way]+="$t "
            printf '%s clients=%s round=%s %s tps\n' "$way" "$clients" "$r" "$t"
        done
    done
done
median() { tr ' ' '\n' | grep . | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
for clients in 1 8; do
    h="$(median <<<"${tps[$clients,hand]}")"; e="$(median <<<"${tps[$clients,emit]}")"
    p="$(median <<<"${tps[$clients,parted]}")"
    awk -v c="$clients" -v h="$h" -v e="$e" -v p="$p" 'BEGIN {
        printf "clients=%s medians: hand %.0f, emit %.0f, partitioned emit %.0f tps; partitioned / emit %.2f, partitioned / hand %.2f\n", c, h, e, p, p / e, p / h }'
done
