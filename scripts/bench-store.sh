#!/usr/bin/env bash
# The response store's write and read latency (p50/p99), as a router sees it: the embedded memory
# store, the PostgreSQL store, and plain tokio-postgres sending the same SQL beside it.
#
#   scripts/bench-store.sh [bellows-bench store flags, e.g. --concurrency 8 --bytes 8192]
#
# Starts its own PostgreSQL (Debian's, as scripts/install-deps.sh installs it) in a temp dir on a
# free port, with the server's default durability (fsync and synchronous commit on, as a
# production database runs), as the postgres user when run by root. One JSON line.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/bellows/target}"
cargo build --release -q -p bellows-bench
bin=$(compgen -G "/usr/lib/postgresql/*/bin" | sort -V | tail -1)
dir=$(mktemp -d)
as=()
if [[ $(id -u) -eq 0 ]]; then as=(runuser -u postgres --); chown postgres "$dir"; fi
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
printf 'bench password' >"$dir/pw"; chmod 644 "$dir/pw"
"${as[@]}" "$bin/initdb" -D "$dir/data" -U bellows --auth=scram-sha-256 --pwfile="$dir/pw" -E UTF8 >/dev/null
"${as[@]}" "$bin/postgres" -D "$dir/data" -p "$port" -c listen_addresses=127.0.0.1 \
    -c unix_socket_directories="$dir" >"$dir/log" 2>&1 &
pg=$!
trap 'kill "$pg" 2>/dev/null; wait "$pg" 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 100); do "$bin/pg_isready" -q -h 127.0.0.1 -p "$port" && break; sleep 0.1; done
"$CARGO_TARGET_DIR/release/bellows-bench" store --url "postgres://bellows@127.0.0.1:$port/postgres" \
    --password-file "$dir/pw" "$@"
