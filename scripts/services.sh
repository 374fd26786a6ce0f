#!/usr/bin/env bash
# The services the tests start themselves, from Debian: redis-server (the Redis tier and the cluster) and
# chromium (the page tests, driven by Playwright; it downloads no browser). `make test` runs this first.
# Root: installs what is missing. Not root: names the command to run, in one line, and fails.
set -euo pipefail
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
    echo "the tests need ${missing[*]}: run 'sudo apt-get update && sudo apt-get install -y ${missing[*]}', then make test again" >&2
    exit 1
fi
echo "installing ${missing[*]} from Debian (the tests start them)"
apt-get update -q
DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
