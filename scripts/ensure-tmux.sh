#!/usr/bin/env bash
# Installs Debian's tmux for the console test that drives `undying run` in a real terminal
# (tests/e2e/test_console.py) when it is missing and this machine can (root with apt-get). Never
# fails the caller: without tmux that test skips, unless UNDYING_REQUIRE_TMUX=1 (CI) makes the
# missing terminal an error.
command -v tmux >/dev/null 2>&1 && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing tmux (Debian) for the console's terminal test"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q tmux >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q tmux >/dev/null 2>&1; } \
        || echo "note: could not install tmux"
fi
command -v tmux >/dev/null 2>&1 || echo "note: tmux not found; the console's terminal test will be skipped"
exit 0
