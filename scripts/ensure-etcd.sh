#!/usr/bin/env bash
# Installs Debian's etcd-server for the controller-failover tests when it is missing and this
# machine can (root with apt-get). Never fails the caller: without etcd those tests skip, unless
# UNDYING_REQUIRE_ETCD=1 (CI) makes the missing server an error.
command -v etcd >/dev/null 2>&1 && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing etcd-server (Debian) for the controller-failover tests"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q etcd-server >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q etcd-server >/dev/null 2>&1; } \
        || echo "note: could not install etcd-server"
fi
command -v etcd >/dev/null 2>&1 || echo "note: etcd not found; the controller-failover tests will be skipped"
exit 0
