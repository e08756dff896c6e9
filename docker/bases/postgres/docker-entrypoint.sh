#!/bin/sh
# The official postgres image's start-up contract, for Debian's postgresql-15: as root, own PGDATA and
# re-run as postgres; on first start (no PG_VERSION) initdb with POSTGRES_USER (default postgres) as
# superuser and POSTGRES_PASSWORD (required unless POSTGRES_HOST_AUTH_METHOD=trust), then create
# POSTGRES_DB (default: the user's name); connections from any address with a password (scram-sha-256).
set -eu
if [ "${1#-}" != "$1" ]; then set -- postgres "$@"; fi
if [ "$1" != postgres ]; then exec "$@"; fi

: "${PGDATA:=/var/lib/postgresql/data}"
if [ "$(id -u)" = 0 ]; then
    mkdir -p "$PGDATA" /var/run/postgresql
    chown -R postgres:postgres "$PGDATA" /var/run/postgresql
    chmod 700 "$PGDATA"
    exec setpriv --reuid=postgres --regid=postgres --init-groups "$0" "$@"
fi

if [ ! -s "$PGDATA/PG_VERSION" ]; then
    user="${POSTGRES_USER:-postgres}"
    db="${POSTGRES_DB:-$user}"
    auth="${POSTGRES_HOST_AUTH_METHOD:-scram-sha-256}"
    if [ -z "${POSTGRES_PASSWORD:-}" ] && [ "$auth" != trust ]; then
        echo "Database is uninitialized and superuser password is not specified: set POSTGRES_PASSWORD" >&2
        exit 1
    fi
    pwfile="$(mktemp)"
    printf '%s\n' "${POSTGRES_PASSWORD:-}" > "$pwfile"
    initdb --username="$user" --pwfile="$pwfile" --auth-local=trust --auth-host="$auth" -D "$PGDATA" >/dev/null
    rm -f "$pwfile"
    printf "\nhost all all all %s\n" "$auth" >> "$PGDATA/pg_hba.conf"
    printf "listen_addresses = '*'\n" >> "$PGDATA/postgresql.conf"
    # Create the database on a socket-only server, as the official image does before it listens.
    pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
    if [ "$db" != postgres ]; then
        psql -v ON_ERROR_STOP=1 --username="$user" --dbname=postgres -q \
             -c "CREATE DATABASE \"$db\" OWNER \"$user\"" >/dev/null
    fi
    pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
    echo "PostgreSQL init process complete; ready for start up."
fi
exec "$@"
