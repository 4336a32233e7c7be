#!/usr/bin/env bash
# Installs what MoEX needs from Debian's packages; does nothing when all are present (idempotent).
set -euo pipefail
pkgs=(cmake g++ make pkg-config libgtest-dev libgmock-dev libbenchmark-dev libopenmpi-dev openmpi-bin
      nlohmann-json3-dev libcli11-dev libsentencepiece-dev python3-torch python3-numpy gnuplot-nox clang
      libclang-rt-14-dev
      libcpp-httplib-dev python3-jinja2 python3-prometheus-client)
# tests/serve drive `moex serve` with the official `openai` npm package: Node and npm from Debian when the
# machine has no node of its own.
command -v node > /dev/null && command -v npm > /dev/null || pkgs+=(nodejs npm)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "install-deps: installing ${missing[*]}"
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO=sudo
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
