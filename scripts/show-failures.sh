#!/usr/bin/env bash
# Print what a failed pytest run wrote about its failures (the FAILURES and ERRORS sections and
# the short summary), capped, so that CI's own output names the test and its cause: the side
# runs (Celery minors, floors) write their logs under .compat/, which a CI run does not keep.
#
#   scripts/show-failures.sh LOG [LINES]
log=$1
lines=${2:-300}
sed -n '/^=\+ \(FAILURES\|ERRORS\) =\+$/,$p' "$log" | head -n "$lines"
