#!/usr/bin/env bash
# Run a command as if on a smaller machine: a memory cgroup with a hard limit (needs root).
#   bash scripts/memory-limit.sh 8G make test
# Prints the peak of the cgroup's anonymous (resident, not page-cache) memory
# (sampled every 2 s) when the command ends. cgroup v1 (memory controller) or v2.
set -euo pipefail
limit=$(numfmt --from=iec "$1"); shift
name=hs-limit-$$
if [ -f /sys/fs/cgroup/cgroup.controllers ]; then  # v2
  dir=/sys/fs/cgroup/$name
  mkdir "$dir"; echo "$limit" >"$dir/memory.max"; stat=$dir/memory.stat
else  # v1: under our own memory cgroup
  base=/sys/fs/cgroup/memory$(awk -F: '$2=="memory"{print $3}' /proc/self/cgroup)
  dir=$base/$name
  mkdir "$dir"; echo "$limit" >"$dir/memory.limit_in_bytes"; stat=$dir/memory.stat
  # sandboxes that report RAM from the cgroup show the smaller machine to the command, too
  [ -f "$dir/memory.shown_ram_in_bytes" ] && echo "$limit" >"$dir/memory.shown_ram_in_bytes" || true
fi
peakfile=/tmp/$name.peak
( stat_file=$stat; peak=0
  while sleep 2; do
    v=$(awk '$1=="total_rss"||$1=="anon"{print int($2/1048576); exit}' "$stat_file" 2>/dev/null)
    if [ -n "$v" ] && [ "$v" -gt "$peak" ]; then peak=$v; echo "$peak" >"$peakfile"; fi
  done ) &
sampler_pid=$!
rc=0
bash -c 'echo $$ >"$1/cgroup.procs"; shift; exec "$@"' _ "$dir" "$@" || rc=$?
kill "$sampler_pid" 2>/dev/null || true
oom=$(cat "$dir/memory.oom_control" "$dir/memory.events" 2>/dev/null | awk '$1=="oom_kill"{print $2; exit}' || true)
echo "memory-limit: limit $(numfmt --to=iec "$limit"), peak anonymous memory $(cat "$peakfile" 2>/dev/null || echo '?') MiB," \
     "OOM kills ${oom:-?}"
rm -f "$peakfile"
for p in $(cat "$dir/cgroup.procs" 2>/dev/null); do kill -9 "$p" 2>/dev/null || true; done
sleep 1; rmdir "$dir" 2>/dev/null || true
exit $rc
