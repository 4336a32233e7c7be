#!/usr/bin/env bash
# Installs what MoEX needs from Debian's packages; does nothing when all are present (idempotent).
# --test adds what only the tests use: Debian's headless Chromium (~220 MB installed) for the web page's browser
# test (tests/serve/web_browser_test.mjs, skipped without it); `make test` passes it, `make run` does not. It is
# best effort: where it cannot be installed (no package archive), one line says so and the browser test is
# skipped with its reason, rather than `make test` failing before any test ran.
set -euo pipefail
pkgs=(cmake g++ make pkg-config libgtest-dev libgmock-dev libbenchmark-dev libopenmpi-dev openmpi-bin
      nlohmann-json3-dev libcli11-dev libsentencepiece-dev python3-torch python3-numpy gnuplot-nox clang
      libclang-rt-14-dev libpcre2-dev libutf8proc-dev libxxhash-dev python3-sentencepiece
      libcpp-httplib-dev python3-jinja2 python3-prometheus-client
      iproute2)  # ip and tc: scripts/cluster.sh's namespace hosts (tests/cluster)
test_pkgs=()
if [ "${1:-}" = "--test" ]; then test_pkgs=(chromium-headless-shell); fi
missing=()
# Node.js and npm (the openai client, HF tokenizers and llama.cpp in the tests): Debian's, unless a node is already there.
command -v node >/dev/null 2>&1 || pkgs+=(nodejs)
command -v npm >/dev/null 2>&1 || pkgs+=(npm)
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
missing_test=()
for p in "${test_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing_test+=("$p")
done
[ ${#missing[@]} -eq 0 ] && [ ${#missing_test[@]} -eq 0 ] && exit 0
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO=sudo
if [ ${#missing[@]} -gt 0 ]; then
  echo "install-deps: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
if [ ${#missing_test[@]} -gt 0 ]; then
  echo "install-deps: installing ${missing_test[*]} (tests only)"
  { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
      "${missing_test[@]}"; } ||
    echo "install-deps: could not install ${missing_test[*]}; the tests that need it will be skipped" >&2
fi
