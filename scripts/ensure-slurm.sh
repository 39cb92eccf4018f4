#!/usr/bin/env bash
# Installs Debian's slurmctld, slurmd, slurm-client and munge for the Slurm tests
# (tests/faults/test_slurm.py, which start their own munged, slurmctld and three slurmd in a
# temporary directory) when they are missing and this machine can (root with apt-get). Never fails
# the caller: without them those tests skip, unless UNDYING_REQUIRE_SLURM=1 (CI) makes the missing
# packages an error.
have_slurm() {
    [ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ] && [ -x /usr/sbin/munged ] \
        && command -v sbatch >/dev/null 2>&1
}
have_slurm && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing slurmctld, slurmd, slurm-client and munge (Debian) for the Slurm tests"
    export DEBIAN_FRONTEND=noninteractive
    packages="slurmctld slurmd slurm-client munge"
    apt-get install -y -q $packages >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q $packages >/dev/null 2>&1; } \
        || echo "note: could not install $packages"
fi
have_slurm || echo "note: Slurm not found; the Slurm tests will be skipped"
exit 0
