#!/usr/bin/env bash
# Installs what MoEX needs from Debian's packages; does nothing when all are present (idempotent).
# --test adds what only the tests use: Debian's headless Chromium (~220 MB installed) for the web page's browser
# test (tests/serve/web_browser_test.mjs, skipped without it); `make test` passes it, `make run` does not.
set -euo pipefail
pkgs=(cmake g++ make pkg-config libgtest-dev libgmock-dev libbenchmark-dev libopenmpi-dev openmpi-bin
      nlohmann-json3-dev libcli11-dev libsentencepiece-dev python3-torch python3-numpy gnuplot-nox clang
      libclang-rt-14-dev libpcre2-dev libutf8proc-dev libxxhash-dev python3-sentencepiece
      libcpp-httplib-dev python3-jinja2 python3-prometheus-client
      iproute2)  # ip and tc: scripts/cluster.sh's namespace hosts (tests/cluster)
if [ "${1:-}" = "--test" ]; then pkgs+=(chromium-headless-shell); fi
missing=()
# Node.js and npm (the openai client, HF tokenizers and llama.cpp in the tests): Debian's, unless a node is already there.
command -v node >/dev/null 2>&1 || pkgs+=(nodejs)
command -v npm >/dev/null 2>&1 || pkgs+=(npm)
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "install-deps: installing ${missing[*]}"
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO=sudo
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
