#!/usr/bin/env bash
# The browser of the dashboard tests (tests/browser): Debian's chromium and chromium-driver.
# Installed with apt when missing and this runs as root (or with password-less sudo); otherwise
# one line says why not, and the browser tests skip with the same reason. Idempotent.
set -u
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
  exit 0
fi
if [ "$(id -u)" = 0 ]; then SUDO=""; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
  echo "browser tests: chromium is not installed and this user cannot install it (apt-get install chromium chromium-driver as root)"
  exit 0
fi
if ! command -v apt-get >/dev/null; then
  echo "browser tests: chromium is not installed and there is no apt-get here (install chromium and its driver)"
  exit 0
fi
echo "installing chromium and chromium-driver for the browser tests (apt)"
$SUDO apt-get update -qq >/dev/null && \
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null \
  || echo "browser tests: apt-get could not install chromium (the tests will say so)"
exit 0
