#!/usr/bin/env bash
# The session's H200 steps, one after another; each step's log in /root/job/<name>.log, its
# results in /root/job/out; /root/job/done.<name> records its exit status and seconds.
cd /root/srv
export PYTHONPATH=/tmp/site:/root/srv PYTHONUNBUFFERED=1 CCA_COMMIT=$(cat /root/job/commit)
export O=/root/job/out
step() {  # step NAME TIMEOUT CMD...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  echo "== $name start $(date -u +%T)" >> /root/job/steps.log
  timeout "$limit" "$@" > /root/job/$name.log 2>&1
  local rc=$?
  echo "$rc $(( $(date +%s) - t0 ))" > /root/job/done.$name
  echo "== $name rc=$rc $(( $(date +%s) - t0 ))s" >> /root/job/steps.log
}
while read -r name limit cmd; do
  [ -z "$name" ] && continue
  case "$name" in \#*) continue;; esac
  step "$name" "$limit" bash -c "$cmd"
done < /root/srv/benchmarks/device_chain/$(cat /root/job/steps_file)
echo finished > /root/job/finished
