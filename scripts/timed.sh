# Sourced by scripts/test.sh and .ci/run. `timed STEP COMMAND...` runs COMMAND and prints one line
# with STEP's wall time, also when it fails (its status is returned).
timed() {
    local step=$1 start=$SECONDS status=0
    shift
    "$@" || status=$?
    local took=$((SECONDS - start))
    printf '== %s: %d min %02d s%s\n' "$step" $((took / 60)) $((took % 60)) \
        "$([ "$status" = 0 ] || echo " (failed: exit $status)")"
    return "$status"
}
