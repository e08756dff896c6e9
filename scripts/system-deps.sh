#!/usr/bin/env bash
# Installs the Debian packages the test suite drives (Chromium + driver for the browser tests,
# docker-compose, docker.io and debootstrap to build and run docker-compose.yml, gcc for the SageMaker toolkit test's virtualenv, the
# King James Bible for the token-data tests and demo: scripts/corpus_kjv.py, OpenSSH's server for the
# Slurm SSH transport's tests: tests/sshkit.py, Slurm and munge for the Slurm backend's: tests/slurmkit.py) and
# starts PostgreSQL and Redis when they are down.
set -euo pipefail

need=()
[ -x /usr/bin/chromium ] || need+=(chromium)
[ -x /usr/bin/chromedriver ] || need+=(chromium-driver)
command -v docker-compose >/dev/null || need+=(docker-compose)
# The compose e2e test's own engine and its base images built from Debian's packages
# (tests/e2e/test_compose_stack.py, scripts/docker-bases.sh).
command -v dockerd >/dev/null || need+=(docker.io)
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v npm >/dev/null || need+=(npm)
command -v gcc >/dev/null || need+=(gcc)  # sagemaker-training's C extension (the SageMaker toolkit test)
[ -x /usr/bin/bible ] || need+=(bible-kjv)  # the public-domain text corpus (scripts/corpus_kjv.py)
[ -x /usr/sbin/sshd ] || need+=(openssh-server)  # a real sshd for cloud_adapters.slurm.ssh (tests/sshkit.py)
# A real two-node Slurm 22.05 for the Slurm backend's tests (tests/slurmkit.py): no systemd needed.
[ -x /usr/sbin/slurmctld ] || need+=(slurmctld)
[ -x /usr/sbin/slurmd ] || need+=(slurmd)
command -v sbatch >/dev/null || need+=(slurm-client)
[ -x /usr/sbin/munged ] || need+=(munge)
# Open MPI for the mpi framework's tests (mpirun, and mpicc for mpi4py in its test venv: tests/framework_venvs.py).
command -v mpirun >/dev/null || need+=(openmpi-bin)
[ -x /usr/bin/mpicc ] || need+=(libopenmpi-dev)
if [ ${#need[@]} -gt 0 ]; then
    echo "installing Debian packages: ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

if ! pg_isready -h 127.0.0.1 -p 5432 -q 2>/dev/null; then
    echo "starting PostgreSQL"
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start
fi
if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
    echo "starting Redis"
    mkdir -p /var/lib/redis /var/log/redis
    redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
        --dir /var/lib/redis --logfile /var/log/redis/ci.log
fi
for _ in $(seq 1 30); do
    pg_isready -h 127.0.0.1 -p 5432 -q && redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && exit 0
    sleep 1
done
echo "PostgreSQL or Redis did not come up on 127.0.0.1" >&2
exit 1
