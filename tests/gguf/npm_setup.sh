#!/bin/sh
# Installs the pinned node-llama-cpp (package-lock.json) into tests/gguf/node_modules with `npm ci`, once per
# lock file: the stamp holds the lock file it installed. --ignore-scripts: its postinstall would try to build
# or download llama.cpp; the prebuilt CPU binaries come in the @node-llama-cpp/linux-x64 package itself.
set -eu
cd "$(dirname "$0")"
if cmp -s package-lock.json node_modules/.moex-installed-lock 2>/dev/null; then exit 0; fi
npm ci --ignore-scripts --no-audit --no-fund
cp package-lock.json node_modules/.moex-installed-lock
