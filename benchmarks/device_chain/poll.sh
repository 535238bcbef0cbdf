#!/usr/bin/env bash
# poll.sh SECONDS [STEP]: wait until STEP (or the whole chain) is done or SECONDS pass; tar /root/job to $OUT.
limit=${1:-300}; want=${2:-}
t0=$(date +%s)
while [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do
  [ -f /root/job/finished ] && break
  [ -n "$want" ] && [ -f /root/job/done.$want ] && break
  sleep 5
done
cat /root/job/steps.log 2>/dev/null
nvidia-smi --query-gpu=memory.used,power.draw --format=csv,noheader 2>/dev/null
tar czf $OUT/job.tgz -C /root job 2>/dev/null
ls /root/job
