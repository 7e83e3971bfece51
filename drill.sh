#!/bin/sh
# drill.sh: the endpoint's /models list, each prompts/*.txt DRILL_REPEAT times through ask.py, then the
# audit. Settings come from the environment (BASE_URL, API_KEY, MODEL_ID; LEDGER, PROMPTS, DRILL_REPEAT,
# PYTHON). Exit 0: every call answered and every check passed; 1: a call failed or a check did not pass
# (the summary says which); 2: a configuration error, and nothing more was tried. `make drill` runs this
# script, and make reports any non-zero exit as its own 2: cron runs `sh drill.sh` to tell 1 from 2.
here=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-python3}
LEDGER=${LEDGER:-calls.jsonl}
PROMPTS=${PROMPTS:-$here/prompts}
DRILL_REPEAT=${DRILL_REPEAT:-5}
ls "$PROMPTS"/*.txt >/dev/null || exit 2
calls=0 failed=0 missed=0
# first the /models list: the audit then flags a model the endpoint does not list
"$PYTHON" "$here/ask.py" --ledger "$LEDGER" --models >/dev/null
rc=$?
if [ $rc -eq 2 ]; then echo "drill: stopped: configuration error (see above)" >&2; exit 2; fi
if [ $rc -ne 0 ]; then echo "drill: the /models list could not be recorded (exit $rc)" >&2; fi
for prompt in "$PROMPTS"/*.txt; do
  expect="${prompt%.txt}.expect"
  i=0
  while [ $i -lt "$DRILL_REPEAT" ]; do
    i=$((i + 1))
    if [ -f "$expect" ]; then set -- --expect "$(cat "$expect")"; else set --; fi
    calls=$((calls + 1))
    # ask.py's stderr is kept for a failed call only: a check that did not pass is counted, not shouted
    err=$("$PYTHON" "$here/ask.py" --ledger "$LEDGER" --temperature 0 "$@" <"$prompt" 2>&1 >/dev/null)
    rc=$?
    case $rc in
      0) ;;
      2) printf '%s\n' "$err" >&2
         echo "drill: stopped: configuration error on $prompt" >&2
         exit 2 ;;
      3) missed=$((missed + 1)) ;;
      *) failed=$((failed + 1))
         printf '%s\n' "$err" >&2
         echo "drill: $prompt run $i: the call failed (exit $rc)" >&2 ;;
    esac
  done
done
"$PYTHON" "$here/audit.py" --by day "$LEDGER" || exit $?
echo "drill: $calls calls: $failed failed, $missed checks not passed"
[ $failed -eq 0 ] && [ $missed -eq 0 ] || exit 1
