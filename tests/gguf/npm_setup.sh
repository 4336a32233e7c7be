#!/bin/sh
# Installs the pinned node-llama-cpp (package-lock.json) into tests/gguf/node_modules with `npm ci`, once per
# lock file: the stamp holds the lock file it installed. --ignore-scripts: its postinstall would try to build
# or download llama.cpp; the prebuilt CPU binaries come in the @node-llama-cpp/linux-x64 package itself.
set -eu
cd "$(dirname "$0")"
major=$(node -p 'process.versions.node.split(".")[0]' 2>/dev/null || echo 0)
if [ "$major" -lt 20 ]; then
  echo "tests/gguf: node-llama-cpp 3.21.1 needs Node.js >= 20, found $(node --version 2>/dev/null || echo none)" >&2
  exit 1
fi
if cmp -s package-lock.json node_modules/.moex-installed-lock 2>/dev/null; then exit 0; fi
npm ci --ignore-scripts --no-audit --no-fund
cp package-lock.json node_modules/.moex-installed-lock
