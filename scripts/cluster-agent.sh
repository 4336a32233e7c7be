#!/bin/sh
# mpirun's remote-shell agent for the hosts of scripts/cluster.sh: `--mca plm_rsh_agent` runs it as it would
# run ssh, `cluster-agent.sh [options] HOST COMMAND...`, to start an orted on HOST. The command is a shell
# command line (ssh would hand it to the remote user's shell), so it runs through sh -c. It runs in HOST's
# network namespace and, like a real host, in a UTS namespace of its own whose hostname is HOST: OpenMPI
# then sees a node named as in the hostfile, and MPI_Get_processor_name tells the hosts apart. The command
# gets a bare environment, as over ssh: what the ranks need from mpirun's goes with `mpirun -x NAME`, so a
# command that works here works on a real cluster.
# On a real cluster, ssh takes this script's place (docs/comm.md, "Running across hosts").
set -eu
while [ $# -gt 0 ]; do
  case "$1" in
    -[1246AaCfGgKkMNnqsTtVXxYy]) shift ;;  # ssh's options without a value
    -*) shift 2 ;;                         # and with one (-p PORT, -o OPTION, ...)
    *) break ;;
  esac
done
[ $# -ge 2 ] || { echo "cluster-agent.sh: usage: cluster-agent.sh HOST COMMAND..." >&2; exit 2; }
host=$1
shift
ip netns list | awk '{print $1}' | grep -qxF -- "$host" ||
  { echo "cluster-agent.sh: no host '$host' (scripts/cluster.sh up N makes them)" >&2; exit 2; }
exec env -i PATH="$PATH" HOME="${HOME:-/}" USER="$(id -un)" LOGNAME="$(id -un)" SHELL=/bin/sh \
  ip netns exec "$host" unshare --uts sh -c 'hostname "$1" && shift && exec sh -c "$*"' sh "$host" "$@"
