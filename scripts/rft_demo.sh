#!/usr/bin/env bash
# The RFT demo on CPU (docs/rft.md): warm-up, test before, generate, train, test after, and a control that trains
# the warm-up model for the same number of steps on the SFT data alone.
#
#   bash scripts/rft_demo.sh [section.key=value ...]        # e.g. rft.oversample=16; RUN=runs/x to change the folder,
#                                                           # WARMUP_STEPS=N for another warm-up length
#
# Overrides go to every rft command (configs/rft-tiny.yaml). A finished warm-up in $RUN/warmup is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
RUN=${RUN:-runs/rft-tiny}
H=${HARNESS:-.venv/bin/harness}
RECIPE=configs/rft-tiny.yaml
common=("model.name_or_path=$RUN/warmup/final" "data.train_files=[$RUN/sft.jsonl]" "rft.output_dir=$RUN/generate"
        "train.progress_bar=false" "$@")
t0=$(date +%s)
times=()
timed() { local name=$1 s; shift; s=$(date +%s); "$@"; times+=("$name=$(( $(date +%s) - s ))"); }
$H rft sft-data $RECIPE "$@" --out "$RUN/sft.jsonl"
[ -f "$RUN/warmup/final/model.safetensors" ] || timed warmup $H train configs/rft-tiny-warmup.yaml \
  "data.train_files=[$RUN/sft.jsonl]" "train.output_dir=$RUN/warmup" train.progress_bar=false \
  ${WARMUP_STEPS:+train.max_steps=$WARMUP_STEPS}
timed test-before $H rft test $RECIPE "${common[@]}" --out "$RUN/test-before.json"
timed generate $H rft generate $RECIPE "${common[@]}"
timed train $H rft train $RECIPE "${common[@]}" "train.output_dir=$RUN/train"
timed test-after $H rft test $RECIPE "${common[@]}" --model "$RUN/train/final" --out "$RUN/test-after.json"
steps=$(python3 -c "import json; print(json.load(open('$RUN/train/report.json'))['steps'])")
timed control $H train $RECIPE "${common[@]}" "train.output_dir=$RUN/control" "train.max_steps=$steps"
timed test-control $H rft test $RECIPE "${common[@]}" --model "$RUN/control/final" --out "$RUN/test-control.json"
python3 - "$RUN" "$(( $(date +%s) - t0 ))" "${times[@]}" <<'PY'
import json, sys
run, secs = sys.argv[1], sys.argv[2]
stages = dict(x.split("=") for x in sys.argv[3:])
r = {k: json.load(open(f"{run}/test-{k}.json")) for k in ("before", "after", "control")}
g = json.load(open(f"{run}/generate/stats.json"))
print(f"[rft demo] generate: {g['questions_covered']} questions, {g['kept_examples']} kept, success rate "
      f"{g['success_rate']:.1%}, {g['sequences_per_s']:.1f} sequences/s")
for k, v in r.items():
    print(f"[rft demo] held-out accuracy {k:8s} {v['accuracy']:.1%}  answer rate {v['answer_rate']:.1%}  ({v['questions']} questions)")
print(f"[rft demo] seconds per stage: {', '.join(f'{k} {v}' for k, v in stages.items())}; generate -> train -> "
      f"test: {sum(int(stages[k]) for k in ('generate', 'train', 'test-after'))} s")
print(f"[rft demo] total {secs} s")
PY
