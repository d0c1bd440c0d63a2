#!/usr/bin/env bash
# Render an `adaspan report` page (or any HTML file) headless to a PNG, to look at it as a
# reader would. Needs chromium (Debian: apt-get install -y chromium); not used by the tests.
#
#   scripts/docs/screenshot_report.sh RUN_DIR/report/report.html [OUT.png] [WIDTH] [HEIGHT]
#
# The page is rendered at WIDTH x HEIGHT pixels (default 1280 x 4000; the screenshot is cut
# at HEIGHT, so raise it for long pages). With a run directory instead of a page, the report
# is written first (adaspan report RUN_DIR).
set -euo pipefail

if [[ $# -lt 1 ]]; then
    sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
page=$1
out=${2:-/tmp/report.png}
width=${3:-1280}
height=${4:-4000}

if [[ -d $page ]]; then
    adaspan=${ADASPAN:-adaspan}
    "$adaspan" report "$page" --out "$page/report" >&2
    page=$page/report/report.html
fi
[[ -f $page ]] || { echo "no such page: $page" >&2; exit 2; }
browser=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
[[ -n $browser ]] || { echo "no chromium found: apt-get install -y chromium" >&2; exit 2; }

"$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars \
    --window-size="$width,$height" --screenshot="$out" "file://$(realpath "$page")" \
    2> >(grep -v -e '^\[' -e 'dbus' -e 'unexpected operator' -e 'bytes written' >&2 || true)
echo "$out"
