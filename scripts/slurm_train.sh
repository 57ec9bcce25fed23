#!/bin/bash
# PSANet training on a Slurm cluster: one paddle.distributed.launch per node, requeued
# after a preemption or the time limit, continuing from the newest checkpoint.
#
#   sbatch --nodes 2 --gres gpu:4 scripts/slurm_train.sh \
#       --config configs/psanet/psanet_resnet50_os8_cityscapes_1024x512_80k.yml \
#       --save_dir /data/output/psanet_r50 --batch_size 1 --do_eval --save_interval 1000
#
# Submit from the repository root, on a file system every node sees (the nodes read
# the checkpoint they resume from in --save_dir). The arguments are train.py's; the
# script adds --resume_model auto. docs/training.md ("On a cluster") says what a
# preemption and a lost node cost.
#
# The batch step runs `srun ... slurm_train.sh --node ARGS`: one task per node, each
# the per-node part below, which needs only the variables Slurm sets in a step
# (SLURM_NODEID, SLURM_NNODES, SLURM_JOB_NODELIST, SLURM_JOB_ID) and can be run as it
# is (tests/test_slurm_script.py runs it twice on one machine). Settings:
#   PSANET_GPUS               --gpus of each launcher (default 0,1,2,3; "cpu": gloo on
#                             the CPU, --nproc_per_node PSANET_NPROC_PER_NODE, default 1)
#   PSANET_MASTER_PORT        the rendezvous port on the first node (default 10000 +
#                             SLURM_JOB_ID % 20000, below Paddle's rank ports 35100-64000)
#   PSANET_RENDEZVOUS_TIMEOUT seconds a node waits for all the others (default 300)
#   PSANET_LOG_DIR            the launchers' logs: <it>/slurm-<job>.<restart>/node<N>/
#                             workerlog.* (default log)
#
# TERM@120: Slurm sends SIGTERM to every process of the step 120 s before the time
# limit. The ranks finish their step, rank 0 writes iter_<step>, all exit 143; then
# this script requeues the job. 120 s holds two R50 steps, its 405 MiB write and the
# exit with room to spare; raise it for a slower disk or a larger model.
#SBATCH --job-name=psanet
#SBATCH --ntasks-per-node=1
#SBATCH --requeue
#SBATCH --signal=TERM@120
#SBATCH --open-mode=append
#SBATCH --output=slurm-%j.out

set -u

# The first host of a Slurm node list: "node[03-05,07],gpu1" -> node03.
first_host() {
    local list=$1
    if command -v scontrol >/dev/null 2>&1; then
        scontrol show hostnames "$list" | head -n 1
        return
    fi
    # Without scontrol: a name, a list of names, or prefix[range,...]suffix first.
    if [[ $list =~ ^([^,\[]+)\[([^],-]+)[^]]*\]([^,]*) ]]; then
        echo "${BASH_REMATCH[1]}${BASH_REMATCH[2]}${BASH_REMATCH[3]}"
    else
        echo "${list%%,*}"
    fi
}

# The launcher's --master must be an IP address: a node starts the rendezvous server only
# when the address is its own (Paddle's HTTPMaster compares it with its gethostbyname).
host_ip() {
    python -c 'import socket, sys; print(socket.gethostbyname(sys.argv[1]))' "$1"
}

# Prints the master endpoint this node would use; for checking a job's variables.
print_master() {
    local host ip
    host=$(first_host "${SLURM_JOB_NODELIST:?}") || return 1
    if ! ip=$(host_ip "$host" 2>/dev/null); then
        echo "error: $host, the first node of SLURM_JOB_NODELIST ($SLURM_JOB_NODELIST)," \
            "has no address here" >&2
        return 1
    fi
    local port=${PSANET_MASTER_PORT:-$((10000 + ${SLURM_JOB_ID:?} % 20000))}
    if ! [[ $port =~ ^[0-9]{1,5}$ ]] || ((10#$port < 1 || 10#$port > 65535)); then
        echo "error: PSANET_MASTER_PORT=$port is not a port number (1 to 65535): give one" \
            "that is free on the first node, or unset it (10000 + job id % 20000)" >&2
        return 1
    fi
    echo "$ip:$((10#$port))"
}

# What srun runs on each node: one launcher, its ranks numbered after the node's.
node_main() {
    local node=${SLURM_NODEID:?} nnodes=${SLURM_NNODES:?} master
    if ! [[ $node =~ ^[0-9]{1,6}$ && $nnodes =~ ^[0-9]{1,6}$ ]] || ((10#$node >= 10#$nnodes)); then
        echo "error: SLURM_NODEID=$node is not a node of SLURM_NNODES=$nnodes: run this" \
            "part through srun in a job (sbatch scripts/slurm_train.sh ...)" >&2
        exit 2
    fi
    master=$(print_master) || exit 2
    local log_dir=${PSANET_LOG_DIR:-log}/slurm-${SLURM_JOB_ID}.${SLURM_RESTART_COUNT:-0}/node$node
    local devices=(--gpus "${PSANET_GPUS:-0,1,2,3}")
    if [[ ${PSANET_GPUS:-} == cpu ]]; then
        devices=(--nproc_per_node "${PSANET_NPROC_PER_NODE:-1}")
    fi
    # exec: the launcher is this task's process, so a signal to the task reaches it once.
    # psanet.launch: Paddle's launcher, ended in one line past PSANET_RENDEZVOUS_TIMEOUT.
    exec python -m psanet.launch --master "$master" --nnodes "$nnodes" \
        --rank "$node" --log_dir "$log_dir" "${devices[@]}" \
        train.py "$@" --resume_model auto
}

# The batch step: one task per node, then a requeue when the nodes stopped for a signal.
batch_main() {
    cd "${SLURM_SUBMIT_DIR:?submit with sbatch from the repository root}" || exit 2
    # Slurm's SIGTERM reaches the step's processes itself; this shell waits for srun.
    trap 'echo "slurm_train.sh: SIGTERM; the nodes save and stop"' TERM
    srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash scripts/slurm_train.sh --node "$@" &
    local step=$! code
    while :; do
        wait "$step"
        code=$?
        kill -0 "$step" 2>/dev/null || break
    done
    # 143: a rank's exit after SIGTERM and its checkpoint; 15: a signalled launcher's.
    # Not after scancel: the job is CANCELLED by the time the nodes have stopped.
    if ((code == 143 || code == 15)) &&
        ! scontrol show job "$SLURM_JOB_ID" | grep -q 'JobState=CANCELLED'; then
        echo "slurm_train.sh: the nodes stopped with a checkpoint; requeueing job $SLURM_JOB_ID"
        scontrol requeue "$SLURM_JOB_ID"
    fi
    exit "$code"
}

case ${1:-} in
    --node) shift; node_main "$@" ;;
    --print-master) print_master ;;
    *) batch_main "$@" ;;
esac
