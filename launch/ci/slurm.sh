#!/usr/bin/env bash
# A throwaway SLURM on this machine, so the launcher is tested against the real
# scheduler (sbatch, srun, signals, requeue) rather than a mock.
#
#   launch/ci/slurm.sh up     install the Debian packages if missing, write the
#                             config, start munged, slurmctld and one slurmd per
#                             emulated node, wait until every node is idle
#   launch/ci/slurm.sh down   stop the daemons it started (by their pid files)
#
# Needs root and no systemd. It owns /etc/slurm/slurm.conf (and refuses to
# overwrite one it did not write) and adds its node names to /etc/hosts.
# Emulated nodes share this host's address and differ by port (multiple-slurmd);
# LANEFORMER_SLURM_NODES sets how many (default 2).
set -euo pipefail

NODES=${LANEFORMER_SLURM_NODES:-2}
PREFIX=lfnode
CONF=/etc/slurm/slurm.conf
MARK="# written by launch/ci/slurm.sh"
HOST=$(hostname -s)
NAMES=$(seq -f "$PREFIX%g" 1 "$NODES" | paste -sd' ')

die() { echo "slurm.sh: $*" >&2; exit 1; }

install_packages() {
    local missing=0
    for cmd in munged slurmctld slurmd sbatch; do command -v "$cmd" >/dev/null || missing=1; done
    [ "$missing" = 0 ] && return
    command -v apt-get >/dev/null || die "SLURM is not installed and there is no apt-get"
    # Without a policy-rc.d the packages try to start their daemons during install.
    local policy=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        policy=/usr/sbin/policy-rc.d
        printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod +x "$policy"
    fi
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null; } \
        || { [ -n "$policy" ] && rm -f "$policy"; die "apt-get install of SLURM failed"; }
    [ -n "$policy" ] && rm -f "$policy"
    return 0
}

write_config() {
    if [ -e "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
        die "$CONF exists and was not written by this script; not touching it"
    fi
    local cpus mem
    cpus=$(nproc)
    mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 512 ))
    mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge
    {
        echo "$MARK"
        echo "ClusterName=laneformer-ci"
        echo "SlurmctldHost=$HOST(127.0.0.1)"
        echo "SlurmUser=root"
        echo "SlurmdUser=root"
        echo "AuthType=auth/munge"
        echo "AuthInfo=cred_expire=10"  # a requeued job waits cred_expire + 1 s
        echo "ProctrackType=proctrack/linuxproc"
        echo "TaskPlugin=task/none"
        echo "JobAcctGatherType=jobacct_gather/none"
        echo "AccountingStorageType=accounting_storage/none"
        echo "SelectType=select/cons_tres"
        echo "SchedulerParameters=batch_sched_delay=0,sched_interval=5"
        echo "SlurmdParameters=config_overrides"
        echo "KillWait=10"
        echo "MailProg=/bin/true"
        echo "ReturnToService=2"
        echo "StateSaveLocation=/var/spool/slurmctld"
        echo "SlurmdSpoolDir=/var/spool/slurmd/%n"
        echo "SlurmctldPidFile=/run/slurmctld.pid"
        echo "SlurmdPidFile=/run/slurmd-%n.pid"
        echo "SlurmctldLogFile=/var/log/slurm/slurmctld.log"
        echo "SlurmdLogFile=/var/log/slurm/slurmd-%n.log"
        local i=1
        for name in $NAMES; do
            echo "NodeName=$name NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((17000 + i))" \
                "CPUs=$cpus RealMemory=$mem State=UNKNOWN"
            i=$((i + 1))
        done
        echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
    } > "$CONF"
    # Job scripts resolve node names (the rendezvous host) like real hosts.
    for name in $NAMES; do
        grep -qE "^127\.0\.0\.1\s+$name\$" /etc/hosts || echo "127.0.0.1 $name" >> /etc/hosts
    done
}

running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

nodes_idle() {
    local states
    states=$(sinfo -h -N -o '%T' 2>/dev/null) || return 1
    [ "$(grep -c '^idle$' <<<"$states")" = "$NODES" ]
}

up() {
    [ "$(id -u)" = 0 ] || die "needs root (it installs packages and starts daemons)"
    install_packages
    if grep -qsF "$MARK" "$CONF" && running /run/slurmctld.pid && nodes_idle; then
        echo "slurm.sh: already up: $NAMES"
        return
    fi
    down >/dev/null 2>&1 || true
    write_config
    chown munge:munge /run/munge
    runuser -u munge -- munged --force
    slurmctld -c  # -c: a fresh controller, no jobs left from an earlier session
    for name in $NAMES; do
        mkdir -p "/var/spool/slurmd/$name"
        slurmd -N "$name"
    done
    for _ in $(seq 60); do
        if nodes_idle; then
            echo "slurm.sh: up: $NAMES idle"
            return
        fi
        sleep 1
    done
    sinfo -N >&2 || true
    tail -n 20 /var/log/slurm/slurmctld.log >&2 || true
    die "nodes not idle after 60 s"
}

stop() {  # stop <pid file>: TERM, then wait up to 10 s
    running "$1" || return 0
    local pid
    pid=$(cat "$1")
    kill "$pid"
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.2; done
    echo "slurm.sh: pid $pid from $1 did not stop" >&2
}

down() {
    for name in $NAMES; do stop "/run/slurmd-$name.pid"; done
    stop /run/slurmctld.pid
    stop /run/munge/munged.pid
    echo "slurm.sh: down"
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
