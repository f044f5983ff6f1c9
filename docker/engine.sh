#!/usr/bin/env bash
# Make a Docker engine available, and stop only what this script started.
#
#   docker/engine.sh up      # install docker.io + docker-compose from Debian's
#                            # packages if no engine answers; start dockerd if
#                            # none runs (its PID goes to $STATE/dockerd.pid)
#   docker/engine.sh down    # stop the dockerd that `up` started, by PID
#   docker/engine.sh compose # print the compose command to use
#
# STATE defaults to ${XDG_CACHE_HOME:-~/.cache}/fedadapt/engine.
set -euo pipefail

STATE=${FEDADAPT_ENGINE_STATE:-${XDG_CACHE_HOME:-$HOME/.cache}/fedadapt/engine}
mkdir -p "$STATE"
PIDFILE=$STATE/dockerd.pid

answers() { docker info >/dev/null 2>&1; }

compose_cmd() {
    if docker compose version >/dev/null 2>&1; then
        echo "docker compose"
    elif command -v docker-compose >/dev/null 2>&1; then
        echo "docker-compose"
    else
        return 1
    fi
}

install_packages() {
    if [ "$(id -u)" != 0 ]; then
        echo "engine.sh: need root to install docker.io (or install Docker yourself)" >&2
        return 1
    fi
    echo "engine.sh: installing docker.io docker-compose from Debian's packages" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        docker.io docker-compose >/dev/null
}

up() {
    if answers; then
        echo "engine.sh: a Docker engine answers; using it" >&2
    else
        if ! command -v dockerd >/dev/null 2>&1 || ! compose_cmd >/dev/null; then
            install_packages
        fi
        echo "engine.sh: starting dockerd (log: $STATE/dockerd.log)" >&2
        dockerd >"$STATE/dockerd.log" 2>&1 &
        echo $! >"$PIDFILE"
        for _ in $(seq 60); do
            answers && break
            if ! kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
                echo "engine.sh: dockerd exited; see $STATE/dockerd.log" >&2
                rm -f "$PIDFILE"
                return 1
            fi
            sleep 0.5
        done
        answers || { echo "engine.sh: dockerd did not answer in 30 s" >&2; return 1; }
    fi
    compose_cmd >/dev/null || install_packages
}

down() {
    if [ -f "$PIDFILE" ]; then
        pid=$(cat "$PIDFILE")
        if kill -0 "$pid" 2>/dev/null; then
            kill -TERM "$pid"
            for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
            kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
        fi
        rm -f "$PIDFILE"
        echo "engine.sh: stopped dockerd $pid" >&2
    else
        echo "engine.sh: no dockerd started by this script" >&2
    fi
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    compose) compose_cmd ;;
    *) echo "usage: $0 up|down|compose" >&2; exit 2 ;;
esac
