# shellcheck shell=bash
# sbatch/common.sh -- sourced by ckpteval's batch scripts (train_eval, backfill, eval_service).
#
# Owns: launching the job's programs as job steps, supervising them, turning SLURM's signals into a
# clean stop (leases released, trainer checkpointed) and requeueing the job. Defines functions and
# defaults only; the scripts decide what to launch.
#
# Exit codes of the programs it relies on (defined in jobs/lifecycle.py; tests/test_lifecycle.py checks them):
#   ckpteval worker: 0 done, 3 preempted (lease released: requeue me), 4 engine unhealthy, else error
#   ckpteval train:  0 done, 75 preempted (training checkpoint saved: rerun with --resume)
#
# Signals (the scripts carry --signal=B:USR1@T and --requeue):
#   USR1  the time limit is near (or an admin's notice): forward USR1 to every step -- srun forwards
#         USR1 to its tasks (SIGTERM would make srun SIGKILL them) -- so workers release their leases
#         and the trainer saves a checkpoint; wait up to CKPTEVAL_GRACE_S for them, then
#         `scontrol requeue $SLURM_JOB_ID` and exit 0.
#   TERM  scancel / scontrol requeue / time limit / preemption: SLURM signals every step's tasks itself
#         (and SIGKILLs them after KillWait); forward USR1 as well, wait, exit 143. No requeue from here.
# A worker that ends with 3 or 4 on its own is restarted in place (CKPTEVAL_WORKER_RESTARTS times);
# when nothing runs any more and a worker still ended with 3/4, the job requeues itself (at most
# CKPTEVAL_MAX_REQUEUES restarts, counted by SLURM_RESTART_COUNT) for a fresh start.
#
# Limits: a step still running CKPTEVAL_GRACE_S after a stop request is left to SLURM (the batch
# script exits and the job's end kills it). Needs bash >= 4.4. The scripts run without `set -e`:
# a supervisor must outlive its children's failures to stop the rest cleanly.

CKPTEVAL_WORKER_PREEMPTED=3
CKPTEVAL_WORKER_UNHEALTHY=4
CKPTEVAL_TRAIN_PREEMPTED=75

ckpteval_log() { printf 'ckpteval[%s %s]: %s\n' "${SLURM_JOB_ID:-nojob}" "$(date +%H:%M:%S)" "$*" >&2; }

ckpteval_die() {
    ckpteval_log "ERROR: $*"
    exit 2
}

# ckpteval_init: defaults for every CKPTEVAL_* setting, the command arrays, the signal traps.
ckpteval_init() {
    : "${CKPTEVAL_PYTHON:=python3}"
    : "${CKPTEVAL_GRACE_S:=60}"
    : "${CKPTEVAL_WORKER_RESTARTS:=2}"
    : "${CKPTEVAL_RESTART_PAUSE_S:=5}"
    : "${CKPTEVAL_MAX_REQUEUES:=20}"
    # auto: each worker picks sglang when it is importable and the worker has GPUs, else hf (at start, on its node)
    : "${CKPTEVAL_ENGINE:=auto}"
    : "${CKPTEVAL_WORKERS:=1}"
    : "${CKPTEVAL_GPUS_PER_WORKER:=1}"
    if [[ -z ${CKPTEVAL_DEVICE:-} ]]; then
        if ((CKPTEVAL_GPUS_PER_WORKER > 0)); then CKPTEVAL_DEVICE=cuda; else CKPTEVAL_DEVICE=cpu; fi
    fi
    # shellcheck disable=SC2034 # used by the scripts that source this file
    # -P: never import from the working directory (SLURM's default: the submit dir, where a user's own
    # jobs/ or coord/ package may be); ckpteval comes from CKPTEVAL_PYTHON's installation only
    CKPTEVAL_CLI=("$CKPTEVAL_PYTHON" -P -m ckpteval.jobs.cli)
    CKPTEVAL_STOP=""        # "" | requeue | term | failed
    CKPTEVAL_STOP_DEADLINE=0
    CKPTEVAL_FAIL_RC=0
    CKPTEVAL_TRAINER_PID=""
    CKPTEVAL_JUDGE_PID=""   # the judge server's step (train_eval with a judge component)
    CKPTEVAL_WPID=()        # per worker: srun pid ("" once ended)
    CKPTEVAL_WRC=()         # per worker: last exit code ("" while running)
    CKPTEVAL_WRESTARTS=()
    CKPTEVAL_WNODE=()
    CKPTEVAL_WSLOT=()
    CKPTEVAL_STEP_ARGS=()   # e.g. (--het-group=1) for the fleet of a heterogeneous job
    CKPTEVAL_WORKER_CMD=()  # the worker program and its flags, without --worker-id
    trap '_ckpteval_on_signal USR1' USR1
    trap '_ckpteval_on_signal TERM' TERM
    ckpteval_log "job ${SLURM_JOB_ID:-?} restart ${SLURM_RESTART_COUNT:-0} on ${SLURMD_NODENAME:-$(hostname)}"
}

_ckpteval_pids() {
    local p
    [[ -n $CKPTEVAL_TRAINER_PID ]] && printf '%s\n' "$CKPTEVAL_TRAINER_PID"
    [[ -n $CKPTEVAL_JUDGE_PID ]] && printf '%s\n' "$CKPTEVAL_JUDGE_PID"
    for p in "${CKPTEVAL_WPID[@]}"; do [[ -n $p ]] && printf '%s\n' "$p"; done
    return 0
}

_ckpteval_forward() { # forward USR1 to every step we run (srun passes it on to its tasks)
    local p
    for p in $(_ckpteval_pids); do kill -USR1 "$p" 2>/dev/null || true; done
}

_ckpteval_on_signal() {
    local sig=$1
    if [[ $sig == USR1 ]]; then
        ckpteval_log "USR1 (time limit near or preemption notice): stopping every step, then requeue"
        [[ $CKPTEVAL_STOP == term ]] || CKPTEVAL_STOP=requeue
    else
        ckpteval_log "TERM (job cancelled, requeued, preempted or out of time): stopping every step"
        CKPTEVAL_STOP=term
    fi
    CKPTEVAL_STOP_DEADLINE=$((SECONDS + CKPTEVAL_GRACE_S))
    _ckpteval_forward
}

# ckpteval_request_stop MODE MESSAGE: stop every step (as if signalled) and end as MODE.
ckpteval_request_stop() {
    [[ -n $CKPTEVAL_STOP ]] && return 0
    ckpteval_log "$2: stopping every step"
    CKPTEVAL_STOP=$1
    CKPTEVAL_STOP_DEADLINE=$((SECONDS + CKPTEVAL_GRACE_S))
    _ckpteval_forward
}

# _ckpteval_reap PID: REPLY := its exit status (the process has ended).
_ckpteval_reap() {
    local rc=0
    wait "$1" 2>/dev/null || rc=$?
    REPLY=$rc
}

_ckpteval_alive() { [[ -n ${1:-} ]] && kill -0 "$1" 2>/dev/null; }

_ckpteval_nap() { # one interruptible second
    sleep "${1:-1}" &
    wait $! 2>/dev/null || true
}

# ckpteval_wait_file PATH TIMEOUT_S: wait for PATH while the trainer (if any) lives; 0 when it exists.
ckpteval_wait_file() {
    local deadline=$((SECONDS + $2))
    while [[ ! -e $1 ]]; do
        [[ -n $CKPTEVAL_STOP ]] && return 1
        if [[ -n $CKPTEVAL_TRAINER_PID ]] && ! _ckpteval_alive "$CKPTEVAL_TRAINER_PID"; then return 1; fi
        ((SECONDS < deadline)) || return 1
        _ckpteval_nap 0.5
    done
}

# ckpteval_plan_workers N NODE...: worker i runs on node[i / per_node] in GPU slot i % per_node.
ckpteval_plan_workers() {
    local n=$1 i per
    shift
    (($# > 0)) || ckpteval_die "no nodes to place $n worker(s) on"
    per=$(((n + $# - 1) / $#))
    local nodes=("$@")
    for ((i = 0; i < n; i++)); do
        CKPTEVAL_WNODE[i]=${nodes[i / per]}
        CKPTEVAL_WSLOT[i]=$((i % per))
        CKPTEVAL_WRESTARTS[i]=0
        CKPTEVAL_WRC[i]=""
        CKPTEVAL_WPID[i]=""
    done
}

ckpteval_worker_id() { # a stable name per job (array task) and worker index
    local base=${SLURM_JOB_ID:-local}
    [[ -n ${SLURM_ARRAY_JOB_ID:-} ]] && base=${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}
    printf '%s-w%s' "${CKPTEVAL_WORKER_ID_PREFIX:-j$base}" "$1"
}

# ckpteval_start_worker I: one job step for worker I on its node, its GPU slot sliced out of the
# step's CUDA_VISIBLE_DEVICES (--overlap: workers share the component's CPUs; GPUs are split by slot).
ckpteval_start_worker() {
    local i=$1 id
    id=$(ckpteval_worker_id "$i")
    ckpteval_log "worker $id: node ${CKPTEVAL_WNODE[i]} slot ${CKPTEVAL_WSLOT[i]} (${CKPTEVAL_GPUS_PER_WORKER} GPU(s))"
    srun "${CKPTEVAL_STEP_ARGS[@]}" --nodes=1 --ntasks=1 --overlap --nodelist="${CKPTEVAL_WNODE[i]}" \
        --job-name="ckpteval-$id" \
        "$CKPTEVAL_PYTHON" -P -m ckpteval.jobs.launch.slurm_env exec --slot "${CKPTEVAL_WSLOT[i]}" --gpus "$CKPTEVAL_GPUS_PER_WORKER" -- \
        "${CKPTEVAL_WORKER_CMD[@]}" --worker-id "$id" &
    CKPTEVAL_WPID[i]=$!
    CKPTEVAL_WRC[i]=""
}

ckpteval_start_workers() {
    local i
    for ((i = 0; i < ${#CKPTEVAL_WNODE[@]}; i++)); do ckpteval_start_worker "$i"; done
}

# ckpteval_start_judge HETGROUP CMD...: the judge server as one job step (python -P -m ckpteval.jobs.launch.judge_server
# picks a port for CMD's {port}, waits for /v1/models, writes RUN/judge.json). The stale judge.json of an
# earlier start is removed first, so workers never call a judge that is gone. Not supervised: the job
# ends with its trainer and workers, then ckpteval_stop_judge stops it.
ckpteval_start_judge() {
    local group=$1
    shift
    rm -f "$RUN/judge.json"
    ckpteval_log "judge server (het group $group): $*"
    srun --het-group="$group" --nodes=1 --ntasks=1 --job-name=ckpteval-judge \
        "$CKPTEVAL_PYTHON" -P -m ckpteval.jobs.launch.judge_server --run-dir "$RUN" -- "$@" &
    CKPTEVAL_JUDGE_PID=$!
}

ckpteval_stop_judge() {
    _ckpteval_alive "$CKPTEVAL_JUDGE_PID" || return 0
    ckpteval_log "stopping the judge server"
    kill -USR1 "$CKPTEVAL_JUDGE_PID" 2>/dev/null || true
    local deadline=$((SECONDS + CKPTEVAL_GRACE_S))
    while _ckpteval_alive "$CKPTEVAL_JUDGE_PID" && ((SECONDS < deadline)); do _ckpteval_nap 1; done
    CKPTEVAL_JUDGE_PID=""
}

_ckpteval_trainer_ended() {
    local rc=$1
    CKPTEVAL_TRAINER_PID=""
    case $rc in
    0) ckpteval_log "trainer finished; the fleet drains the remaining units" ;;
    "$CKPTEVAL_TRAIN_PREEMPTED")
        ckpteval_log "trainer preempted (checkpoint saved)"
        ckpteval_request_stop requeue "trainer preempted"
        ;;
    *)
        if [[ -n $CKPTEVAL_STOP ]]; then
            ckpteval_log "trainer stopped (exit $rc)"
        else
            ckpteval_log "trainer FAILED with exit code $rc: ending the eval fleet (no orphan GPUs)"
            CKPTEVAL_FAIL_RC=$rc
            ckpteval_request_stop failed "trainer failed"
        fi
        ;;
    esac
    return 0
}

_ckpteval_worker_ended() {
    local i=$1 rc=$2 id
    id=$(ckpteval_worker_id "$i")
    CKPTEVAL_WPID[i]=""
    CKPTEVAL_WRC[i]=$rc
    if [[ -n $CKPTEVAL_STOP ]]; then
        ckpteval_log "worker $id stopped (exit $rc)"
        return 0
    fi
    case $rc in
    0) ckpteval_log "worker $id done" ;;
    "$CKPTEVAL_WORKER_PREEMPTED" | "$CKPTEVAL_WORKER_UNHEALTHY")
        if ((CKPTEVAL_WRESTARTS[i] < CKPTEVAL_WORKER_RESTARTS)); then
            CKPTEVAL_WRESTARTS[i]=$((CKPTEVAL_WRESTARTS[i] + 1))
            ckpteval_log "worker $id exited $rc: restart ${CKPTEVAL_WRESTARTS[i]}/$CKPTEVAL_WORKER_RESTARTS in ${CKPTEVAL_RESTART_PAUSE_S}s"
            _ckpteval_nap "$CKPTEVAL_RESTART_PAUSE_S"
            if [[ -z $CKPTEVAL_STOP ]]; then ckpteval_start_worker "$i"; fi
        else
            ckpteval_log "worker $id exited $rc; no restarts left"
        fi
        ;;
    *) ckpteval_log "worker $id FAILED with exit code $rc" ;;
    esac
    return 0
}

# ckpteval_supervise: poll the trainer (if any) and the workers once a second until none runs, or
# until CKPTEVAL_GRACE_S after a stop request.
ckpteval_supervise() {
    local i running
    while :; do
        if [[ -n $CKPTEVAL_TRAINER_PID ]] && ! _ckpteval_alive "$CKPTEVAL_TRAINER_PID"; then
            _ckpteval_reap "$CKPTEVAL_TRAINER_PID"
            _ckpteval_trainer_ended "$REPLY"
        fi
        running=0
        [[ -n $CKPTEVAL_TRAINER_PID ]] && running=1
        for ((i = 0; i < ${#CKPTEVAL_WNODE[@]}; i++)); do
            [[ -n ${CKPTEVAL_WPID[i]} ]] || continue
            if _ckpteval_alive "${CKPTEVAL_WPID[i]}"; then
                running=1
            else
                _ckpteval_reap "${CKPTEVAL_WPID[i]}"
                _ckpteval_worker_ended "$i" "$REPLY"
                [[ -n ${CKPTEVAL_WPID[i]} ]] && running=1
            fi
        done
        ((running)) || return 0
        if [[ -n $CKPTEVAL_STOP ]] && ((SECONDS >= CKPTEVAL_STOP_DEADLINE)); then
            ckpteval_log "steps still running ${CKPTEVAL_GRACE_S}s after the stop request: leaving them to SLURM"
            return 0
        fi
        _ckpteval_nap 1
    done
}

ckpteval_requeue() { # $1: why
    if [[ -z ${SLURM_JOB_ID:-} ]]; then
        ckpteval_log "$1, but not inside SLURM: no requeue"
        exit 3
    fi
    ckpteval_log "$1: scontrol requeue $SLURM_JOB_ID"
    if scontrol requeue "$SLURM_JOB_ID"; then
        exit 0
    fi
    ckpteval_log "scontrol requeue $SLURM_JOB_ID failed"
    exit 3
}

# ckpteval_finish: the job's exit: requeue, or the outcome of its programs.
ckpteval_finish() {
    local i rc worst=0 retry=0
    case $CKPTEVAL_STOP in
    requeue) ckpteval_requeue "stopped for requeue" ;;
    term) exit 143 ;;
    failed) exit "$CKPTEVAL_FAIL_RC" ;;
    esac
    for ((i = 0; i < ${#CKPTEVAL_WNODE[@]}; i++)); do
        rc=${CKPTEVAL_WRC[i]:-0}
        case $rc in
        0) ;;
        "$CKPTEVAL_WORKER_PREEMPTED" | "$CKPTEVAL_WORKER_UNHEALTHY") retry=1 ;;
        *) ((rc > worst)) && worst=$rc ;;
        esac
    done
    if ((retry && worst == 0)); then
        if ((${SLURM_RESTART_COUNT:-0} < CKPTEVAL_MAX_REQUEUES)); then
            ckpteval_requeue "worker(s) preempted or unhealthy with no restarts left"
        fi
        ckpteval_log "worker(s) preempted or unhealthy, and ${CKPTEVAL_MAX_REQUEUES} requeues used up"
        exit 4
    fi
    ckpteval_log "done (exit $worst)"
    exit "$worst"
}
