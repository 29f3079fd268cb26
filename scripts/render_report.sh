#!/usr/bin/env bash
# Render a report.html to a PNG with headless Chromium, to check the page by eye:
#   scripts/render_report.sh results/demo/state/report.html /tmp/report.png [width] [height]
# Needs chromium (Debian: apt-get install chromium). The page is self-contained, so the
# browser is kept off the network.
set -euo pipefail
html=$(realpath "$1")
out=$(realpath -m "${2:-report.png}")
width=${3:-1280}
height=${4:-4000}
browser=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
if [ -z "$browser" ]; then
    echo "render_report.sh: no chromium found (apt-get install chromium)" >&2
    exit 2
fi
profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT
"$browser" --headless --no-sandbox --disable-gpu --disable-background-networking --no-first-run \
    --disable-component-update --disable-sync --hide-scrollbars --user-data-dir="$profile" \
    --window-size="$width,$height" --screenshot="$out" "file://$html" >/dev/null 2>&1
echo "$out"
