#!/usr/bin/env bash
# The trees device_run.sh ab compares: _ab1, _ab2, ... from `git archive` of each revision given, in order (the first
# is the base bench_table.py --ab measures against). Run in the checkout the device copies (it sends no .git, but
# does send untracked files that git does not ignore; ~3 MB a tree). `scripts/ab_trees.sh clean` removes them; do so
# before committing. REV+PATCH: the revision with a patch file applied (an experiment kept as a patch file, since
# branches do not outlive a session here); REV+P1+P2: several patches in turn.
#   scripts/ab_trees.sh a77b0e2            # then device_run.sh ab: this tree against a77b0e2, in turn
#   scripts/ab_trees.sh HEAD+/path/to/experiment.patch
set -eu
cd "$(git rev-parse --show-toplevel)"
rm -rf _ab[0-9]*
[ "${1:-}" = clean ] && exit 0
i=0
for rev in "$@"; do
    i=$((i + 1))
    mkdir "_ab$i"
    git archive "${rev%%+*}" | tar -x -C "_ab$i"
    if [[ $rev == *+* ]]; then
        IFS=+ read -ra patches <<< "${rev#*+}"
        for p in "${patches[@]}"; do git apply --directory="_ab$i" "$p"; done
    fi
    echo "_ab$i: $rev ($(git rev-parse --short "${rev%%+*}"))"
done
