#!/bin/sh
# The official redis image's start-up contract: `redis-server ARGS` runs as user redis in /data, with
# protected mode off (the official image builds it so: other containers reach it over the network),
# unless the arguments set it.
set -eu
if [ "${1#-}" != "$1" ]; then set -- redis-server "$@"; fi
if [ "$1" = redis-server ]; then
    case " $* " in *" --protected-mode "*) ;; *) set -- "$@" --protected-mode no ;; esac
    if [ "$(id -u)" = 0 ]; then
        chown -R redis:redis /data 2>/dev/null || true
        exec setpriv --reuid=redis --regid=redis --init-groups "$@"
    fi
fi
exec "$@"
