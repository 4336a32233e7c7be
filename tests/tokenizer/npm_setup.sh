#!/usr/bin/env bash
# Installs the pinned npm packages (package-lock.json) into $1/node_modules with `npm ci`, once per lock:
# a stamp beside node_modules holds the lock it was installed from.
set -euo pipefail
src="$(cd "$(dirname "$0")" && pwd)"
dest="$1"
mkdir -p "$dest"
if [ -f "$dest/.installed-lock" ] && cmp -s "$src/package-lock.json" "$dest/.installed-lock" && [ -d "$dest/node_modules/tokenizers" ]; then
  exit 0
fi
cp "$src/package.json" "$src/package-lock.json" "$dest/"
cd "$dest"
npm ci --no-audit --no-fund --prefer-offline
node -e "require('./node_modules/tokenizers')"  # the prebuilt binary loads on this machine
cp package-lock.json .installed-lock
