#!/usr/bin/env bash
# Usage: launch/rft.sh [--dry-run] [--from generate|train|test] CONFIG [section.key=value ...]
#
# Rejection-sampling fine-tuning in three stages, one after the other (docs/rft.md):
#   harness rft generate CONFIG [overrides]   sample answers, keep the verified ones
#   harness rft train    CONFIG [overrides]   fine-tune on them
#   harness rft test     CONFIG [overrides]   evaluate
# Resumable: a stage that finished writes <train.output_dir>/.rft-<stage>.done and is skipped when the script runs
# again, so after an interruption the same command continues where it stopped (the stages resume by themselves
# inside). --from STAGE reruns that stage and the ones after it. Paths are relative to the repository root.
#
# Environment (defaults in brackets):
#   RFT_STATE_DIR  where the .done markers go [the recipe's train.output_dir]
#   HARNESS        the harness command [$PYTHON -m harness.cli]
#   PYTHON, PERSIST_DIR, DRY_RUN: see launch/common.sh
set -euo pipefail
# shellcheck source=launch/common.sh
source "$(dirname "$0")/common.sh"

STAGES=(generate train test)
FROM=
CONFIG=
ARGS=()
while [ $# -gt 0 ]; do
  case $1 in
    -h | --help) usage; exit 0 ;;
    --dry-run) DRY_RUN=1 ;;
    --from) [ $# -ge 2 ] || die "--from needs a stage: ${STAGES[*]}"; FROM=$2; shift ;;
    --from=*) FROM=${1#--from=} ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) if [ -z "$CONFIG" ]; then CONFIG=$1; else ARGS+=("$1"); fi ;;
  esac
  shift
done
[ -n "$CONFIG" ] || die "usage: launch/rft.sh [--dry-run] [--from STAGE] CONFIG [overrides] (see --help)"
[ -f "$CONFIG" ] || die "config file not found: $CONFIG (paths are relative to the repository root)"
case " ${STAGES[*]} " in *" ${FROM:-generate} "*) ;; *) die "--from must be one of: ${STAGES[*]}; got '$FROM'" ;; esac
read -r -a HARNESS <<< "${HARNESS:-$PYTHON -m harness.cli}"
OUT=$(output_dir_of "$CONFIG" "${ARGS[@]}") || exit $?
STATE=${RFT_STATE_DIR:-$OUT}

rerun=0
for stage in "${STAGES[@]}"; do
  done_file=$STATE/.rft-$stage.done
  if [ "$stage" = "$FROM" ]; then rerun=1; fi
  if [ "$rerun" = 1 ] && [ -f "$done_file" ]; then run rm -f "$done_file"; fi
  if [ "$rerun" = 0 ] && [ -f "$done_file" ]; then
    say "$stage: done earlier ($done_file), skipped"
    continue
  fi
  say "$stage"
  extra=()
  if [ "$stage" = test ]; then extra=(--model "$OUT/final"); fi  # the model that rft train wrote
  run "${HARNESS[@]}" rft "$stage" "$CONFIG" "${ARGS[@]}" "${extra[@]}"
  if [ "$DRY_RUN" != 1 ]; then
    mkdir -p "$STATE"
    date -u +%FT%TZ > "$done_file"
  fi
done
if [ "$DRY_RUN" = 1 ]; then say "dry run: nothing started"; else say "all stages done; results in $STATE"; fi
