#!/usr/bin/env bash
# Install what `devcluster.sh up` needs (Debian/Ubuntu, as root): Slurm daemons and
# clients, slurmdbd + MariaDB for accounting (sacct), munge. Does nothing when every
# command is already present, so CI and developers can run it unconditionally.
set -euo pipefail

need=()
command -v slurmctld >/dev/null || need+=(slurmctld)
command -v slurmd >/dev/null || need+=(slurmd)
command -v sbatch >/dev/null || need+=(slurm-client)
command -v slurmdbd >/dev/null || need+=(slurmdbd)
command -v munged >/dev/null || [ -x /usr/sbin/munged ] || need+=(munge)
[ -x /usr/sbin/mariadbd ] || need+=(mariadb-server)

if [ ${#need[@]} -eq 0 ]; then
  echo "devcluster-install: everything present"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "devcluster-install: missing ${need[*]}; run as root (apt-get install)" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
# man-db's trigger rebuilds the man index after every install: slow and useless in CI.
echo 'man-db man-db/auto-update boolean false' | debconf-set-selections
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
echo "devcluster-install: installed ${need[*]}"
