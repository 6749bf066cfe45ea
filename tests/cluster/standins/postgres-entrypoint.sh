#!/bin/sh
# The stand-in's start: initdb (UTF8, passwords required over TCP) and the database on
# an empty data folder, then the server in the foreground on every address.
set -eu
: "${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD}"
user="${POSTGRES_USER:-postgres}"
database="${POSTGRES_DB:-$user}"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    password_file=$(mktemp)
    printf '%s\n' "$POSTGRES_PASSWORD" > "$password_file"
    initdb --pgdata="$PGDATA" --username="$user" --pwfile="$password_file" \
        --encoding=UTF8 --locale=C.UTF-8 --auth-local=trust --auth-host=scram-sha-256
    rm -f "$password_file"
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    if [ "$database" != "postgres" ]; then
        echo "CREATE DATABASE \"$database\";" | postgres --single -D "$PGDATA" -j postgres > /dev/null
    fi
fi
exec postgres -D "$PGDATA" -c listen_addresses='*'
