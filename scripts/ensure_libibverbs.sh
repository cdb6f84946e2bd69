#!/usr/bin/env bash
# Mooncake Store's import needs libibverbs.so.1 (Debian package libibverbs1; its TCP transport needs no RDMA
# device). Installs it with apt-get when missing and we are root; else says why the mooncake tests will skip.
# Used by setup.sh and check_extras.sh. Exits 0 either way (the callers decide what a missing library means).
if ldconfig -p 2>/dev/null | grep "libibverbs.so.1 " >/dev/null; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null 2>&1 \
    || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null)) \
    || echo "setup: could not install libibverbs1; mooncake tests will skip"
else
  echo "setup: libibverbs.so.1 not found and cannot apt-get install it; mooncake tests will skip"
fi
exit 0
