cd "$(git rev-parse --show-toplevel)"
for c in i8t512 i4t256 i8t128 i4t128; do
  for s in 0 1; do
    KVTUNE_QUEST_SUMMARY=$s python3 -m kvtune quality --config lab/logs/run54/quality/config_$c.json --windows 1 --prefill 2048 --decode 16 --no-passkey --aggregation-prompts 16 --device cpu --json lab/logs/run54/quality/$c.s$s.json > lab/logs/run54/quality/$c.s$s.log 2>&1
    echo "$(date +%T) $c s$s rc=$?" >> lab/logs/run54/quality/done.log
  done
done
