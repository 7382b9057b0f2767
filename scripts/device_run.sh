#!/usr/bin/env bash
# One step of the GPU verification and measurement plan, sized for one device call (< 600 s each), results under
# $OUT (the device tool brings them back). Run from the repository root on the device machine, after installing
# the wheels (see ../shared/device/README.md):
#   bash scripts/device_run.sh tests     # GPU tests: expert kernels, the card, PDL (a summary line each)
#   bash scripts/device_run.sh tests2    # GPU tests: dense kernels
#   bash scripts/device_run.sh tests3    # GPU tests: the daemon (modes, split / rejoin, swaps, a killed peer)
#   TESTS="FILE::TEST ..." bash scripts/device_run.sh tests   # those tests only (a rerun of what failed; TESTS_K:
#                                        # a pytest -k expression besides; PYTEST_ARGS=-rP: passed tests' prints too;
#                                        # TESTS_S: seconds a file may take, 540)
#   TREES=". A.patch A.patch+B.patch" bash scripts/device_run.sh trees  # _ab1.. from this tree and patch files
#   TESTS_ab1="FILE ..." TESTS_K_ab1=EXPR bash scripts/device_run.sh ab-tests  # GPU tests in each tree _abN/
#   bash scripts/device_run.sh profile   # a3b IQ3_S: where a decode step's time goes (with and without PDL),
#                                        # and a prompt's
#   bash scripts/device_run.sh agents    # the agents scenario (host conversation cache) on two logical cards
#   bash scripts/device_run.sh misses    # the iq3_s mix half resident at 1K: the misses' settings (SHARES: split CPU
#                                        # pool / bus; AHEAD: fetched ahead on a guess; HOST=cpu: the CPU pool alone)
#   bash scripts/device_run.sh half      # the iq3_s mix half and a quarter resident (misses from the arena), this tree
#                                        # and each _ab*/ tree, alternating (FRACTIONS, ROUNDS)
#   bash scripts/device_run.sh dense-l2  # the dense mat-vecs of TYPES read from DRAM and from L2 (--warm)
#   bash scripts/device_run.sh mixes     # the engine bench on the a3b iq3_s and q4_k_m mixes
#   bash scripts/device_run.sh engine1   # a3b IQ3_S: the engine bench all resident (1K / 32K / 64K; TAG= names
#                                        # the JSON)
#   bash scripts/device_run.sh experts-types   # every expert type's decode kernels, fraction of the copy rate (TYPES;
#                                        # VARIANTS: launch shapes to compare, stratad/bench/experts.py VARIANTS)
#   bash scripts/device_run.sh experts-decode  # the decode expert kernels on the bench's launch shapes (IQ3_S)
#   bash scripts/device_run.sh experts-scan  # one token's decode expert kernels at 5 to 16 experts (TYPES, VARIANTS)
#   bash scripts/device_run.sh experts-ab  # the decode expert kernels alone on this tree and each tree _ab*/, twice
#                                        # (TYPES, default IQ3_S; CASES, default decode8,decode8c,tok8x8)
#   bash scripts/device_run.sh marginal  # a3b IQ3_S: each idempotent decode kernel's cost inside the graph (1K, 32K)
#   bash scripts/device_run.sh plans     # a3b 1K: the decode step with each mat-vec shape on each other plan
#   bash scripts/device_run.sh prefill32k  # a3b IQ3_S: a 32K prompt's profile in chunks of 4096 / 8192 tokens
#   bash scripts/device_run.sh engine    # a3b IQ3_S: the engine bench at 1K / 32K / 64K
#   bash scripts/device_run.sh engine-card  # the same at 50 % / 25 % resident (1K / 32K / 64K), misses read from the arena
#   bash scripts/device_run.sh experts-prompt  # the prompt expert kernels (tensor cores, dp4a) on a 1024-token chunk
#   bash scripts/device_run.sh seed13    # the seed table at 60K prompts, modes 1 and 3 (two logical cards; with
#                                        # CARDS=0,1 on two GPUs, the JSON named seed-*-cards01)
#   bash scripts/device_run.sh seed2     # the same, mode 2
#   bash scripts/device_run.sh seed-card # modes 2 and 3 at 4K prompts, misses read by the card from host memory
#   bash scripts/device_run.sh seed-mps  # modes 1 and 3 at 4K prompts without and with the CUDA MPS daemon (two
#                                        # lanes' kernels on one GPU: time slices vs one shared context)
#   bash scripts/device_run.sh ab        # the engine bench (all resident, 1K / 32K / 64K) on this tree and on each
#                                        # tree _ab*/ (`git archive`s of other revisions), in turn, twice
#   bash scripts/device_run.sh flash2    # the prefill attention kernel of the tree in _flash2/ (a `git archive` of
#                                        # another branch) against this tree's: its tests and a 32K prompt's profile
#   bash scripts/device_run.sh dense     # the dense kernels' bench: prompt attention (both shapes), decode attention
#                                        # (split, combine columns, the fused step) at 1K-128K, the 48-layer decode
#                                        # chain with and without fusions (SECTIONS= to choose)
#   bash scripts/device_run.sh x2-p2p    # two GPUs: topology, peer access, copies both ways peer to peer and through
#                                        # host memory (2 KB / 64 KB / 256 MB)
#   bash scripts/device_run.sh x2-tests  # two GPUs: the daemon's GPU tests with the lanes on cards 0 and 1
#   bash scripts/device_run.sh x2-paths  # two GPUs: seed modes 1 and 3 at 4K prompts, peer copies P2P vs through host
#   bash scripts/device_run.sh ncu-step  # a3b 1K: each decode kernel timed alone by Nsight Compute, summed a step;
#                                        # ncu-qkv: the qkv mat-vec with its RMSNorm in detail
#   bash scripts/device_run.sh ncu-src   # a3b, CONTEXT (1K): each decode kernel's stall samples by SASS instruction, DRAM / SM %
#   bash scripts/device_run.sh timeline  # a3b 1K / 32K: the replayed step's kernels as the GPU ran them (CUPTI)
#   bash scripts/device_run.sh ncu       # Nsight Compute on the kernels that hold the targets back (decode experts,
#                                        # decode attention, prompt experts on tensor cores, prompt flash attention):
#                                        # occupancy, issue rate, the stall reasons ncu's rules name
#   bash scripts/device_run.sh batch SECONDS STEP...  # the steps in order, each cut off where SECONDS would be
#                                        # passed, with the a3b model made in the background meanwhile (BG_MODEL=0:
#                                        # not, for steps that use other files)
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# The lanes' compiled kernels (cubins keyed by their source and options) from one fresh machine to the next: the
# outermost call starts from .kcache.tgz where the checkout carries it (run's carry: [".whl", ".kcache.tgz"]) and
# leaves the cache it ends with in $OUT/kcache.tgz (copy it to .kcache.tgz for the next call). A cold cache costs
# a call's first card ~30-60 s of NVRTC builds.
KCACHE_DIR=/tmp/stratad-kernels-$(id -u)
if [ -z "${KCACHE_TOP:-}" ]; then
    export KCACHE_TOP=$$
    [ -f .kcache.tgz ] && mkdir -p "$KCACHE_DIR" && tar -C "$KCACHE_DIR" -xzf .kcache.tgz --skip-old-files
    trap 'tar -C "$KCACHE_DIR" -czf "$OUT/kcache.tgz" . 2>/dev/null' EXIT
fi
A3B=/tmp/a3b-iq3s-skew1.gguf
SEED=/tmp/a3b-iq3s-skew0.7-topics2.gguf

tree_tag() {  # a tree of ab / experts-ab as its JSON names it: . -> this, _abN -> abN, env -> env
    case $1 in .) echo this ;; *) echo "${1#_}" ;; esac
}

experts_bench() {  # the command of the expert kernels' bench in this directory's tree (a script before session 24)
    if [ -f scripts/gpu_experts_bench.py ]; then echo python3 scripts/gpu_experts_bench.py
    else echo python3 -m stratad.cli bench --scenario experts; fi
}

bus_read() {  # this host's bus as the SMs read it (half-resident figures follow it: 34-51 GB/s on H100 hosts)
    timeout 60 python3 scripts/gpu_bus_read.py --shapes fetch --json "$OUT/bus-read.json" 2>&1 | tail -1
}

model() {  # path preset args...
    while [ -f /tmp/model-making ]; do sleep 2; done  # a batch's background model
    [ -f "$1" ] || python3 -m stratad.cli make-model --preset a3b --expert-quant IQ3_S --out "$@" | tail -1
}

case "${1:-}" in
tests | tests2 | tests3)
    files="tests/test_gpu_experts.py tests/test_gpu_card.py tests/test_gpu_pdl.py"
    [ "$1" = tests2 ] && files="tests/test_gpu_dense.py"
    [ "$1" = tests3 ] && files="tests/test_gpu_daemon.py"
    # the kernel tests in 8 processes where pytest-xdist came with the wheels (`pip download --no-deps
    # --only-binary=:all: pytest-xdist execnet -d .whl`): their NVRTC builds are most of their time; the daemon's
    # tests (tests3: lanes of their own on the GPU) one at a time. PYTEST_ARGS overrides.
    par=""
    [ "$1" != tests3 ] && python3 -c "import xdist" 2>/dev/null && par="-n 8"
    for f in ${TESTS:-$files}; do  # TESTS: other files or test ids (a rerun of what failed)
        log="$OUT/$(basename "${f%%::*}" .py)$([[ $f == *::* ]] && echo "-${f##*::}").log"
        # TESTS_S bounds each file's run: wrap this step in no timeout of its own (batch's deadline is safe). An
        # inner timeout puts pytest in a process group of its own, so an outer one kills the shell and leaves the
        # workers holding the GPU (session 41: the rest of that call ran time-sliced with them, every figure spoiled)
        timeout -k 10 "${TESTS_S:-540}" python3 -m pytest -q -m gpu -p no:cacheprovider ${PYTEST_ARGS-$par} "$f" \
            ${TESTS_K:+-k "$TESTS_K"} > "$log" 2>&1
        echo "$f: rc=$? $(tail -1 "$log")"
        grep -E "^(FAILED|ERROR) " "$log" | head -5
    done
    ;;
trees)  # the trees _ab1, _ab2, ... made here from this tree (the device has no git): TREES="SPEC ...", each SPEC
        # "." (this tree) or PATCH[+PATCH...] (this tree with those patch files applied in turn); a copy of the
        # packages and tests each. scripts/ab_trees.sh makes trees of other revisions in the checkout instead
    rm -rf _ab[0-9]*
    i=0
    for spec in ${TREES:?TREES names the trees}; do
        i=$((i + 1))
        mkdir "_ab$i"
        cp -r coordinator lane protos stratad scripts tests pyproject.toml "_ab$i/"
        if [ "$spec" != . ]; then
            IFS=+ read -ra patches <<< "$spec"
            for p in "${patches[@]}"; do patch -s -d "_ab$i" -p1 < "$p" || { echo "_ab$i: $p does not apply"; exit 1; }; done
        fi
        echo "_ab$i: $spec"
    done
    ;;
ab-tests)  # GPU tests in each tree _ab*/ with its own package first on the path: TESTS_abN / TESTS_K_abN (the
           # tests step's TESTS and TESTS_K, a pytest -k expression) for tree _abN, else TESTS / TESTS_K
    for tree in _ab*; do
        t=$(tree_tag "$tree")
        tv="TESTS_$t" kv="TESTS_K_$t"
        [ -n "${!tv:-${TESTS:-}}" ] || continue
        mkdir -p "$OUT/$t"
        (cd "$tree" && PYTHONPATH=/tmp/site:$PWD OUT=$OUT/$t TESTS="${!tv:-${TESTS:-}}" TESTS_K="${!kv:-${TESTS_K:-}}" \
            bash scripts/device_run.sh tests | sed "s|^|$t: |")
    done
    ;;
quick)  # what a short device call can check: the card, PDL, the tensor-core tiles; the all-resident engine bench
    for t in "tests/test_gpu_card.py" "tests/test_gpu_pdl.py" "tests/test_gpu_experts.py -k variants_or_mma_tiles_or_prefill"; do
        set -- $t
        log="$OUT/quick-$(basename "$1" .py).log"
        timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider "$1" ${2:+"$2"} ${3:+"${3//_or_/ or }"} > "$log" 2>&1
        echo "$t: rc=$? $(tail -1 "$log")"
    done
    bash "$0" engine1
    ;;
engine1)  # the all-resident engine bench
    model "$A3B" --router-skew 1.0
    timeout 150 python3 -m stratad.cli bench --scenario engine --model "$A3B" --fractions 1.0 \
        --contexts 1024,32768,65536 --json "$OUT/engine-resident${TAG:-}.json" 2>&1 | grep "^{'" | cut -c1-200
    ;;
agents)  # a3b IQ3_S: three conversations with 32K-token histories and four follow-ups of 512 new tokens each on two
        # logical cards (CARDS, default 0,0), with and without the host conversation cache ([gpu] host_kv_cache)
    model "$A3B" --router-skew 1.0
    timeout "${AGENTS_S:-540}" python3 -m stratad.cli bench --scenario agents --model "$A3B" --cards "${CARDS:-0,0}" --history 32768 \
        --turns 4 --new-tokens 512 --json "$OUT/agents.json" > "$OUT/agents.log" 2>&1
    echo "agents rc=$?"; tail -3 "$OUT/agents.log" | cut -c1-300
    ;;
mixes)  # the engine bench on llama.cpp's iq3_s and q4_k_m mixes of the a3b shape: all resident at 1K / 32K, and the
        # iq3_s mix half resident at 1K (the issue's targets: docs/perf-notes.md); on this tree, then on each tree
        # _ab*/ (scripts/ab_trees.sh) in turn, ROUNDS (1) times; MIXES (iq3_s q4_k_m) to choose; HALF_FRACTIONS (0.5)
    for mix in ${MIXES:-iq3_s q4_k_m}; do  # the files made side by side (~60-75 s each)
        m=/tmp/a3b-mix-$mix.gguf
        [ -f $m ] || (python3 -m stratad.cli make-model --preset a3b --router-skew 1.0 --mix $mix --out $m | tail -1) &
    done
    wait
    bus_read
    for round in $(seq "${ROUNDS:-1}"); do
        for tree in . _ab*; do
            [ -d "$tree" ] || continue
            tag="$(tree_tag "$tree")-$round"
            for mix in ${MIXES:-iq3_s q4_k_m}; do
                (cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m stratad.cli bench --scenario engine \
                    --model /tmp/a3b-mix-$mix.gguf --fractions 1.0 --contexts 1024,32768 \
                    --json "$OUT/engine-mix-$mix-$tag.json" 2>&1 | grep "^{'" | cut -c1-200 | sed "s|^|$tree: |")
            done
            [[ " ${MIXES:-iq3_s} " == *" iq3_s "* ]] || continue
            (cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m stratad.cli bench --scenario engine \
                --model /tmp/a3b-mix-iq3_s.gguf --fractions "${HALF_FRACTIONS:-0.5}" --contexts 1024 \
                --json "$OUT/engine-mix-iq3_s-half-$tag.json" 2>&1 | grep "^{'" | cut -c1-200 | sed "s|^|$tree: |")
        done
    done
    ;;
misses)  # the decode misses' settings half resident: the iq3_s mix at FRACTIONS (0.5) resident, 1K, one card for each
        # pair of SHARES ([gpu] host_cpu_share: 0) and AHEAD ([gpu] fetch_ahead: 0,2,8); HOST=cpu for the CPU pool
        # alone instead. Results stream to $OUT/misses-*.log, so a call cut short still brings back the cards that
        # finished
    m=/tmp/a3b-mix-iq3_s.gguf
    [ -f $m ] || python3 -m stratad.cli make-model --preset a3b --router-skew 1.0 --mix iq3_s --out $m | tail -1
    bus_read
    tag=${HOST:-card}
    timeout "${MISSES_S:-400}" python3 -u -m stratad.cli bench --scenario engine --model $m \
        --fractions "${FRACTIONS:-0.5}" --contexts 1024 --host-experts "$tag" \
        $([ "$tag" = card ] && echo --host-cpu-share "${SHARES:-0}" --fetch-ahead "${AHEAD:-0,2,8}") \
        --json "$OUT/engine-misses-$tag.json" > "$OUT/misses-$tag.log" 2>&1
    echo "misses $tag rc=$?"; grep "^{'" "$OUT/misses-$tag.log" | cut -c1-240
    ;;
half)  # the iq3_s mix's decode with misses read from the arena: the engine bench at FRACTIONS (0.5,0.25) resident, 1K,
      # on this tree and each tree _ab*/ (AB_TREES: those named) in turn, ROUNDS (2) times (the misses' bus time
      # dominates: bus_expert_*)
    m=/tmp/a3b-mix-iq3_s.gguf
    [ -f $m ] || python3 -m stratad.cli make-model --preset a3b --router-skew 1.0 --mix iq3_s --out $m | tail -1
    bus_read
    for round in $(seq "${ROUNDS:-2}"); do
        for tree in . ${AB_TREES:-_ab*}; do
            [ -d "$tree" ] || continue
            (cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m stratad.cli bench --scenario engine \
                --model $m --fractions "${FRACTIONS:-0.5,0.25}" --contexts 1024 \
                --json "$OUT/engine-half-$(tree_tag "$tree")-$round.json" 2>&1 | grep "^{'" | cut -c1-160 |
                sed "s|^|$tree: |")
        done
    done
    ;;
experts-ab)  # the decode expert kernels alone (8 pairs, and 8 tokens x 8), on this tree and each tree _ab*/ in turn,
            # twice: a kernel change's own effect, without the rest of the step (scripts/ab_trees.sh makes the trees)
    for round in 1 2; do
        for tree in . _ab*; do
            [ -d "$tree" ] || continue
            (cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout 120 $(experts_bench) --types "${TYPES:-IQ3_S}" \
                --cases "${CASES:-decode8,decode8c,tok8x8}" --variants default \
                --json "$OUT/experts-$(tree_tag "$tree")-$round.json" 2>&1 |
                grep '^{"' | cut -c1-150 | sed "s|^|$tree: |")
        done
    done
    ;;
experts-types)  # every expert type's decode kernels against the copy rate (issue #27: >= 20 % each); TYPES,
                # CASES (decode8,decode8c; bus1,bus2,bus8: experts read from host memory) to choose
    timeout 300 $(experts_bench) --types "${TYPES:-all}" --variants "${VARIANTS:-default}" --cases "${CASES:-decode8,decode8c}" \
        --json "$OUT/experts-types.json" 2>&1 |
        grep '^{"' | cut -c1-200
    ;;
experts-scan)  # one token's decode expert kernels at 5 / 8 / 11 / 16 experts (a3b gate/up: 24 block items an
              # expert against the SMs), TYPES (IQ1_S,IQ3_S), VARIANTS (default,hgroup)
    timeout 200 $(experts_bench) --types "${TYPES:-IQ1_S,IQ3_S}" --variants "${VARIANTS:-default,hgroup}" \
        --cases decode5,decode8,decode11,decode16 --json "$OUT/experts-scan.json" 2>&1 | grep '^{"' | cut -c1-200
    ;;
experts-decode)  # the decode expert kernels on the launch shapes the bench offers (warps, stages, rows a warp)
    timeout 200 $(experts_bench) --types IQ3_S --cases decode8,tok8x8 \
        --variants default,gu8w,deep,dn8w --json "$OUT/experts-decode.json" 2>&1 | grep '^{"'
    ;;
profile)
    model "$A3B" --router-skew 1.0
    timeout 150 python3 scripts/gpu_decode_profile.py --model "$A3B" --fractions 1.0,0.5 --json "$OUT/profile.json" \
        2>&1 | tail -3
    timeout 90 python3 scripts/gpu_decode_profile.py --model "$A3B" --fractions 1.0 --no-pdl \
        --json "$OUT/profile-nopdl.json" 2>&1 | tail -2
    for pdl in 1 0; do  # the long-context step with and without PDL (32K decoded 194 tok/s before PDL, 170 after)
        timeout 90 python3 scripts/gpu_decode_profile.py --model "$A3B" --fractions 1.0 $([ $pdl = 0 ] && echo --no-pdl) \
            --context 32768 --json "$OUT/profile-32k-pdl$pdl.json" 2>&1 | tail -1
    done
    timeout 150 python3 scripts/gpu_prefill_profile.py --model "$A3B" --fractions 1.0,0.5 --contexts 1024,32768 \
        --json "$OUT/prefill-profile.json" 2>&1 | tail -5
    ;;
marginal)  # a3b all resident: each idempotent kernel's cost inside the decode graph (launched twice), 1K and 32K
    model "$A3B" --router-skew 1.0
    for ctx in 1024 32768; do
        timeout 200 python3 scripts/gpu_decode_profile.py --model "$A3B" --fractions 1.0 --context $ctx --marginal \
            --tokens 32 --json "$OUT/marginal-$ctx.json" 2>&1 | grep -A20 "launched twice"
    done
    ;;
plans)  # a3b 1K all resident: the step with each mat-vec shape on each other plan, inside the graph
    model "$A3B" --router-skew 1.0
    timeout 420 python3 scripts/gpu_decode_profile.py --model "$A3B" --fractions 1.0 --context 1024 --tokens 32 \
        --iters 2 --plan-sweep --json "$OUT/plans.json" 2>&1 | grep -A48 "default plans"
    ;;
prefill32k)  # a3b all resident: a 32K prompt's profile by chunk size
    model "$A3B" --router-skew 1.0
    timeout 250 python3 scripts/gpu_prefill_profile.py --model "$A3B" --fractions 1.0 --contexts 32768 \
        --prompt-chunks 4096,8192 --json "$OUT/prefill32k-chunks.json" 2>&1 | tail -3
    ;;
engine)
    model "$A3B" --router-skew 1.0
    timeout 250 python3 -m stratad.cli bench --scenario engine --model "$A3B" --fractions 1.0,0.5 \
        --contexts 1024,32768,65536 --json "$OUT/engine.json" 2>&1 | grep "^{'" | cut -c1-200
    timeout 120 python3 -m stratad.cli bench --scenario engine --model "$A3B" --fractions 0.25 \
        --contexts 1024,32768 --json "$OUT/engine-0.25.json" 2>&1 | grep "^{'" | cut -c1-200
    ;;
engine-card)
    model "$A3B" --router-skew 1.0
    timeout 330 python3 -m stratad.cli bench --scenario engine --model "$A3B" --fractions 0.5,0.25 \
        --contexts 1024,32768,65536 --host-experts card --json "$OUT/engine-card.json" 2>&1 | grep "^{'" |
        cut -c1-260  # the issue's grid: 0.5 / 0.25 at 1K / 32K / 64K (the README lacks 25 % at 64K)
    timeout 120 python3 scripts/gpu_decode_profile.py --model "$A3B" --fractions 0.5 --host-experts card \
        --json "$OUT/profile-card.json" 2>&1 | tail -2
    ;;
experts-prompt)  # the expert prompt kernels alone (a 1K chunk); TYPES (IQ3_S), VARIANTS (the tile kernel's forms)
    timeout 400 $(experts_bench) --prompt --types "${TYPES:-IQ3_S}" \
        --variants "${VARIANTS:-default,mma-unroll1,mma-mpw4}" \
        --json "$OUT/experts-prompt.json" 2>&1 | grep '^{"' | cut -c1-200
    ;;
seed13 | seed2)
    model "$SEED" --router-skew 0.7 --topics 2
    modes=$([ "$1" = seed13 ] && echo 1,3 || echo 2)
    cards=${CARDS:-0,0}
    name="seed-${modes//,/}$([ "$cards" = 0,0 ] || echo "-cards${cards//,/}")"
    timeout 500 python3 -m stratad.cli bench --scenario seed --model "$SEED" --cards "$cards" --cache-fraction 0.475 \
        --contexts 61440 --tokens 96 --modes "$modes" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
    echo "rc=$?"
    python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
for m, cs in d['modes'].items():
    for c in cs:
        print(m, c['topic'], c['decode_tok_s'], 'ttft', c['ttft_s'], 'some card', c['share_some_card'],
              'next turn ttft', c['next_turn']['ttft_s'], 'cached', c['next_turn']['cached_tokens'])
" "$OUT/$name.json" 2>&1 | tail -6
    ;;
seed-card)
    model "$SEED" --router-skew 0.7 --topics 2
    timeout 300 python3 -m stratad.cli bench --scenario seed --model "$SEED" --cards 0,0 --cache-fraction 0.475 \
        --contexts 4096 --tokens 96 --modes 2,3 --host-experts card --json "$OUT/seed-4k-card.json" \
        > "$OUT/seed-4k-card.log" 2>&1
    python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
for m, cs in d['modes'].items():
    print(m, [(c['decode_tok_s'], c['share_some_card'], c['share_host_read']) for c in cs])
" "$OUT/seed-4k-card.json"
    ;;
seed-mps)
    model "$SEED" --router-skew 0.7 --topics 2
    run() {
        timeout 200 python3 -m stratad.cli bench --scenario seed --model "$SEED" --cards 0,0 --cache-fraction 0.475 \
            --contexts 4096 --tokens 96 --modes 1,3 --json "$OUT/seed-4k-$1.json" > "$OUT/seed-4k-$1.log" 2>&1
        python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
print(sys.argv[2], {m: [c['decode_tok_s'] for c in cs] for m, cs in d['modes'].items()})
" "$OUT/seed-4k-$1.json" "$1"
    }
    run plain
    if command -v nvidia-cuda-mps-control > /dev/null && nvidia-cuda-mps-control -d; then
        run mps
        echo quit | nvidia-cuda-mps-control
    else
        echo "no MPS daemon here"
    fi
    ;;
flash2)
    model "$A3B" --router-skew 1.0
    (cd _flash2 && PYTHONPATH=/tmp/site:$PWD timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_dense.py \
        -k "prefill_attention" > "$OUT/flash2-tests.log" 2>&1; echo "flash2 tests: rc=$? $(tail -1 "$OUT/flash2-tests.log")")
    for tree in . _flash2; do
        (cd $tree && PYTHONPATH=/tmp/site:$PWD timeout 100 python3 scripts/gpu_prefill_profile.py --model "$A3B" --fractions 1.0 \
            --contexts 1024,32768 --json "$OUT/prefill-$(basename "$(realpath $tree)").json" 2>&1 | tail -3)
    done
    ;;
dense-l2)  # the dense mat-vecs of TYPES (IQ3_S Q4_K) with their weights rotated through DRAM, then read from L2
    for t in ${TYPES:-IQ3_S Q4_K}; do
        for warm in "" --warm; do
            timeout 200 python3 scripts/gpu_dense_bench.py --sections matvec --match "$t" $warm \
                --json "$OUT/dense-$t${warm:+-warm}.json" 2>&1 | grep "^matvec" | sed "s|^|$t${warm:+ warm}: |"
        done
    done
    ;;
dense)
    timeout 400 python3 scripts/gpu_dense_bench.py --sections ${SECTIONS:-prefill,attention,chain} \
        --json "$OUT/dense-bench.json" 2>&1 | grep -E "attention|decode dense path" | cut -c1-160
    ;;
x2-p2p)
    nvidia-smi topo -m
    timeout 200 python3 scripts/gpu_p2p.py --json "$OUT/p2p.json"
    ;;
x2-tests)
    STRATAD_TEST_CARDS=0,1 timeout 560 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_daemon.py \
        > "$OUT/x2-tests.log" 2>&1
    echo "test_gpu_daemon.py on cards 0,1: rc=$? $(tail -1 "$OUT/x2-tests.log")"
    ;;
x2-paths)
    model "$SEED" --router-skew 0.7 --topics 2
    for copy in auto host; do
        timeout 250 python3 -m stratad.cli bench --scenario seed --model "$SEED" --cards 0,1 --peer-copy $copy \
            --cache-fraction 0.475 --contexts 4096 --tokens 96 --modes 1,3 --json "$OUT/x2-paths-$copy.json" \
            > "$OUT/x2-paths-$copy.log" 2>&1
        python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
print(sys.argv[2], {m: [(c['decode_tok_s'], c['share_some_card']) for c in cs] for m, cs in d['modes'].items()})
" "$OUT/x2-paths-$copy.json" "$copy"
    done
    ;;
ncu)
    command -v ncu > /dev/null || { echo "no ncu here"; exit 0; }
    prof() {  # name kernel-regex launches-to-skip command...
        local name=$1 kern=$2 skip=$3
        shift 3
        timeout 150 ncu --clock-control none --target-processes all -k "regex:$kern" -s "$skip" -c 1 \
            --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
            --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
            --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
            --page details --log-file "$OUT/ncu-$name.txt" "$@" > /dev/null 2>&1
        echo "== $name: rc=$?"
        grep -E "Duration|Achieved Occupancy|Theoretical Occupancy|Registers Per|Issue Slots Busy|Warp Cycles Per Issued|No Eligible|Memory Throughput|Compute \(SM\) Throughput|Est\. Speedup" \
            "$OUT/ncu-$name.txt" | sed 's/  */ /g' | cut -c1-230 | head -14
        # the stall reasons, cycles a warp spends in each per issued instruction, largest first
        grep -E "issue_stalled_.*ratio" "$OUT/ncu-$name.txt" | sed 's/  */ /g' | awk '{print $NF, $1}' | sort -gr | head -6
    }
    prof decode-gateup "expert_gateup$" 5 python3 -m stratad.cli bench --scenario experts --types IQ3_S --cases decode8 --iters 2 --reps 2
    prof decode-down "expert_down$" 5 python3 -m stratad.cli bench --scenario experts --types IQ3_S --cases decode8 --iters 2 --reps 2
    prof prompt-gateup-mma "expert_gateup_mma" 3 python3 -m stratad.cli bench --scenario experts --prompt --types IQ3_S --iters 2
    prof decode-attn "attn_split_hd128" 20 python3 scripts/gpu_dense_bench.py --sections attention
    model "$A3B" --router-skew 1.0
    prof prompt-flash "attn_flash_prefill_128" 30 python3 scripts/gpu_prefill_profile.py --model "$A3B" --fractions 1.0 \
        --contexts 8192
    ;;
ncu-step)  # a3b 1K all resident: every kernel of ~2 decode steps timed alone by Nsight Compute (no overlap, no PDL),
    # summed by name; then the qkv mat-vec with its RMSNorm in detail
    command -v ncu > /dev/null || { echo "no ncu here"; exit 0; }
    model "$A3B" --router-skew 1.0
    timeout 200 ncu --clock-control none --metrics gpu__time_duration.sum -s 6000 -c 800 --csv --page raw \
        --log-file "$OUT/ncu-step.csv" python3 scripts/gpu_decode_profile.py --model "$A3B" --fractions 1.0 \
        --context 1024 --tokens 48 --iters 2 > /dev/null 2>&1
    echo "== ncu-step: rc=$?"
    python3 scripts/ncu_sum.py "$OUT/ncu-step.csv" | tee "$OUT/ncu-step.txt"
    bash "$0" ncu-qkv
    ;;
ncu-qkv)
    command -v ncu > /dev/null || { echo "no ncu here"; exit 0; }
    model "$A3B" --router-skew 1.0
    timeout 150 ncu --clock-control none -k "regex:norm_matvec_q8_0" -s 300 -c 1 --section SpeedOfLight \
        --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
        --section MemoryWorkloadAnalysis --section SourceCounters \
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" --page details \
        --log-file "$OUT/ncu-qkv.txt" python3 scripts/gpu_decode_profile.py --model "$A3B" --fractions 1.0 \
        --context 1024 --tokens 16 --iters 2 > /dev/null 2>&1
    grep -E "Duration|Achieved Occupancy|Theoretical Occupancy|Registers Per|Issue Slots Busy|Warp Cycles Per Issued|No Eligible|Memory Throughput|Compute \(SM\) Throughput|Est\. Speedup|Grid Size|Waves" \
        "$OUT/ncu-qkv.txt" | sed 's/  */ /g' | cut -c1-200 | head -16
    grep -E "issue_stalled_.*ratio" "$OUT/ncu-qkv.txt" | sed 's/  */ /g' | awk '{print $NF, $1}' | sort -gr | head -6
    ;;
timeline)  # a3b all resident: the replayed decode step's kernels as the GPU ran them (CUPTI kernel records; needs
           # the cupti-python wheel in .whl/ and a libcupti of the driver's CUDA), at CONTEXTS (1024,32768) and
           # FRACTION (1.0: all resident; 0.5: half, misses read from the arena); MODEL
    m=${MODEL:-$A3B}  # MODEL: another file (a mix: /tmp/a3b-mix-iq3_s.gguf, made by the mixes step)
    [ "$m" != "$A3B" ] || model "$A3B" --router-skew 1.0
    lib=$(find /usr/local/cuda*/extras/CUPTI/lib64 $(python3 -c "import site; print(*site.getsitepackages())") \
        -name 'libcupti.so*' 2> /dev/null | head -1)
    ctxs=${CONTEXTS:-1024,32768}
    for ctx in ${ctxs//,/ }; do
        LD_LIBRARY_PATH=${lib:+$(dirname "$lib"):}${LD_LIBRARY_PATH:-} timeout 240 python3 scripts/gpu_decode_profile.py \
            --model "$m" --fractions "${FRACTION:-1.0}" --context "$ctx" --tokens 32 --iters 5 --timeline \
            --json "$OUT/timeline-$ctx${FRACTION:+-$FRACTION}.json" 2>&1 | grep -A40 "timeline over"
    done
    ;;
ncu-src)  # a3b all resident (MODEL), CONTEXT (1024): each decode kernel's stall samples by SASS instruction (one launch
         # each), with its speed-of-light summary (DRAM and SM throughput)
    command -v ncu > /dev/null || { echo "no ncu here"; exit 0; }
    m=${MODEL:-$A3B}  # MODEL: another file (as timeline's)
    [ "$m" != "$A3B" ] || model "$A3B" --router-skew 1.0
    ctx=${CONTEXT:-1024}
    for k in ${KERNELS:-norm_matvec_q8_0 matvec_q8_0_r1_k1 expert_gateup expert_down norm_matvec_f32 attn_split \
        attn_combine}; do  # KERNELS: a subset
        rep="/tmp/src-$k-$ctx"
        # NCU_EXACT=1: each name matched exactly (expert_gateup, not the prompt's expert_gateup_tiled too);
        # NCU_SKIP: launches of it skipped first (200: past a 1K prompt's, into the decode steps); NCU_SAMPLING: the
        # stall sampling period, 2^(5 + it) cycles (0 for a one-warp kernel such as route_pairs: auto gave 4 samples)
        kf="regex:^$k"
        [ "${NCU_EXACT:-0}" = 1 ] && kf=$k
        timeout 150 ncu --clock-control none -k "$kf" -s "${NCU_SKIP:-200}" -c 1 \
            --warp-sampling-interval "${NCU_SAMPLING:-auto}" --section WarpStateStats \
            --section SourceCounters --section SpeedOfLight -f -o "$rep" python3 scripts/gpu_decode_profile.py \
            --model "$m" --fractions 1.0 --context "$ctx" --tokens 8 --iters 2 > /dev/null 2>&1
        ncu --import "$rep.ncu-rep" --page details --section SpeedOfLight > "$OUT/sol-$k-$ctx.txt" 2>&1
        grep -E "DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Duration" "$OUT/sol-$k-$ctx.txt" | head -4
        ncu --import "$rep.ncu-rep" --page source --print-source sass --csv > "$OUT/src-$k-$ctx.csv" 2>&1 ||
            ncu --import "$rep.ncu-rep" --page source --csv > "$OUT/src-$k-$ctx.csv" 2>&1  # an older ncu
        cp "$rep.ncu-rep" "$OUT/"  # for another look (left out where too large to come back)
        python3 scripts/ncu_hot.py "$OUT/src-$k-$ctx.csv" 12 | tee "$OUT/src-$k-$ctx.txt" | cut -c1-150
    done
    ;;
ab)  # the all-resident engine bench on this tree and on each tree _ab*/ (`scripts/ab_trees.sh REV...` makes them
     # from git archives), ROUNDS (2) times in turn on one machine: the A/B a change needs (machines of one kind
     # differ by a few %); CONTEXTS=1024 for a quick pass over many trees (one per commit of a branch: each change's
     # own share)
    model "$A3B" --router-skew 1.0
    # AB_ENVS="NAME=VALUE ...;NAME=VALUE ...": this tree once more with each set (trees env1, env2, ..; AB_ENV: one);
    # the tree reads no switches from the environment since the options moved to the config, so this serves trees
    # of older revisions (their STRATAD_* switches)
    IFS=';' read -r -a envs <<< "${AB_ENVS:-${AB_ENV:-}}"
    for round in $(seq "${ROUNDS:-2}"); do
        for tree in . _ab* $(seq -f env%g 1 ${#envs[@]}); do
            [ -d "$tree" ] || [[ $tree == env* ]] || continue
            name="$OUT/ab-$(tree_tag "$tree")-$round.json"
            ev="AB_ENV_$(tree_tag "$tree")"
            extra=${!ev:-} dir=$tree  # AB_ENV_abN: tree _abN's own env (a branch's change behind a switch)
            if [[ $tree == env* ]]; then extra=${envs[${tree#env} - 1]} dir=.; fi
            (cd "$dir" && env $extra PYTHONPATH=/tmp/site:$PWD \
                timeout 150 python3 -m stratad.cli bench --scenario engine --model "$A3B" --fractions 1.0 \
                --contexts "${CONTEXTS:-1024,32768,65536}" --json "$name" 2>&1 | grep "^{'" | cut -c1-120 |
                sed "s|^|$tree: |")
        done
    done
    ;;
batch)
    end=$(($(date +%s) + $2))
    shift 2
    [ -f "$A3B" ] || [ "${BG_MODEL:-1}" = 0 ] || { touch /tmp/model-making; (python3 -m stratad.cli make-model --preset a3b --expert-quant IQ3_S \
        --router-skew 1.0 --out /tmp/a3b-part.gguf > "$OUT/make-model.log" 2>&1 && mv /tmp/a3b-part.gguf "$A3B"
        rm /tmp/model-making) & }
    for step in "$@"; do
        left=$((end - $(date +%s)))
        [ "$left" -gt 20 ] || { echo "== $step: skipped, ${left}s left"; continue; }
        echo "== $step ($left s left)"
        # the step in a session of its own, all of it killed at the deadline: a timeout inside a step puts its
        # command in a process group of its own, which an outer timeout would not reach (pytest's workers then
        # hold the GPU into the next step)
        sid=/tmp/step-$$.sid
        setsid bash -c 'echo $$ > "$0"; exec bash "$1" "$2"' "$sid" "$0" "$step" &
        pid=$!
        while kill -0 "$pid" 2> /dev/null && [ "$(date +%s)" -lt "$end" ]; do sleep 1; done
        [ -f "$sid" ] && pkill -KILL -s "$(cat "$sid")" 2> /dev/null
        wait "$pid" 2> /dev/null
        rm -f "$sid"
    done
    # at most 8 files come back from a call: the steps' files in one archive (beside the kernel cache)
    (cd "$OUT" && tar -czf /tmp/results.tgz --exclude=./kcache.tgz . &&
        find . -mindepth 1 -maxdepth 1 ! -name kcache.tgz -exec rm -rf {} + && mv /tmp/results.tgz .)
    ;;
*)
    echo "usage: $0 tests|tests2|tests3|agents|mixes|profile|engine|engine-card|experts-prompt|seed13|seed2|seed-card|seed-mps|flash2|batch" >&2
    exit 2
    ;;
esac
