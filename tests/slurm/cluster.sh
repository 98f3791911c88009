#!/usr/bin/env bash
# A real, throw-away SLURM cluster on this one host, for the tests under tests/slurm/.
#
#   cluster.sh up       install (if missing), configure and start everything; fast no-op when up
#   cluster.sh down     cancel all jobs, stop every daemon this script started (state is kept)
#   cluster.sh status   sinfo + squeue
#   cluster.sh clean    down, then delete the state dir
#
# What it builds (state dir: $CKPTEVAL_SLURM_DIR, default /tmp/ckpteval-slurm):
#   - munged (as the munge user), slurmctld, N logical nodes n1..nN (one `slurmd -N nX` each, own
#     port, NodeAddr=127.0.0.1), each with $CKPTEVAL_SLURM_CPUS CPUs (more than the host has:
#     SlurmdParameters=config_overrides) and 2 fake GPUs (gres.conf File= entries pointing at
#     `mknod c 1 3` character devices: count-only gres entries drain the node). Heterogeneous jobs
#     put each component on its own node, so N >= 3.
#   - No cgroups: proctrack/linuxproc, task/none, select/cons_tres with CR_Core.
#   - Fast requeue: AuthInfo=cred_expire=10 plus bf_interval=2,sched_interval=2. A requeued job
#     gets BeginTime = now + cred_expire + 1, so the default (120 s) made `scontrol requeue` ->
#     RUNNING take ~125 s here; with these settings it takes ~11 s.
#   - Accounting: REAL accounting, slurmdbd + MariaDB, both started by hand (no systemd here).
#     Chosen because it is cheap: slurmdbd + mariadb-server install in ~8 s, and a first `up`
#     (mariadb-install-db, schema creation, cluster registration) takes ~3 s in all. Without
#     slurmdbd there is no `sacct`, and submitit then polls forever on a failed/cancelled job.
#     (The fallback, JobCompType=jobcomp/filetxt, records completions but gives no `sacct`; it is
#     what CKPTEVAL_SLURM_ACCOUNTING=none selects.)
#   - Jobs survive a daemon restart (`up` restarts only what died, or what reads a changed config);
#     `down` cancels them.
#
# Clients find the cluster through SLURM_CONF=$STATE/etc/slurm.conf; /etc/slurm/slurm.conf is also
# made a symlink to it when nothing (live) is there yet.
# Exit codes: 0 ok; 1 SLURM failed to start (message + log tails on stderr); 3 SLURM is not
# installed and cannot be installed (not root / apt failed): callers may skip on 3.
set -uo pipefail

STATE=${CKPTEVAL_SLURM_DIR:-/tmp/ckpteval-slurm}
NNODES=${CKPTEVAL_SLURM_NODES:-3}
NCPUS=${CKPTEVAL_SLURM_CPUS:-4}
NGPUS=2
PARTITION=${CKPTEVAL_SLURM_PARTITION:-debug}
CLUSTER=ckpteval
PORT_BASE=${CKPTEVAL_SLURM_PORT_BASE:-16817}
PORT_CTLD=$PORT_BASE
PORT_DBD=$((PORT_BASE + 2))
PORT_MYSQL=$((PORT_BASE + 3))
PORT_NODE0=$((PORT_BASE + 10))
ACCOUNTING=${CKPTEVAL_SLURM_ACCOUNTING:-slurmdbd}
WAIT_S=${CKPTEVAL_SLURM_WAIT_S:-60}
HOST=$(hostname -s)

ETC=$STATE/etc
LOG=$STATE/log
RUN=$STATE/run
CONF=$ETC/slurm.conf
export SLURM_CONF=$CONF
NODES=()
for ((i = 1; i <= NNODES; i++)); do NODES+=("n$i"); done
NODELIST="n[1-$NNODES]"

T0=$(date +%s.%N)
say() { echo "cluster.sh: $*" >&2; }
elapsed() { awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}'; }
die() {
    say "ERROR: $*"
    for f in "$LOG"/slurmctld.log "$LOG"/slurmdbd.log "$STATE"/mysqld/mariadb.log "$LOG"/slurmd-n1.log; do
        [[ -s $f ]] && { echo "--- tail $f" >&2; tail -n 15 "$f" >&2; }
    done
    exit 1
}

pid_alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

# ---------------------------------------------------------------- install
have_bins() {
    local b
    for b in slurmctld slurmd sbatch munged; do command -v "$b" >/dev/null || return 1; done
    if [[ $ACCOUNTING == slurmdbd ]]; then
        for b in slurmdbd mariadbd mariadb-install-db; do command -v "$b" >/dev/null || return 1; done
    fi
}

install_pkgs() {
    have_bins && return 0
    if [[ $(id -u) -ne 0 ]]; then
        say "SLURM is not installed and we are not root: cannot apt-get install slurm-wlm munge"
        exit 3
    fi
    command -v apt-get >/dev/null || { say "SLURM is not installed and there is no apt-get"; exit 3; }
    local pkgs=(slurm-wlm munge)
    [[ $ACCOUNTING == slurmdbd ]] && pkgs+=(slurmdbd mariadb-server)
    say "installing ${pkgs[*]} ..."
    export DEBIAN_FRONTEND=noninteractive
    local log=/tmp/ckpteval-slurm-apt.log
    if ! apt-get install -y --no-install-recommends -o DPkg::Lock::Timeout=120 "${pkgs[@]}" >"$log" 2>&1; then
        apt-get update -o DPkg::Lock::Timeout=120 >>"$log" 2>&1
        apt-get install -y --no-install-recommends -o DPkg::Lock::Timeout=120 "${pkgs[@]}" >>"$log" 2>&1 || {
            tail -n 20 "$log" >&2
            say "apt-get install ${pkgs[*]} failed (log: $log)"
            exit 3
        }
    fi
    have_bins || { say "installed, but SLURM binaries are still missing"; exit 3; }
    say "installed in $(elapsed)s"
}

# ---------------------------------------------------------------- configs
gen_configs() { # writes into dir $1
    local d=$1 mem i n
    mem=$(slurmd -C 2>/dev/null | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')
    [[ -n $mem ]] || mem=4096
    {
        echo "# generated by tests/slurm/cluster.sh -- edits are overwritten"
        echo "ClusterName=$CLUSTER"
        echo "SlurmctldHost=$HOST(127.0.0.1)"
        echo "SlurmctldPort=$PORT_CTLD"
        echo "SlurmdPort=$PORT_NODE0"
        echo "SlurmUser=root"
        echo "SlurmdUser=root"
        echo "AuthType=auth/munge"
        echo "CredType=cred/munge"
        echo "AuthInfo=cred_expire=10"
        echo "StateSaveLocation=$STATE/spool/ctld"
        echo "SlurmdSpoolDir=$STATE/spool/%n"
        echo "SlurmctldPidFile=$RUN/slurmctld.pid"
        echo "SlurmdPidFile=$RUN/slurmd-%n.pid"
        echo "SlurmctldLogFile=$LOG/slurmctld.log"
        echo "SlurmdLogFile=$LOG/slurmd-%n.log"
        echo "SlurmctldDebug=info"
        echo "SlurmdDebug=info"
        echo "ProctrackType=proctrack/linuxproc"
        echo "TaskPlugin=task/none"
        echo "SelectType=select/cons_tres"
        echo "SelectTypeParameters=CR_Core"
        echo "SchedulerType=sched/backfill"
        echo "SchedulerParameters=bf_interval=2,sched_interval=2"
        echo "SlurmdParameters=config_overrides"
        echo "ReturnToService=2"
        echo "MpiDefault=none"
        echo "MailProg=/bin/true"
        echo "GresTypes=gpu"
        echo "KillWait=5"
        echo "InactiveLimit=0"
        echo "MinJobAge=300"
        echo "SlurmdTimeout=300"
        if [[ $ACCOUNTING == slurmdbd ]]; then
            echo "AccountingStorageType=accounting_storage/slurmdbd"
            echo "AccountingStorageHost=127.0.0.1"
            echo "AccountingStoragePort=$PORT_DBD"
            echo "AccountingStorageTRES=gres/gpu"
            echo "JobAcctGatherType=jobacct_gather/linux"
            echo "JobAcctGatherFrequency=30"
        else
            echo "AccountingStorageType=accounting_storage/none"
            echo "JobCompType=jobcomp/filetxt"
            echo "JobCompLoc=$LOG/jobcomp.txt"
        fi
        for ((i = 0; i < NNODES; i++)); do
            n=${NODES[i]}
            echo "NodeName=$n NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((PORT_NODE0 + i)) CPUs=$NCPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$NCPUS ThreadsPerCore=1 RealMemory=$mem Gres=gpu:$NGPUS State=UNKNOWN"
        done
        echo "PartitionName=$PARTITION Nodes=$NODELIST Default=YES MaxTime=INFINITE State=UP"
    } >"$d/slurm.conf"
    {
        echo "# generated by tests/slurm/cluster.sh: fake GPUs (char devices c 1 3, i.e. /dev/null)"
        for n in "${NODES[@]}"; do
            echo "NodeName=$n Name=gpu File=$STATE/dev/$n/nvidia[0-$((NGPUS - 1))]"
        done
    } >"$d/gres.conf"
    {
        echo "# generated by tests/slurm/cluster.sh"
        echo "AuthType=auth/munge"
        echo "DbdAddr=127.0.0.1"
        echo "DbdHost=$HOST"
        echo "DbdPort=$PORT_DBD"
        echo "SlurmUser=root"
        echo "DebugLevel=info"
        echo "LogFile=$LOG/slurmdbd.log"
        echo "PidFile=$RUN/slurmdbd.pid"
        echo "StorageType=accounting_storage/mysql"
        echo "StorageHost=127.0.0.1"
        echo "StoragePort=$PORT_MYSQL"
        echo "StorageUser=slurm"
        echo "StoragePass=slurm"
        echo "StorageLoc=slurm_acct_db"
    } >"$d/slurmdbd.conf"
}

# ---------------------------------------------------------------- daemons
start_munge() {
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return 0; fi
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge /etc/munge 2>/dev/null || true
    if [[ ! -s /etc/munge/munge.key ]]; then
        say "generating /etc/munge/munge.key"
        if command -v mungekey >/dev/null; then
            runuser -u munge -- mungekey --create --keyfile=/etc/munge/munge.key || die "mungekey failed"
        else
            dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
            chown munge:munge /etc/munge/munge.key
        fi
        chmod 0400 /etc/munge/munge.key
    fi
    rm -f /run/munge/munged.pid
    runuser -u munge -- munged --force </dev/null >>"$LOG/munged.out" 2>&1 9>&- || die "munged failed to start"
    touch "$RUN/munged.ours"
    for _ in $(seq 50); do
        munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    die "munged does not answer"
}

MYSQL_DATA=$STATE/mysql
MYSQL_RUN=$STATE/mysqld # owned by mysql: socket, pid file, error log
MYSQL_SOCK=$MYSQL_RUN/mysqld.sock
MYSQL_PID=$MYSQL_RUN/mariadbd.pid
MYSQL_OPTS=(--no-defaults --user=mysql --datadir="$MYSQL_DATA" --innodb-log-file-size=8M
    --innodb-buffer-pool-size=64M --innodb-lock-wait-timeout=900)
mysql_root() { mariadb --no-defaults -S "$MYSQL_SOCK" -uroot "$@"; }

start_mariadb() {
    if pid_alive "$MYSQL_PID" && mysql_root -e 'select 1' >/dev/null 2>&1; then return 0; fi
    if [[ ! -d $MYSQL_DATA/mysql ]]; then
        rm -rf "$MYSQL_DATA"
        install -d -o mysql -g mysql "$MYSQL_DATA"
        mariadb-install-db "${MYSQL_OPTS[@]}" --auth-root-authentication-method=normal \
            --skip-test-db >"$LOG/mariadb-install.log" 2>&1 || die "mariadb-install-db failed ($LOG/mariadb-install.log)"
    fi
    install -d -o mysql -g mysql "$MYSQL_RUN"
    rm -f "$MYSQL_PID"
    setsid mariadbd "${MYSQL_OPTS[@]}" --socket="$MYSQL_SOCK" --port="$PORT_MYSQL" \
        --bind-address=127.0.0.1 --pid-file="$MYSQL_PID" --log-error="$MYSQL_RUN/mariadb.log" \
        </dev/null >/dev/null 2>&1 9>&- &
    local pid=$!
    for _ in $(seq 150); do
        mysql_root -e 'select 1' >/dev/null 2>&1 && break
        kill -0 $pid 2>/dev/null || die "mariadbd exited (log: $MYSQL_RUN/mariadb.log)"
        sleep 0.2
    done
    mysql_root -e "
        CREATE DATABASE IF NOT EXISTS slurm_acct_db;
        CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
        CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';" || die "mariadb did not start"
}

start_slurmdbd() {
    if pid_alive "$RUN/slurmdbd.pid" && sacctmgr -n -P show cluster >/dev/null 2>&1; then return 0; fi
    # slurmdbd has no -f: it reads slurmdbd.conf next to $SLURM_CONF
    slurmdbd </dev/null >>"$LOG/slurmdbd.out" 2>&1 9>&- || die "slurmdbd failed to start"
    for _ in $(seq 150); do
        sacctmgr -n -P show cluster >/dev/null 2>&1 && break
        sleep 0.2
    done
    sacctmgr -n -P show cluster >/dev/null 2>&1 || die "slurmdbd does not answer"
    if ! sacctmgr -n -P show cluster format=cluster 2>/dev/null | grep -qx "$CLUSTER"; then
        sacctmgr -i add cluster "$CLUSTER" >/dev/null || die "sacctmgr add cluster failed"
    fi
}

start_slurm() {
    if ! pid_alive "$RUN/slurmctld.pid"; then
        slurmctld -f "$CONF" </dev/null >>"$LOG/slurmctld.out" 2>&1 9>&- || die "slurmctld failed to start"
    fi
    local n
    for _ in $(seq 100); do
        scontrol ping 2>/dev/null | grep -q 'is UP' && break
        sleep 0.2
    done
    scontrol ping 2>/dev/null | grep -q 'is UP' || die "slurmctld does not answer"
    for n in "${NODES[@]}"; do
        pid_alive "$RUN/slurmd-$n.pid" && continue
        slurmd -f "$CONF" -N "$n" </dev/null >>"$LOG/slurmd-$n.out" 2>&1 9>&- || die "slurmd -N $n failed to start"
    done
}

# all nodes responding and usable (idle/mixed/allocated/completing); resumes drained/down ones once
nodes_ready() {
    local out
    out=$(sinfo -h -N -p "$PARTITION" -o '%N %t' 2>/dev/null) || return 1
    [[ $(wc -l <<<"$out") -eq $NNODES ]] || return 1
    ! grep -qvE ' (idle|mix|alloc|comp|plnd)$' <<<"$out"
}

wait_nodes() {
    local deadline=$((SECONDS + WAIT_S)) resumed=0
    while ((SECONDS < deadline)); do
        nodes_ready && return 0
        if ((resumed == 0)) && sinfo -h -N -o '%t' 2>/dev/null | grep -qE '^(drain|down|drng|fail)'; then
            sleep 2
            scontrol update nodename="$NODELIST" state=resume >/dev/null 2>&1 || true
            resumed=1
        fi
        sleep 0.5
    done
    sinfo -N -o '%N %t %E' >&2
    die "nodes not ready after ${WAIT_S}s"
}

all_up() {
    [[ -s $CONF ]] || return 1
    pid_alive "$RUN/slurmctld.pid" || return 1
    local n
    for n in "${NODES[@]}"; do pid_alive "$RUN/slurmd-$n.pid" || return 1; done
    if [[ $ACCOUNTING == slurmdbd ]]; then
        pid_alive "$RUN/slurmdbd.pid" && pid_alive "$MYSQL_PID" || return 1
    fi
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1 || return 1
    nodes_ready
}

stop_pidfiles() { # pidfile... : SIGTERM all at once, wait (bounded), then SIGKILL stragglers
    local f pid pids=() names=()
    for f in "$@"; do
        if [[ -s $f ]] && pid=$(cat "$f") && kill -0 "$pid" 2>/dev/null; then
            kill "$pid" 2>/dev/null && pids+=("$pid") && names+=("$(basename "$f" .pid)($pid)")
        fi
        rm -f "$f"
    done
    ((${#pids[@]})) || return 0
    for _ in $(seq 150); do
        kill -0 "${pids[@]}" 2>/dev/null || break
        sleep 0.1
    done
    for pid in "${pids[@]}"; do
        kill -0 "$pid" 2>/dev/null && { say "pid $pid ignores SIGTERM: SIGKILL"; kill -9 "$pid"; }
    done
    say "stopped ${names[*]}"
}

stop_slurm_daemons() { # running jobs survive this: their slurmstepds carry on, slurmctld saves state
    shopt -s nullglob
    stop_pidfiles "$RUN"/slurmd-*.pid "$RUN/slurmctld.pid"
    shopt -u nullglob
}

cmd_down() {
    if [[ -s $CONF ]] && pid_alive "$RUN/slurmctld.pid"; then
        local jobs
        jobs=$(squeue -h -o %A 2>/dev/null | tr '\n' ' ')
        if [[ -n ${jobs// /} ]]; then
            say "cancelling jobs: $jobs"
            # shellcheck disable=SC2086
            scancel $jobs 2>/dev/null
            sleep 2
        fi
    fi
    stop_slurm_daemons
    stop_pidfiles "$RUN/slurmdbd.pid"
    stop_pidfiles "$MYSQL_PID"
    if [[ -e $RUN/munged.ours ]]; then
        stop_pidfiles /run/munge/munged.pid
        rm -f "$RUN/munged.ours"
    fi
    if [[ -L /etc/slurm/slurm.conf && $(readlink /etc/slurm/slurm.conf) == "$CONF" ]]; then
        rm -f /etc/slurm/slurm.conf
    fi
}

cmd_up() {
    install_pkgs
    if [[ $(id -u) -ne 0 ]]; then # cannot start daemons (nor kill -0 root's): usable if it answers
        [[ -s $CONF ]] && nodes_ready && { say "already up (not root: not checked further)"; exit 0; }
        say "the cluster is not up and we are not root: cannot start its daemons"
        exit 3
    fi
    mkdir -p "$STATE"
    exec 9>"$STATE/.lock"
    flock -w 120 9 || die "cannot lock $STATE/.lock"
    mkdir -p "$ETC" "$LOG" "$RUN" "$STATE/spool/ctld" "$STATE/jobs"
    chmod 1777 "$STATE/jobs"
    chmod 755 "$STATE"
    local tmp
    tmp=$(mktemp -d)
    gen_configs "$tmp"
    if cmp -s "$tmp/slurm.conf" "$ETC/slurm.conf" && cmp -s "$tmp/gres.conf" "$ETC/gres.conf" \
        && cmp -s "$tmp/slurmdbd.conf" "$ETC/slurmdbd.conf" && all_up; then
        rm -rf "$tmp"
        say "already up ($(elapsed)s): $NNODES nodes, partition $PARTITION, SLURM_CONF=$CONF"
        exit 0
    fi
    # A changed configuration restarts only the daemons that read it; jobs are not cancelled
    # (other test sessions may be using the cluster).
    if [[ -s $ETC/slurm.conf ]] && ! { cmp -s "$tmp/slurm.conf" "$ETC/slurm.conf" && cmp -s "$tmp/gres.conf" "$ETC/gres.conf"; }; then
        say "slurm.conf/gres.conf changed: restarting slurmctld and slurmd"
        stop_slurm_daemons
    fi
    if [[ -s $ETC/slurmdbd.conf ]] && ! cmp -s "$tmp/slurmdbd.conf" "$ETC/slurmdbd.conf"; then
        say "slurmdbd.conf changed: restarting slurmdbd"
        stop_pidfiles "$RUN/slurmdbd.pid"
    fi
    cp "$tmp"/*.conf "$ETC"/
    rm -rf "$tmp"
    chmod 600 "$ETC/slurmdbd.conf"
    # convenience for humans and jobs without SLURM_CONF; never replaces a real file or a live
    # symlink to another state dir's cluster
    if [[ ! -e /etc/slurm/slurm.conf ]]; then
        mkdir -p /etc/slurm
        ln -sfn "$CONF" /etc/slurm/slurm.conf
    fi
    local n g
    for n in "${NODES[@]}"; do
        mkdir -p "$STATE/spool/$n" "$STATE/dev/$n"
        for ((g = 0; g < NGPUS; g++)); do
            [[ -c $STATE/dev/$n/nvidia$g ]] || mknod "$STATE/dev/$n/nvidia$g" c 1 3 || die "mknod failed"
            chmod 666 "$STATE/dev/$n/nvidia$g"
        done
    done

    start_munge
    if [[ $ACCOUNTING == slurmdbd ]]; then
        start_mariadb
        start_slurmdbd
    fi
    start_slurm
    wait_nodes
    say "up in $(elapsed)s: $NNODES nodes ($NODELIST, $NCPUS CPUs + $NGPUS fake GPUs each), partition $PARTITION, accounting $ACCOUNTING, SLURM_CONF=$CONF"
}

cmd_status() {
    [[ -s $CONF ]] || { say "no cluster configured under $STATE"; exit 1; }
    sinfo -N -o '%N %P %t %c %G %E'
    squeue
}

case "${1:-}" in
up) cmd_up ;;
down) cmd_down ;;
status) cmd_status ;;
clean) cmd_down; rm -rf "$STATE"; say "removed $STATE" ;;
*) echo "usage: $0 up|down|status|clean" >&2; exit 2 ;;
esac
