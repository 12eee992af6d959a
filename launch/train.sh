#!/usr/bin/env bash
# Usage: launch/train.sh [--zero 0|1|2|3|3-offload|auto] [--sp N] [--dry-run] CONFIG [section.key=value ...]
#
# Trains CONFIG on every GPU of this node (and of the other nodes, see below) through `accelerate launch`, with the
# accelerate config for the ZeRO stage: 0 = DDP (accelerate_configs/multi_gpu.yaml, single_gpu.yaml for one GPU),
# 1/2/3 = zero1/2/3.yaml, 3-offload = zero3_offload.yaml. `--zero auto` (the default) estimates the memory per GPU
# for each stage (harness/tools/zero_plan.py: parameters, 16 bytes/param partitioned by stage, activations), prints the
# arithmetic and takes the lowest stage that fits; when only CPU offload (or nothing) fits but sequence parallelism
# (a row of data.max_len tokens too long for one GPU) or activation checkpointing makes a stage fit, it takes that
# stage and adds train.sequence_parallel=N and/or model.gradient_checkpointing=true (the plan's `proposed:` line; not
# when the command sets one of those keys). Other overrides go to the run unchanged. Paths are relative to the
# repository root (the script runs there).
#
# Output goes to the terminal and to <train.output_dir>/train.log (train-node<R>.log on several nodes).
# Restarting the same command resumes from the newest complete checkpoint (train.resume=auto is the default), also on a
# box with another number of GPUs: the run keeps its global batch (the accumulation is chosen for the new count), its
# data position and its optimizer state (ZeRO's through a DeepSpeed universal checkpoint); --zero auto then keeps the
# stage the checkpoints were written with.
# If the launcher fails (a lost worker, an NCCL error), the run is retried up to MAX_RETRIES times, each retry
# resuming; a bad config or data (a `harness: error:` line) is not retried. On SIGTERM/SIGINT the signal is
# forwarded to the training processes (not to accelerate's launcher, which would exit 1 with a traceback), which
# finish their step, write a checkpoint and exit; the script then exits 0 without retrying (a checkpoint was written
# after the signal; otherwise the launcher's exit status): run the same command again to continue.
#
# `--sp N` (docs/long-context.md) trains with sequence parallelism: N GPUs share each row (train.sequence_parallel=N);
# N divides the GPUs and the model's attention heads, it needs ZeRO 1-3 (`--zero auto` divides the activations per GPU
# by N and never picks 0), and the batch counts data-parallel ranks (GPUs / N).
#
# Without a GPU it runs one CPU process (accelerate_configs/cpu.yaml) and says so.
#
# Environment (defaults in brackets):
#   ZERO          the stage when --zero is not given [auto]
#   NUM_GPUS      GPUs per node [CUDA_VISIBLE_DEVICES's count, else nvidia-smi -L, else 0 = CPU]
#   GPU_MEM_GB    GiB per GPU for --zero auto [nvidia-smi's smallest GPU]
#   HOST_MEM_GB   host GiB per node for the 3-offload check [this machine's]
#   NUM_NODES     machines [1]; with more than 1 also set NODE_RANK (0..NUM_NODES-1) and MASTER_ADDR (node 0's
#                 address) and run the same command on every node
#   MASTER_PORT   rendezvous port on node 0 [29500]
#   MAX_RETRIES   retries after a failed attempt [3]
#   RETRY_DELAY   seconds before a retry [30]
#   LOG_FILE      log file [<output_dir>/train.log]
#   PYTHON, PERSIST_DIR, DRY_RUN: see launch/common.sh
# NUM_GPUS, GPU_MEM_GB and HOST_MEM_GB also let --dry-run show what a bigger machine would run, e.g.
#   NUM_GPUS=8 GPU_MEM_GB=80 launch/train.sh --dry-run --zero auto configs/llama-7b.yaml
set -euo pipefail
# shellcheck source=launch/common.sh
source "$(dirname "$0")/common.sh"
# a stop signal before the training processes exist ends the script once the command in flight (reading the config,
# the memory plan) is done: a shell killed at once would leave that command writing into a closed pipe
trap 'exit 143' TERM
trap 'exit 130' INT

ZERO=${ZERO:-auto}
NUM_NODES=${NUM_NODES:-1}
MASTER_PORT=${MASTER_PORT:-29500}
MAX_RETRIES=${MAX_RETRIES:-3}
RETRY_DELAY=${RETRY_DELAY:-30}

CONFIG=
ARGS=()
while [ $# -gt 0 ]; do
  case $1 in
    -h | --help) usage; exit 0 ;;
    --dry-run) DRY_RUN=1 ;;
    --zero) [ $# -ge 2 ] || die "--zero needs a value: 0, 1, 2, 3, 3-offload or auto"; ZERO=$2; shift ;;
    --zero=*) ZERO=${1#--zero=} ;;
    --sp) [ $# -ge 2 ] || die "--sp needs a value: the GPUs per sequence-parallel group"; SP=$2; shift ;;
    --sp=*) SP=${1#--sp=} ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) if [ -z "$CONFIG" ]; then CONFIG=$1; else ARGS+=("$1"); fi ;;
  esac
  shift
done
[ -n "$CONFIG" ] || { usage >&2; exit 2; }
if [ -n "${SP:-}" ]; then
  case $SP in '' | *[!0-9]* | 0) die "--sp must be a number >= 1, got '$SP'" ;; esac
  ARGS+=("train.sequence_parallel=$SP")
fi
case $ZERO in 0 | 1 | 2 | 3 | 3-offload | auto) ;; *) die "--zero must be 0, 1, 2, 3, 3-offload or auto, got '$ZERO'" ;; esac
[ -f "$CONFIG" ] || die "config file not found: $CONFIG (paths are relative to the repository root)"

OUT=$(output_dir_of "$CONFIG" "${ARGS[@]}") || exit $?
GPUS=$(count_gpus)
case $GPUS in '' | *[!0-9]*) die "NUM_GPUS must be a number, got '$GPUS'" ;; esac
case $NUM_NODES in '' | *[!0-9]* | 0) die "NUM_NODES must be a number >= 1, got '$NUM_NODES'" ;; esac

LAUNCH=("$PYTHON" -m harness.tools.launcher)  # accelerate launch, exiting with the training processes' status
if [ "$GPUS" -eq 0 ]; then
  [ "$NUM_NODES" -eq 1 ] || die "no GPU found on this node, but NUM_NODES=$NUM_NODES"
  if [ "${SP:-1}" -gt 1 ]; then  # one CPU process cannot hold a group of SP; DeepSpeed on the CPU needs no --cpu
    die "--sp $SP needs $SP processes under DeepSpeed, and without a GPU this script runs ONE CPU process; on a CPU: $PYTHON -m accelerate.commands.launch --config_file accelerate_configs/zero3.yaml --num_processes $SP harness/train.py --config $CONFIG ${ARGS[*]} (docs/long-context.md)"
  fi
  say "no GPU found (nvidia-smi/CUDA_VISIBLE_DEVICES/NUM_GPUS): falling back to ONE CPU process; --zero is ignored"
  CMD=("${LAUNCH[@]}" --config_file accelerate_configs/cpu.yaml harness/train.py --config "$CONFIG")
else
  WORLD=$((GPUS * NUM_NODES))
  say "$NUM_NODES node(s) x $GPUS GPU(s) = $WORLD processes"
  if [ "$ZERO" = auto ]; then
    MEM=$(gpu_mem_gb)
    [ -n "$MEM" ] || die "cannot read the GPU memory (nvidia-smi); set GPU_MEM_GB or use --zero N"
    PLAN_CMD=("$PYTHON" -m harness.cli zero-plan "$CONFIG" "${ARGS[@]}" --gpus "$GPUS" --nodes "$NUM_NODES" --gpu-mem-gb "$MEM")
    if [ -n "${HOST_MEM_GB:-}" ]; then PLAN_CMD+=(--host-mem-gb "$HOST_MEM_GB"); fi
    show "${PLAN_CMD[@]}"
    PLAN_RC=0
    PLAN=$("${PLAN_CMD[@]}") || PLAN_RC=$?
    printf '%s\n' "$PLAN"
    CHOICE=${PLAN##*choice: }
    # `proposed: zeroN train.sequence_parallel=N model.gradient_checkpointing=true -> ...` (either or both):
    # sequence parallelism or activation checkpointing makes a stage fit without CPU offload; taken unless the
    # command sets one of those keys itself
    PROPOSED=$(printf '%s\n' "$PLAN" | sed -n 's/^proposed: \(zero[0-3]\) \(.*\) -> accelerate_configs\/.*/\1 \2/p' | tail -n 1)
    EXTRA=()
    if [ -n "$PROPOSED" ]; then read -r -a EXTRA <<< "${PROPOSED#* }"; fi
    for p in "${EXTRA[@]}"; do
      for a in "${ARGS[@]}"; do case $a in "${p%%=*}"=*) PROPOSED= ;; esac; done
    done
    if [ "$PLAN_RC" -ne 0 ] || { [ "$CHOICE" = none ] && [ -z "$PROPOSED" ]; }; then
      die "--zero auto: no ZeRO stage fits (see above)" 3
    fi
    if [ -n "$PROPOSED" ]; then
      CHOICE=${PROPOSED%% *}
      ARGS+=("${EXTRA[@]}")
      say "--zero auto: stage ${CHOICE#zero} fits with the plan's proposal; adding ${EXTRA[*]}"
    fi
    ZERO=${CHOICE#zero}
    ZERO=${ZERO/_/-}
    say "--zero auto chose stage $ZERO"
    KEEP=$(checkpoint_stage "$OUT")
    if [ -n "$KEEP" ] && [ "$KEEP" != "${ZERO%-offload}" ]; then
      say "resuming: keeping ZeRO stage $KEEP, the stage of the run's checkpoints (a checkpoint resumes under its own stage, on any number of GPUs)"
      ZERO=$KEEP
    fi
  fi
  case $ZERO in
    0) if [ "$WORLD" -eq 1 ]; then ACC=single_gpu; else ACC=multi_gpu; fi ;;
    3-offload) ACC=zero3_offload ;;
    *) ACC=zero$ZERO ;;
  esac
  CMD=("${LAUNCH[@]}" --config_file "accelerate_configs/$ACC.yaml" --num_processes "$WORLD" --num_machines "$NUM_NODES")
  if [ "$NUM_NODES" -gt 1 ]; then
    [ -n "${NODE_RANK:-}" ] || die "NUM_NODES=$NUM_NODES: set NODE_RANK (0..$((NUM_NODES - 1))) on each node"
    [ -n "${MASTER_ADDR:-}" ] || die "NUM_NODES=$NUM_NODES: set MASTER_ADDR to node 0's address"
    CMD+=(--machine_rank "$NODE_RANK" --main_process_ip "$MASTER_ADDR" --main_process_port "$MASTER_PORT")
    if [ "$ZERO" != 0 ]; then CMD+=(--deepspeed_multinode_launcher standard); fi
    say "node $NODE_RANK of $NUM_NODES: run the same command on every node with its NODE_RANK"
  fi
  CMD+=(harness/train.py --config "$CONFIG")
fi
CMD+=("${ARGS[@]}")

if [ "$NUM_NODES" -gt 1 ]; then LOG=${LOG_FILE:-$OUT/train-node$NODE_RANK.log}; else LOG=${LOG_FILE:-$OUT/train.log}; fi
say "run folder $OUT; log $LOG; resumes from its newest checkpoint when restarted (train.resume=auto)"
if [ "$DRY_RUN" = 1 ]; then
  show "${CMD[@]}"
  say "dry run: nothing started (a failed attempt would be retried up to $MAX_RETRIES times, with train.resume=auto)"
  exit 0
fi
mkdir -p "$(dirname "$LOG")"

# ------------------------------------------------------------------ run, forward stop signals, retry on failure
SIGNAL=
SIGNAL_AT=
LAUNCHER=
WORKERS=()
on_signal() {
  SIGNAL=$1
  SIGNAL_AT=${SIGNAL_AT:-$(date +%s)}  # a second signal is forwarded too (the workers then stop at once)
  if [ -z "$LAUNCHER" ]; then exit 130; fi
  mapfile -t WORKERS < <(workers_of "$LAUNCHER")
  if [ ${#WORKERS[@]} -eq 0 ]; then WORKERS=("$LAUNCHER"); fi
  say "SIG$1 received: asking the training processes (${WORKERS[*]}) to checkpoint and stop"
  kill -TERM "${WORKERS[@]}" 2> /dev/null || true
}
trap 'on_signal TERM' TERM
trap 'on_signal INT' INT

attempt=0
while :; do
  attempt=$((attempt + 1))
  START=0; if [ -f "$LOG" ]; then START=$(wc -c < "$LOG"); fi
  printf '\n=== %s attempt %d: %s\n' "$(date -u +%FT%TZ)" "$attempt" "$(show "${CMD[@]}")" >> "$LOG"
  show "${CMD[@]}"
  # tee ignores the signals so that the workers can still log while they checkpoint
  "${CMD[@]}" > >(trap '' INT TERM; exec tee -a "$LOG") 2>&1 &
  LAUNCHER=$!
  rc=0
  while :; do
    wait "$LAUNCHER" && rc=0 || rc=$?
    if ! kill -0 "$LAUNCHER" 2> /dev/null; then break; fi
  done
  if [ -n "$SIGNAL" ]; then
    for pid in "${WORKERS[@]}"; do
      while kill -0 "$pid" 2> /dev/null; do sleep 0.2; done
    done
    # a checkpoint completed since the signal (its COMPLETE marker is written last) = a clean stop, whatever the
    # launcher says (accelerate exits 1 or 143 when torch elastic got the signal itself, e.g. Ctrl-C to the group)
    SAVED=$(find "$OUT/checkpoints" -mindepth 2 -maxdepth 2 -name COMPLETE -newermt "@$((SIGNAL_AT - 1))" 2> /dev/null \
      | sort -V | tail -n 1)
    if [ "$rc" -eq 0 ] || [ -n "$SAVED" ]; then
      say "stopped by SIG$SIGNAL${SAVED:+ with checkpoint ${SAVED%/COMPLETE}}; run the same command to resume"
      exit 0
    fi
    say "stopped by SIG$SIGNAL (launcher exit $rc) without a new checkpoint; the newest is in $OUT/checkpoints"
    exit "$rc"
  fi
  if [ "$rc" -eq 0 ]; then
    say "finished: $OUT (report.json, final/, tensorboard/, log $LOG)"
    exit 0
  fi
  if tail -c +$((START + 1)) "$LOG" | grep -q 'harness: error:'; then
    say "failed with a harness error (exit $rc): fix the config or data; not retrying"
    exit "$rc"
  fi
  if [ "$attempt" -gt "$MAX_RETRIES" ]; then
    say "failed (exit $rc) after $MAX_RETRIES retries; see $LOG"
    exit "$rc"
  fi
  say "attempt $attempt failed (exit $rc): retry $attempt of $MAX_RETRIES in ${RETRY_DELAY}s, resuming from the newest checkpoint"
  sleep "$RETRY_DELAY"
  if [ -n "$SIGNAL" ]; then say "stopped by SIG$SIGNAL before the retry"; exit 143; fi
  if [ "$attempt" -eq 1 ]; then CMD+=(train.resume=auto); fi
done
