#!/usr/bin/env bash
# scripts/test.sh — every test, in one command, on a fresh Debian 12 machine (as root).
#   1. install the Debian packages of scripts/packages.txt (apt-get update + install, only if missing)
#   2. start the private PostgreSQL / RabbitMQ / Babelfish (scripts/services.sh start; in `all`
#      mode one set for each run, all at once, in the background while the builds compile)
#   3. make test; make SANITIZER=address+undefined test (one build with both AddressSanitizer
#      and UBSan: the whole suite once more, instrumented), at the same time, each build in
#      OUTBOX_TEST_PARTS runs (2) that share its tests out, each run against its own private
#      services (OUTBOX_TEST_PARALLEL=0: one build after the other, each in one run)
#      (`scripts/test.sh quick`: the plain build only; `scripts/test.sh valgrind`: plain + valgrind)
#   4. stop the services this run started; print "N passed, N failed, N skipped" last; exit non-zero on failure
# .ci/run calls this with CI=true (warnings become errors).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
ROOT=$PWD
MODE=${1:-all}
case $MODE in all|quick|valgrind) ;; *) echo "usage: $0 [all|quick|valgrind]" >&2; exit 2 ;; esac
export DEBIAN_FRONTEND=noninteractive
MAKEFLAGS="-j$(nproc 2>/dev/null || echo 2)"
export MAKEFLAGS
export PYTHON=/usr/bin/python3
# sanitizer behaviour for every instrumented program the tests spawn
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:strict_string_checks=1:detect_stack_use_after_return=1:check_initialization_order=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
if [[ -f tests/lsan.supp ]]; then   # optional: leaks inside third-party libraries
    export LSAN_OPTIONS="suppressions=$ROOT/tests/lsan.supp:print_suppressions=0"
fi
exec </dev/null

STEP_TIMEOUT=${OUTBOX_CI_STEP_TIMEOUT:-3600}  # per step; a hung test must not hang CI (CI allows 90 min)
LOGDIR=$(mktemp -d /tmp/outbox-ci.XXXXXX)
START=$SECONDS
say() { printf '\n=== test.sh: %s (%ds)\n' "$*" $((SECONDS - START)); }

# ------------------------------------------------------------------ packages
mapfile -t PKGS < <(grep -v '^[[:space:]]*\(#\|$\)' scripts/packages.txt | awk '{print $1}')
missing=()
for p in "${PKGS[@]}"; do
    [[ $(dpkg-query -W -f='${Status}' "$p" 2>/dev/null) == "install ok installed" ]] || missing+=("$p")
done
if ((${#missing[@]})); then
    say "installing ${missing[*]}"
    apt-get update -q || { echo "test.sh: apt-get update failed"; echo "0 passed, 1 failed, 0 skipped"; exit 1; }
    apt-get install -y -q --no-install-recommends "${PKGS[@]}" \
        || { echo "test.sh: apt-get install failed"; echo "0 passed, 1 failed, 0 skipped"; exit 1; }
else
    say "all ${#PKGS[@]} packages already installed"
fi

# ------------------------------------------------------------------ services
started_here=0
if ! scripts/services.sh status >/dev/null 2>&1; then started_here=1; fi
stop_services() {
    if ((started_here)); then scripts/services.sh stop >"$LOGDIR/stop.log" 2>&1 || cat "$LOGDIR/stop.log"; fi
    started_here=0
}
trap stop_services EXIT
PARALLEL=${OUTBOX_TEST_PARALLEL:-1}
# in `all` mode, the runs of each build at the same time (each with its tests' share)
PARTS=${OUTBOX_TEST_PARTS:-2}
if ! [[ $PARTS =~ ^[1-9]$ ]]; then
    echo "test.sh: OUTBOX_TEST_PARTS=$PARTS: want 1-9"; echo "0 passed, 1 failed, 0 skipped"; exit 2
fi
RUNS=$((2 * PARTS))
# svc_dir K: the private services of run K: the usual ones for run 0
svc_dir() { if (($1 == 0)); then echo "${OUTBOX_SERVICES_DIR:-$ROOT/.services}"; else echo "$ROOT/.services-run$1"; fi; }
if [[ $MODE == all && $PARALLEL == 1 ]]; then
    # the runs build while the services start (a build needs none); each run's tests wait
    # for its own (wait_started). The starts pick their ports one at a time (services.sh).
    say "starting the services of $RUNS runs (in the background, while the builds compile)"
    for ((k = 0; k < RUNS; k++)); do
        (OUTBOX_SERVICES_DIR=$(svc_dir $k) scripts/services.sh start >"$LOGDIR/start-$k.log" 2>&1
         echo $? >"$LOGDIR/start-$k.rc") &
    done
else
    say "starting services"
    if ! scripts/services.sh start; then
        echo "test.sh: scripts/services.sh start failed"
        stop_services
        echo "0 passed, 1 failed, 0 skipped"
        exit 1
    fi
fi
# wait_started RCFILE DEADLINE: waits for a background services.sh start to end (until
# $SECONDS reaches DEADLINE); its exit status, 124 when it had not ended by then
wait_started() {
    while [[ ! -s $1 ]]; do
        ((SECONDS < $2)) || return 124
        sleep 0.2
    done
    return "$(cat "$1")"
}

# ------------------------------------------------------------------ test runs
total_passed=0
total_failed=0
total_skipped=0
failed_steps=()

# tally NAME LOG RC: sums the pytest summary line of a step's log
tally() {
    local name=$1 log=$2 rc=$3
    if ((rc == 124 || rc == 137)); then echo "test.sh: $name: timed out after ${STEP_TIMEOUT}s"; fi
    local summary passed=0 failed=0 errors=0 skipped=0
    summary=$(grep -E '([0-9]+ (passed|failed|errors?|skipped|xfailed|xpassed|deselected|warnings?)|no tests ran).* in [0-9.]+s' "$log" | tail -n1 || true)
    [[ $summary =~ ([0-9]+)\ passed ]] && passed=${BASH_REMATCH[1]}
    [[ $summary =~ ([0-9]+)\ failed ]] && failed=${BASH_REMATCH[1]}
    [[ $summary =~ ([0-9]+)\ error ]] && errors=${BASH_REMATCH[1]}
    [[ $summary =~ ([0-9]+)\ skipped ]] && skipped=${BASH_REMATCH[1]}
    failed=$((failed + errors))
    if ((rc != 0 && failed == 0)); then failed=1; fi   # build failure or crash before pytest's summary
    total_passed=$((total_passed + passed))
    total_failed=$((total_failed + failed))
    total_skipped=$((total_skipped + skipped))
    if ((rc != 0)); then failed_steps+=("$name"); fi
    say "$name: exit $rc, $passed passed, $failed failed, $skipped skipped"
}

# run_step NAME make-args...: runs make with its output shown as it goes
run_step() {
    local name=$1; shift
    local log=$LOGDIR/$name.log
    say "$name: make $*"
    # a hung test must not hang CI: bound each step (the whole process group is killed)
    timeout -k 15 "$STEP_TIMEOUT" make "$@" 2>&1 | tee "$log"
    tally "$name" "$log" "${PIPESTATUS[0]}"
}

run_step format format-check   # the files the Makefile lists in FORMATTED follow .clang-format

# The plain and the instrumented suites are independent and mostly wait on the servers: each
# build runs in PARTS runs at the same time, all of them at once (OUTBOX_TEST_PARALLEL=0: the
# builds one after the other, each in one run), each run against its own private services
# (run 0: .services/, run K: .services-runK/); their logs are shown one after the other.
# run_tests NAME K [MAKE VARIABLES...]: run K's tests (OUTBOX_TEST_SHARE=K/RUNS), once its
# services are up; its log in $LOGDIR/NAME.log, its exit status in $LOGDIR/NAME.rc.
run_tests() {
    local name=$1 k=$2
    shift 2
    local log=$LOGDIR/$name.log rc=0 left
    wait_started "$LOGDIR/start-$k.rc" "$DEADLINE" || rc=$?
    cat "$LOGDIR/start-$k.log" >>"$log" 2>/dev/null
    if ((rc != 0)); then
        echo "test.sh: scripts/services.sh start ($(svc_dir "$k")) failed (exit $rc)" >>"$log"
        rc=1
    else
        left=$((DEADLINE - SECONDS))
        OUTBOX_SERVICES_DIR=$(svc_dir "$k") OUTBOX_TEST_SHARE=$k/$RUNS OUTBOX_TEST_PARTS=$PARTS \
            timeout -k 15 "$((left > 1 ? left : 1))" make "$@" test \
            PYTEST_ARGS="--durations=0 --durations-min=1" >>"$log" 2>&1
        rc=$?
    fi
    echo "$rc" >"$LOGDIR/$name.rc"
}
# run_name NAME J: the name of part J (0 ..) of build NAME's runs: NAME-1 .., NAME alone
# when PARTS is 1
run_name() { if ((PARTS == 1)); then echo "$1"; else echo "$1-$(($2 + 1))"; fi; }
# run_build NAME B [MAKE VARIABLES...]: build B's programs (once), then its PARTS runs
# (runs B*PARTS ..)
run_build() {
    local name=$1 b=$2 rc j run
    shift 2
    timeout -k 15 "$STEP_TIMEOUT" make "$@" all test-programs >"$LOGDIR/$name-build.log" 2>&1
    rc=$?
    for ((j = 0; j < PARTS; j++)); do
        run=$(run_name "$name" $j)
        if ((rc != 0)); then
            cat "$LOGDIR/$name-build.log" >"$LOGDIR/$run.log"
            echo "$rc" >"$LOGDIR/$run.rc"
        else
            (cat "$LOGDIR/$name-build.log" >"$LOGDIR/$run.log"
             run_tests "$run" $((b * PARTS + j)) "$@") &
        fi
    done
    wait
}
stop_run_services() {
    local k
    for ((k = 1; k < RUNS; k++)); do
        OUTBOX_SERVICES_DIR=$(svc_dir $k) scripts/services.sh stop >"$LOGDIR/stop-$k.log" 2>&1 || true
    done
}

if [[ $MODE == all && $PARALLEL == 1 ]]; then
    say "plain and asan+ubsan at the same time, $PARTS runs each (own services each)"
    trap 'stop_services; stop_run_services' EXIT
    DEADLINE=$((SECONDS + STEP_TIMEOUT))
    # the build-independent tests (pytest marker build_independent: nothing of the build runs
    # in them) and the T-SQL engine's (marker tsql: most of a run's CPU, in Babelfish's
    # parser) run in one of the runs; every other test once in each build (tests/conftest.py)
    (run_build plain 0) &
    p1=$!
    (run_build asan+ubsan 1 SANITIZER=address+undefined) &
    p2=$!
    wait "$p1" "$p2"
    for build in plain asan+ubsan; do
        for ((j = 0; j < PARTS; j++)); do
            name=$(run_name "$build" $j)
            say "$name: log"
            cat "$LOGDIR/$name.log"
            tally "$name" "$LOGDIR/$name.log" "$(cat "$LOGDIR/$name.rc" 2>/dev/null || echo 1)"
        done
    done
    stop_run_services
else
    run_step plain     test
    if [[ $MODE == all ]]; then
        run_step asan+ubsan SANITIZER=address+undefined test
    fi
    if [[ $MODE == valgrind ]]; then
        run_step valgrind  VALGRIND=1 test
    fi
fi

# ------------------------------------------------------------------ summary
stop_services
trap - EXIT
echo
echo "test.sh: logs in $LOGDIR; total time $((SECONDS - START))s"
if ((${#failed_steps[@]})); then
    echo "test.sh: FAILED steps: ${failed_steps[*]}"
fi
# "N passed, N failed" first (what CI tools parse), then the skips, so none goes unseen
echo "$total_passed passed, $total_failed failed, $total_skipped skipped"
((${#failed_steps[@]} == 0 && total_failed == 0))
