#!/usr/bin/env bash
# Usage: launch/tensorboard.sh [--dry-run] [LOGDIR]
#
# Serves the tensorboard logs of every run under LOGDIR (default runs/: each run writes <output_dir>/tensorboard/).
# On a rented box it listens on localhost only; open it through an SSH tunnel from your computer:
#   ssh -p SSH_PORT -L 6006:localhost:6006 root@BOX_ADDRESS     then browse http://localhost:6006
# (or BIND=0.0.0.0 on a box whose port PORT is published, e.g. a Vast.ai open port).
#
# Environment (defaults in brackets):
#   PORT   port [6006]
#   BIND   address to listen on [127.0.0.1]
#   PYTHON, DRY_RUN: see launch/common.sh
set -euo pipefail
# shellcheck source=launch/common.sh
source "$(dirname "$0")/common.sh"

PORT=${PORT:-6006}
BIND=${BIND:-127.0.0.1}
LOGDIR=
while [ $# -gt 0 ]; do
  case $1 in
    -h | --help) usage; exit 0 ;;
    --dry-run) DRY_RUN=1 ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) [ -z "$LOGDIR" ] || die "one LOGDIR only"; LOGDIR=$1 ;;
  esac
  shift
done
LOGDIR=${LOGDIR:-runs}
[ -d "$LOGDIR" ] || [ "$DRY_RUN" = 1 ] || die "no folder $LOGDIR yet: train first (launch/train.sh configs/default.yaml)"
say "tensorboard on http://$BIND:$PORT for the runs under $LOGDIR (Ctrl-C stops it)"
TB=("$PYTHON" -m tensorboard.main --logdir "$LOGDIR" --port "$PORT" --host "$BIND")
show "${TB[@]}"
if [ "$DRY_RUN" != 1 ]; then exec "${TB[@]}"; fi  # exec: signals reach tensorboard itself
