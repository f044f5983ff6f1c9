#!/usr/bin/env bash
# Make a Docker engine available, and stop only what this script started.
#
# usage: docker/engine.sh up|down|compose|status
#   up       install docker.io + docker-compose from Debian's packages when no
#            engine answers and dockerd or a compose tool is missing (root);
#            start dockerd when none runs (log and PID in $STATE). Prints
#            "started <pid>" or "running" on stdout. Records the caller (the
#            parent process, e.g. a pytest session) as a user of the engine.
#   down     forget the caller; stop the dockerd that `up` started, by its
#            recorded PID, once no other live caller uses it (concurrent test
#            sessions share one daemon). Never stops a daemon it did not start.
#            Images, the build cache and volumes stay on disk.
#   compose  print the compose command: "docker compose" (v2) if present, else
#            "docker-compose" (v1.29 reads the same files)
#   status   say whether an engine answers and who started it
#
# STATE is ${FEDADAPT_ENGINE_STATE:-${XDG_CACHE_HOME:-~/.cache}/fedadapt/engine}.
# The caller is $PPID, or FEDADAPT_ENGINE_USER=<pid of a process that uses the
# engine while it lives> (e.g. a long-lived shell: `FEDADAPT_ENGINE_USER=$$`).
# Any docker client from API 1.41 on works with Debian's 20.10 daemon (a newer
# client negotiates the API version down).
set -euo pipefail

STATE=${FEDADAPT_ENGINE_STATE:-${XDG_CACHE_HOME:-$HOME/.cache}/fedadapt/engine}
PIDFILE=$STATE/dockerd.pid
LOG=$STATE/dockerd.log
USERS=$STATE/users
CALLER=${FEDADAPT_ENGINE_USER:-$PPID}

say() { echo "engine.sh: $*" >&2; }
answers() { docker info >/dev/null 2>&1; }
ours() { [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; }

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
        say "no Docker engine and not root: install Docker (docker.io, docker-compose) yourself"
        return 1
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        say "no Docker engine and no apt-get: install Docker yourself"
        return 1
    fi
    say "installing docker.io docker-compose from Debian's packages"
    apt-get -o DPkg::Lock::Timeout=300 update -qq
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq \
        --no-install-recommends docker.io docker-compose >"$STATE/apt.log" 2>&1 \
        || { tail -20 "$STATE/apt.log" >&2; return 1; }
}

wait_for_engine() {  # $1: seconds; $2: PID that must stay alive (optional)
    local tries=$(($1 * 2))
    for _ in $(seq "$tries"); do
        answers && return 0
        if [ -n "${2:-}" ] && ! kill -0 "$2" 2>/dev/null; then
            say "dockerd exited; last lines of $LOG:"
            tail -15 "$LOG" >&2
            return 1
        fi
        sleep 0.5
    done
    say "no engine answered within $1 s"
    return 1
}

# callers of `up` that have not called `down`, as files named by their PIDs
register() { mkdir -p "$USERS" && : >"$USERS/$CALLER"; }
other_users() {
    local f pid
    for f in "$USERS"/*; do
        [ -e "$f" ] || continue
        pid=${f##*/}
        # this caller; itself when the caller's shell exec'd this script as its
        # last command (bash -c "… && engine.sh down"); or a caller that died
        if [ "$pid" = "$CALLER" ] || [ "$pid" = "$$" ] || ! kill -0 "$pid" 2>/dev/null; then
            rm -f "$f"
        else
            echo "$pid"
        fi
    done
}

up() {
    mkdir -p "$STATE"
    register
    if answers; then
        compose_cmd >/dev/null || install_packages
        say "a Docker engine answers; using it"
        echo running
        return 0
    fi
    if ! command -v dockerd >/dev/null 2>&1 || ! compose_cmd >/dev/null; then
        install_packages
    fi
    if pgrep -x dockerd >/dev/null 2>&1; then
        # someone else's daemon is starting (or stuck): wait, never start a second
        say "a dockerd runs but does not answer yet; waiting"
        wait_for_engine 60
        echo running
        return 0
    fi
    if [ "$(id -u)" != 0 ]; then
        say "no Docker engine answers and only root can start dockerd here"
        return 1
    fi
    say "starting dockerd (log: $LOG)"
    # setsid: the daemon outlives this script and the caller's process group
    setsid dockerd >"$LOG" 2>&1 </dev/null &
    local pid=$!
    echo "$pid" >"$PIDFILE"
    if ! wait_for_engine 60 "$pid"; then
        kill -TERM "$pid" 2>/dev/null || true
        rm -f "$PIDFILE"
        return 1
    fi
    say "dockerd $pid answers"
    echo "started $pid"
}

down() {
    local pid others
    others=$(other_users | tr '\n' ' ')
    if ! ours; then
        rm -f "$PIDFILE"
        say "no dockerd started by this script is running"
        return 0
    fi
    pid=$(cat "$PIDFILE")
    if [ -n "$others" ]; then
        say "dockerd $pid stays up: still used by process(es) $others"
        return 0
    fi
    kill -TERM "$pid"
    for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    if kill -0 "$pid" 2>/dev/null; then
        say "dockerd $pid ignored SIGTERM for 30 s; killing it"
        kill -KILL "$pid"
    fi
    rm -f "$PIDFILE"
    say "stopped dockerd $pid"
}

status() {
    if answers; then
        if ours; then echo "engine answers (dockerd $(cat "$PIDFILE"), started by engine.sh)"
        else echo "engine answers (not started by engine.sh)"; fi
    else
        echo "no engine answers"
        return 1
    fi
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    compose) compose_cmd || { say "no compose tool (docker compose / docker-compose)"; exit 1; } ;;
    status) status ;;
    *) echo "usage: $0 up|down|compose|status" >&2; exit 2 ;;
esac
